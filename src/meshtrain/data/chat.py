"""Conversations to token ids plus a loss mask, for ``meshtrain prepare --format chat|prompt-completion`` (and the
pieces ``--format preference``, :mod:`meshtrain.data.preference`, reuses).

Imports no torch. Templates are rendered by transformers' own renderer
(``transformers.utils.chat_template_utils.render_jinja_template``, imported inside the functions that render), so
a conversation renders to the very string ``tokenizer.apply_chat_template`` renders.

Records (one per jsonl line or parquet row, :func:`meshtrain.data.sources.iter_records`), as transformers and
TRL define them:

- ``chat``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``, one assistant turn
  at least.
- ``prompt-completion``: ``{"prompt": P, "completion": C}``, both strings (TRL's "standard" form: no template,
  the tokenizer's EOS appended to the completion) or both message lists (the prompt rendered with the generation
  prompt, the completion is the rest of the whole conversation's render).

The template (:func:`find_template`): ``chat_template.jinja`` next to the tokenizer.json, else ``chat_template``
of its ``tokenizer_config.json`` (a string, or a list of ``{name, template}`` whose "default" is taken), else
:data:`CHATML` (the tokenizer gets ``<|im_start|>``/``<|im_end|>`` as special tokens when it lacks them: a
``tokenizer.json`` gets them in its added tokens, a tiktoken or sentencepiece file in the ``added_tokens_decoder`` of a
``tokenizer_config.json`` beside a copy of it, :mod:`meshtrain.data.tokenizers`).

The mask (1 = supervised): the assistant turns with their end-of-turn token (``<|im_end|>``), nothing else.
With ``{% generation %}`` markers in the template, the spans they enclose (as transformers' ``return_assistant_
tokens_mask``); without, assistant turn i spans from the end of the render of ``messages[:i]`` with the generation
prompt to the end of the render of ``messages[:i+1]``, trailing whitespace dropped (TRL's prefix method).

Per-segment tokenization: the rendered string is cut at the span edges and each piece is encoded on its own
(special tokens' text recognised, as ``apply_chat_template`` does), so no token straddles a mask edge. Where the
edges are also pre-tokenizer boundaries (a special token, or ``\\n`` before text, as in ChatML, Qwen, Llama 3
templates) this equals tokenizing the whole string; content that starts with whitespace right after ``\\n`` may
tokenize differently from transformers there (transformers then marks the merged token supervised).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshtrain.errors import ConfigError

CHAT, PROMPT_COMPLETION, PREFERENCE = "chat", "prompt-completion", "preference"
CONTENTS = (CHAT, PROMPT_COMPLETION, PREFERENCE)
ROLES = ("system", "user", "assistant")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}"
          "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
          "{{ '\\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""The default template: ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), each assistant content and its
``<|im_end|>`` inside ``{% generation %}``."""
DEFAULT_SOURCE = "the default ChatML"
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""transformers' test for generation markers in a template."""

Span = tuple[int, int]
"""Characters ``[start, end)`` of a rendered string."""


@dataclass(frozen=True)
class ChatFormat:
    """How records become (ids, mask): JSON-able, so worker processes rebuild it (:meth:`from_dict`)."""

    content: str
    """"chat", "prompt-completion" or "preference"."""
    template: str
    """The Jinja chat template."""
    source: str
    """Where the template came from (a file path, or :data:`DEFAULT_SOURCE`)."""
    special_tokens: dict[str, str]
    """Template variables ``bos_token``, ``eos_token``, ... (transformers passes ``special_tokens_map``)."""
    prompt_loss: bool = False
    """prompt-completion: supervise the prompt too."""

    @property
    def markers(self) -> bool:
        return bool(GENERATION_RE.search(self.template))

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatFormat:
        return cls(**d)


