"""Preference pairs to token ids plus a loss mask, for ``meshtrain prepare --format preference`` (data for direct
preference optimization, Rafailov et al. 2023, arXiv:2305.18290, Eq. 7: the loss compares the policy's and the
reference's log-probabilities of the chosen and the rejected completion of one prompt).

Imports no torch. Records (one per jsonl line or parquet row), TRL's "preference" type:

- ``{"prompt": P, "chosen": C, "rejected": R}``, all three strings (TRL's standard form) or all three message
  lists (conversational: P the prompt turns, C and R lists holding the assistant reply).
- The implicit-prompt form ``{"chosen": C, "rejected": R}`` (no ``prompt``, or a null one): the prompt is their
  common start, taken as TRL's ``extract_prompt`` takes it: the messages (or, for strings, the characters) up to
  the first that differ, a space just before the difference left to the completions; when one is a prefix of the
  other, all but the shorter one's last element.

Each pair becomes two consecutive documents, chosen first: prompt + chosen, then prompt + rejected, each encoded
exactly as ``--format prompt-completion`` encodes ``{"prompt": P, "completion": C}``
(:func:`meshtrain.data.chat.prompt_completion`): strings as ``encode(P) + encode(C) + [eos_id]``, messages as the
render of P with the generation prompt followed by the rest of the render of P + C. The mask is 1 on the
completion (and its EOS or end-of-turn token) only. The trainer reads pair k as documents 2k and 2k + 1 of a split
(:attr:`meshtrain.data.shards.PreparedData.is_preference`); the val split rule counts pairs, so the two documents
of a pair always land in the same split.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from meshtrain.errors import ConfigError
from meshtrain.data.chat import ChatFormat, concat_documents, encode_pieces, prompt_completion

KEYS = ("prompt", "chosen", "rejected")
COMPLETIONS = ("chosen", "rejected")
NEEDS = "each record needs 'prompt', 'chosen' and 'rejected' (or 'chosen' and 'rejected' starting with the prompt)"

Document = tuple[list[int], list[int]]
"""(ids, mask) of one document."""


def encode_pair(tok, fmt: ChatFormat, where: str, record: Any) -> tuple[Document, Document]:
    """(chosen document, rejected document) of one record (module docstring).

    Raises:
        ConfigError: (naming ``where`` and what is valid) a missing, empty or mistyped field, fields of different
            kinds, chosen and rejected with identical ids, or a template that refuses or fails on the record.
    """
    fields = _fields(record, where)
    chosen, rejected = (encode_pieces(tok, *prompt_completion(tok, fmt, fields, where, key), where)
                        for key in COMPLETIONS)
    if chosen[0] == rejected[0]:
        raise ConfigError(f"{where}: 'chosen' and 'rejected' give the same {len(chosen[0])} tokens: a pair must "
                          f"differ to teach a preference")
    return chosen, rejected


def encode_pairs(tok, fmt: ChatFormat, records: list[tuple[str, Any]],
                 dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, lengths, mask) of ``records`` ((where, record) pairs), two documents each (chosen, rejected),
    concatenated: ids (N,) of ``dtype``, lengths (2R,) int64, mask (N,) uint8.

    Raises:
        ConfigError: a bad record (:func:`encode_pair`), or an id outside ``[0, vocab_size)``.
    """
    documents = [doc for where, record in records for doc in encode_pair(tok, fmt, where, record)]
    return concat_documents(tok, documents, dtype)


def _fields(record: Any, where: str) -> dict[str, Any]:
    """``{"prompt", "chosen", "rejected"}`` of ``record``, checked to be all strings or all lists, the implicit
    prompt extracted (module docstring)."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not an object: each record must be an object")
    present = {key: record[key] for key in KEYS if record.get(key) is not None}
    for key in COMPLETIONS:
        if key not in present:
            fields = ", ".join(list(record)[:8]) or "none"
            raise ConfigError(f"{where} has no '{key}' (its fields: {fields}): {NEEDS}")
    kinds = {key: _kind(value) for key, value in present.items()}
    for key, kind in kinds.items():
        if kind not in ("string", "messages"):
            raise ConfigError(f"{where}: '{key}' is {json.dumps(present[key])[:40]}: it must be a string or a list "
                              f"of {{\"role\", \"content\"}} messages")
    for key in COMPLETIONS:
        if not present[key]:
            raise ConfigError(f"{where}: '{key}' is empty: give each prompt a non-empty '{key}' to learn from")
    if len(set(kinds.values())) > 1:
        found = ", ".join(f"{key} {kind}" for key, kind in kinds.items())
        raise ConfigError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all message lists "
                          f"(found {found})")
    if "prompt" in present:
        return present
    return _implicit_prompt(present["chosen"], present["rejected"], where)


def _kind(value: Any) -> str:
    return "string" if isinstance(value, str) else "messages" if isinstance(value, list) else type(value).__name__


def _implicit_prompt(chosen: str | list, rejected: str | list, where: str) -> dict[str, Any]:
    """``{"prompt", "chosen", "rejected"}`` split from two sequences (strings or message lists) that share the
    prompt as their start, as TRL's ``extract_prompt`` splits them."""
    n = min(len(chosen), len(rejected))
    k = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if k is None:  # one is a prefix of the other: TRL leaves the shorter one's last element to the completions
        k = n - 1
    elif k > 0 and chosen[k - 1] == " ":  # strings: the space before the first difference starts the completions
        k -= 1
    if k <= 0:
        raise ConfigError(f"{where} has no 'prompt', and its 'chosen' and 'rejected' share no start to take as the "
                          f"prompt: {NEEDS}")
    return {"prompt": chosen[:k], "chosen": chosen[k:], "rejected": rejected[k:]}
