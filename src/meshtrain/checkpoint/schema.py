"""The schema of a checkpoint's ``meta.json``: every key a save writes, its type and its range.

:func:`meshtrain.checkpoint.store.read_meta` checks it before anything uses a checkpoint, so an edited or
damaged ``meta.json`` is one line naming the file and the key, not a ``KeyError`` deep in a rank. The
files manifest ``files`` is required like the rest: deleting it does not turn off the size and SHA-256
check of the shards (:func:`meshtrain.checkpoint.store.verify_files`). Importing it imports no torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from meshtrain.axes import AXIS_TABLE
from meshtrain.config.load import SAVED_KEYS, check_saved_config
from meshtrain.errors import ConfigError

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _int_at_least(low: int) -> tuple[str, Callable[[Any], bool], Callable[[Any], bool]]:
    return f"an integer >= {low}", lambda v: isinstance(v, int) and not isinstance(v, bool), lambda v: v >= low


def _table(required: str, valid: Callable[[dict], bool]) -> tuple[str, Callable[[Any], bool], Callable[[Any], bool]]:
    return f"an object {required}", lambda v: isinstance(v, dict), valid


def _manifest_ok(files: dict) -> bool:
    """``{name: {"bytes": n >= 0, "sha256": 64 hex digits}}`` of plain file names, ``.metadata`` among them."""
    return ".metadata" in files and all(
        isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..")
        and isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool)
        and entry["bytes"] >= 0 and isinstance(entry.get("sha256"), str) and SHA256_RE.match(entry["sha256"])
        for name, entry in files.items())


def _tokenizer_ok(tok: dict) -> bool:
    """A tokenizer's ``to_dict`` (:mod:`meshtrain.data.tokenizers`): "char" with a non-empty string of distinct
    characters, or a file kind with the file's path and SHA-256."""
    from meshtrain.config.sections import TOKENIZER_KINDS

    if tok.get("kind") == "char":
        chars = tok.get("chars")
        return isinstance(chars, str) and len(chars) >= 1 and len(set(chars)) == len(chars)
    return (tok.get("kind") in TOKENIZER_KINDS and isinstance(tok.get("path"), str)
            and isinstance(tok.get("sha256"), str) and bool(SHA256_RE.match(tok["sha256"])))


META_SCHEMA: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], bool]]] = {
    "step": _int_at_least(1),
    "config": _table("with a 'model' object", lambda v: isinstance(v.get("model"), dict)),
    "tokenizer": _table("with a 'kind' among char, hf, tiktoken, sentencepiece: char with its distinct 'chars', "
                        "the others with their file's 'path' and 'sha256'", lambda v: _tokenizer_ok(v)),
    "corpus_sha256": ("a string of 64 hex digits", lambda v: isinstance(v, str), lambda v: bool(SHA256_RE.match(v))),
    "vocab_size": _int_at_least(1),
    "sampler": _table("with an integer 'samples_seen' >= 0",
                      lambda v: isinstance(v.get("samples_seen"), int) and v["samples_seen"] >= 0),
    "world_size": _int_at_least(1),
    **{str(s.axis): _int_at_least(1) for s in AXIS_TABLE if s.in_world},  # the layout it was saved at
    "global_batch_size": _int_at_least(1),
    "files": _table("mapping each file name (.metadata among them) to its 'bytes' and 'sha256'", _manifest_ok),
}
"""key -> (what it must be, its type check, its range check); every key is required."""

OPTIONAL = {"scheduler": dict, "async": dict, "source_hf_config": dict, "diloco_workers": int, "adapter_base": dict}
"""Keys one trainer writes and the other does not: the LR schedule's state, the parameter server's counts; the
``config.json`` of the Hugging Face model a run started from (``model.init_from``), which exports carry; and a DiLoCo
run's workers (its ``dp`` counts every worker's replicas)."""
BORROWED_DEGREES = {str(s.axis): _int_at_least(1) for s in AXIS_TABLE if not s.in_world}
"""The degrees of axes that borrow their ranks (ep): checkpoints written before the axis existed have none (1)."""


def check_meta(meta: Any, path: Path) -> dict[str, Any]:
    """``meta`` (parsed from ``path``) if it matches :data:`META_SCHEMA`. Raises ConfigError naming the file
    and the first key that is missing, of the wrong type or out of range."""
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint file {path} holds a JSON {type(meta).__name__}, not an object: the checkpoint "
                          f"is damaged; resume from another one")
    for key, (want, typed, in_range) in META_SCHEMA.items():
        if key not in meta:
            raise ConfigError(f"checkpoint file {path} has no key '{key}': the checkpoint is incomplete or was edited; "
                              f"resume from another one")
        if not typed(meta[key]) or not in_range(meta[key]):
            raise ConfigError(f"checkpoint file {path}: '{key}' = {_short(meta[key])} must be {want}: the checkpoint "
                              f"is damaged or was edited; resume from another one")
    try:
        check_saved_config(meta["config"], required=SAVED_KEYS)
    except ConfigError as e:
        raise ConfigError(f"checkpoint file {path}: in its saved config, {e}: the checkpoint is damaged or was edited; "
                          f"resume from another one") from None
    for key, (want, typed, in_range) in BORROWED_DEGREES.items():
        if key in meta and not (typed(meta[key]) and in_range(meta[key])):
            raise ConfigError(f"checkpoint file {path}: '{key}' = {_short(meta[key])} must be {want}: the checkpoint "
                              f"is damaged or was edited; resume from another one")
    for key, kind in OPTIONAL.items():
        if key in meta and not isinstance(meta[key], kind):
            what = "an integer" if kind is int else "an object"
            raise ConfigError(f"checkpoint file {path}: '{key}' = {_short(meta[key])} must be {what}: the "
                              f"checkpoint is damaged or was edited; resume from another one")
    return meta


def _short(value: Any) -> str:
    if isinstance(value, dict):  # its keys: the values may hold this machine's paths
        keys = sorted(map(str, value))
        return f"an object with keys {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}" if keys else "{}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