def chat_format(tok, content: str, prompt_loss: bool) -> tuple[ChatFormat, dict[str, str | bytes]]:
    """The format ``tok`` (a file tokenizer: Hugging Face, tiktoken or sentencepiece) encodes ``content`` with, and
    the files of an extended tokenizer to write next to the shards, the tokenizer file first
    (``{"tokenizer.json": ..., "tokenizer_config.json": ...}``, :func:`_chatml_files`; ``{}`` when ``tok`` is used as it
    is: it has a template, or has both ChatML tokens).

    Raises:
        ConfigError: an unreadable template entry.
    """
    folder = tok.path if tok.path.is_dir() else tok.path.parent
    special = _special_tokens(folder, tok)
    found = find_template(folder)
    if found is not None:
        return ChatFormat(content, found[0], found[1], special, prompt_loss), {}
    files = _chatml_files(tok, special)
    return ChatFormat(content, CHATML, DEFAULT_SOURCE, special, prompt_loss), files


def find_template(folder: Path) -> tuple[str, str] | None:
    """(template, its source) from ``folder``: ``chat_template.jinja``, else ``chat_template`` of
    ``tokenizer_config.json``; None when neither has one.

    Raises:
        ConfigError: a ``chat_template`` entry that is neither a string nor a list with a "default" template.
    """
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE)
    config = _read_json(folder / CONFIG_FILE)
    value, where = config.get("chat_template"), f"'{folder / CONFIG_FILE}' chat_template"
    if value is None:
        return None
    if isinstance(value, str):
        return value, str(folder / CONFIG_FILE)
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)} if isinstance(value, list) else {}
    if not isinstance(named.get("default"), str):
        raise ConfigError(f"{where} is not a string nor a list holding a {{\"name\": \"default\", \"template\": ...}} "
                          f"entry (names: {', '.join(map(str, named)) or 'none'}): give it a default template")
    return named["default"], f"{folder / CONFIG_FILE} (default)"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"'{path}' is not JSON ({e}): fix the tokenizer folder") from None
    return value if isinstance(value, dict) else {}


def _special_tokens(folder: Path, tok) -> dict[str, str]:
    """``*_token`` names of ``tokenizer_config.json`` then ``special_tokens_map.json`` (strings, or dicts with
    ``content``); BOS/EOS the tokenizer found (:mod:`meshtrain.data.tokenizers`) where neither names them."""
    names: dict[str, str] = {}
    for file in (CONFIG_FILE, "special_tokens_map.json"):
        for key, value in _read_json(folder / file).items():
            value = value.get("content") if isinstance(value, dict) else value
            if key.endswith("_token") and isinstance(value, str):
                names.setdefault(key, value)
    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        if key not in names and i is not None:
            names[key] = tok.id_to_token(i)
    return names


def _chatml_files(tok, special: dict[str, str]) -> dict[str, str | bytes]:
    """The extended tokenizer's files, the tokenizer file first: ``tok`` with the ChatML tokens it lacks added as
    special tokens (ids after its last), and a tokenizer_config.json naming its BOS/EOS and the template; ``{}`` when
    it has both tokens. A ``tokenizer.json`` holds them itself; a tiktoken or sentencepiece file is copied as it is
    (``tokenizer.tiktoken`` / ``tokenizer.model``) and the config's ``added_tokens_decoder`` holds them, with any the
    given tokenizer's config added before (:mod:`meshtrain.data.tokenizers`)."""
    missing = [t for t in CHATML_TOKENS if tok.token_to_id(t) is None]
    if not missing:
        return {}
    config = {k: special[k] for k in ("bos_token", "eos_token") if k in special} | {"chat_template": CHATML}
    if tok.kind == "hf":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFLib

        lib = HFLib.from_str(tok.data[0].decode("utf-8"))
        lib.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        return {"tokenizer.json": lib.to_str(pretty=True), CONFIG_FILE: json.dumps(config, indent=1) + "\n"}
    added = {i: t for t, i in tok.added.items()} | {tok.vocab_size + k: t for k, t in enumerate(missing)}
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, t in sorted(added.items())}
    suffix = ".tiktoken" if tok.kind == "tiktoken" else ".model"
    return {"tokenizer" + suffix: tok.data[0], CONFIG_FILE: json.dumps({"added_tokens_decoder": decoder} | config,
                                                                       indent=1, ensure_ascii=False) + "\n"}


def render(fmt: ChatFormat, messages: list[dict[str, Any]], where: str,
           generation_prompt: bool = False) -> tuple[str, list[Span]]:
    """(rendered text, generation-marker spans; [] without markers) of one conversation, by transformers.

    Raises:
        ConfigError: (naming ``where``) the template raised (its ``raise_exception`` message passed on) or failed.
    """
    from jinja2.exceptions import TemplateError, TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        texts, spans = render_jinja_template(conversations=[messages], chat_template=fmt.template,
                                             return_assistant_tokens_mask=fmt.markers,
                                             add_generation_prompt=generation_prompt, **fmt.special_tokens)
    except TemplateSyntaxError as e:
        raise ConfigError(f"the chat template of {fmt.source} is not valid Jinja (line {e.lineno}: {e.message}): "
                          f"fix the template") from None
    except TemplateError as e:
        what = "refused it" if type(e) is TemplateError else "failed on it"  # raise_exception raises the base class
        raise ConfigError(f"{where}: the chat template of {fmt.source} {what}: {_first_line(e)}") from None
    except Exception as e:  # a template is code: it may fail in any way
        raise ConfigError(f"{where}: the chat template of {fmt.source} failed to render it "
                          f"({type(e).__name__}: {_first_line(e)})") from None
    return texts[0], [tuple(s) for s in spans[0]] if spans else []


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def assistant_spans(fmt: ChatFormat, messages: list[dict[str, Any]], where: str) -> tuple[str, list[Span]]:
    """(rendered text, the spans to supervise): the generation markers' spans, else the prefix method (module
    docstring).

    Raises:
        ConfigError: a render of a prefix that is not a prefix of the whole render (the template rewrites earlier
            turns: add ``{% generation %}`` markers to it).
    """
    text, spans = render(fmt, messages, where)
    if fmt.markers:
        return text, spans
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = render(fmt, messages[:i], where, generation_prompt=True)
        upto, _ = render(fmt, messages[:i + 1], where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ConfigError(f"{where}: the chat template of {fmt.source} renders messages[:{i}] differently inside "
                              f"the whole conversation, so assistant turn {i} cannot be located: add {{% generation %}}"
                              f" markers around the assistant content in the template")
        spans.append((len(before), max(len(before), len(upto.rstrip()))))
    return text, spans


def pieces(text: str, spans: list[Span]) -> list[tuple[str, int]]:
    """``text`` cut at the edges of ``spans`` (sorted): (piece, 1 inside a span else 0), empty pieces dropped."""
    out, pos = [], 0
    for start, end in spans:
        start = max(start, pos)
        out += [(text[pos:start], 0), (text[start:end], 1)]
        pos = max(pos, end)
    out.append((text[pos:], 0))
    return [(piece, flag) for piece, flag in out if piece]


def encode_record(tok, fmt: ChatFormat, where: str, record: Any) -> tuple[list[int], list[int]]:
    """(ids, mask) of one record: each piece (:func:`pieces`) encoded on its own, special tokens recognised.

    Raises:
        ConfigError: a bad record (naming ``where`` and what is valid), or a template that fails on it.
    """
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not an object: each record must be an object")
    if fmt.content == CHAT:
        parts, tail = pieces(*assistant_spans(fmt, checked_messages(record, "messages", where), where)), []
    else:
        parts, tail = prompt_completion(tok, fmt, record, where)
    return encode_pieces(tok, parts, tail, where)


def encode_pieces(tok, parts: list[tuple[str, int]], tail: list[int], where: str) -> tuple[list[int], list[int]]:
    """(ids, mask): each (piece, flag) of ``parts`` encoded on its own (special tokens recognised), every id of it
    masked ``flag``, then the ``tail`` ids (supervised).

    Raises:
        ConfigError: (naming ``where``) a piece the tokenizer cannot encode.
    """
    ids, mask = [], []
    for piece, flag in parts:
        try:
            piece_ids = tok.encode_with_special(piece)
        except ValueError as e:
            raise ConfigError(f"{where} cannot be tokenized: {e}") from None
        ids += piece_ids
        mask += [flag] * len(piece_ids)
    return ids + tail, mask + [1] * len(tail)


def checked_messages(record: dict[str, Any], key: str, where: str, assistant: bool = True) -> list[dict[str, Any]]:
    """``record[key]`` checked as a message list (None-valued keys dropped, as transformers does)."""
    if key not in record:
        keys = ", ".join(list(record)[:8]) or "none"
        raise ConfigError(f"{where} has no '{key}' (its fields: {keys}): each record needs '{key}'")
    value = record[key]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: '{key}' must be a non-empty list of {{\"role\", \"content\"}} messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: {key}[{k}] must be an object with a string 'content' and a 'role'")
        if m.get("role") not in ROLES:
            raise ConfigError(f"{where}: {key}[{k}] has role {m.get('role')!r}: valid roles are {', '.join(ROLES)}")
        out.append({name: v for name, v in m.items() if v is not None})
    if assistant and not any(m["role"] == "assistant" for m in out):
        raise ConfigError(f"{where}: '{key}' has no assistant turn: a conversation needs one to learn from")
    return out


def prompt_completion(tok, fmt: ChatFormat, record: dict[str, Any], where: str, key: str = "completion"
                      ) -> tuple[list[tuple[str, int]], list[int]]:
    """(pieces, tail ids) of ``record["prompt"]`` followed by ``record[key]`` (module docstring); tail: [EOS] for
    strings. ``key`` names the completion (``--format preference`` passes "chosen", then "rejected")."""
    for name in ("prompt", key):
        if name not in record:
            raise ConfigError(f"{where} has no '{name}' (its fields: {', '.join(list(record)[:8]) or 'none'}): "
                              f"each record needs 'prompt' and '{key}'")
    prompt, completion = record["prompt"], record[key]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise ConfigError(f"{where}: '{key}' is empty: give each prompt a non-empty '{key}' to learn from")
        return [(p, f) for p, f in ((prompt, int(fmt.prompt_loss)), (completion, 1)) if p], [tok.eos_id]
    if isinstance(prompt, str) or isinstance(completion, str):
        raise ConfigError(f"{where}: 'prompt' and '{key}' must both be strings or both message lists")
    prompt = checked_messages(record, "prompt", where, assistant=False)
    completion = checked_messages(record, key, where, assistant=False)
    before, _ = render(fmt, prompt, where, generation_prompt=True)
    whole, _ = render(fmt, prompt + completion, where)
    if not whole.startswith(before):
        raise ConfigError(f"{where}: the chat template of {fmt.source} renders the prompt differently inside the "
                          f"whole conversation, so the {key} cannot be located")
    if len(whole) == len(before):
        raise ConfigError(f"{where}: '{key}' renders to nothing: give each prompt a non-empty '{key}' to learn from")
    return [(p, f) for p, f in ((before, int(fmt.prompt_loss)), (whole[len(before):], 1)) if p], []


def encode_records(tok, fmt: ChatFormat, records: list[tuple[str, Any]],
                   dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, lengths, mask) of ``records`` ((where, record) pairs) concatenated, one document each
    (:func:`concat_documents`).

    Raises:
        ConfigError: a bad record, or an id outside ``[0, vocab_size)`` (a broken tokenizer file).
    """
    return concat_documents(tok, [encode_record(tok, fmt, where, record) for where, record in records], dtype)


def concat_documents(tok, documents: list[tuple[list[int], list[int]]],
                     dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, lengths, mask) of ``documents`` ((ids, mask) each) concatenated: ids (N,) of ``dtype``, lengths (D,)
    int64, mask (N,) uint8.

    Raises:
        ConfigError: an id outside ``[0, vocab_size)`` (a broken tokenizer file).
    """
    ids, mask, lengths = [], [], []
    for doc_ids, doc_mask in documents:
        ids += doc_ids
        mask += doc_mask
        lengths.append(len(doc_ids))
    ids_array = np.asarray(ids, dtype=np.int64)
    if len(ids_array) and (ids_array.min() < 0 or ids_array.max() >= tok.vocab_size):
        raise ConfigError(f"--tokenizer gave id {int(ids_array.max())}, outside its {tok.vocab_size} ids: the "
                          f"tokenizer file is inconsistent")
    return ids_array.astype(dtype), np.asarray(lengths, dtype=np.int64), np.asarray(mask, dtype=np.uint8)
