"""Tokenizers behind one interface (``data.tokenizer``): characters, Hugging Face ``tokenizer.json``, tiktoken BPE
files and sentencepiece models. Imports no torch (``meshtrain prepare`` and the launcher's checks use it).

Every kind gives ``kind``, ``vocab_size`` (ids ``0 .. vocab_size - 1``, special tokens included), ``bos_id`` and
``eos_id`` (``None`` where the tokenizer has none; ``eos_id`` separates documents), ``encode`` (no special
tokens added; the text of a special token is encoded as plain text, as tiktoken's ``encode_ordinary`` does, so
a document cannot forge a separator), ``decode`` (an id outside the vocabulary, e.g. one a model with a padded
vocabulary samples, becomes U+FFFD) and ``to_dict`` (JSON-able; checkpoints store it and
:func:`tokenizer_from_dict` rebuilds it, refusing a tokenizer file that changed since).

Kinds (:func:`meshtrain.config.checks.tokenizer_kind` tells them apart from the path):

- ``char``: one id per distinct character of the training text, in sorted order (nanoGPT's ``shakespeare_char``).
- ``hf``: a ``tokenizer.json`` of the ``tokenizers`` library, or a Hugging Face model folder holding one.
  BOS/EOS are ``bos_token``/``eos_token`` of ``tokenizer_config.json`` (else ``special_tokens_map.json``) next
  to it, else the first known special token present (``<|begin_of_text|>``, ``<s>``, ... / ``<|end_of_text|>``,
  ``<|endoftext|>``, ``</s>``, ...).
- ``tiktoken``: a ``*.tiktoken`` file (one ``<base64 token> <rank>`` line per token) read with
  ``tiktoken.load.load_tiktoken_bpe`` from the local path (never a URL), split by :data:`TIKTOKEN_PAT_STR`.
  Special tokens follow Llama 3 (meta-llama/llama3 ``llama/tokenizer.py``): 256 ids after the last rank, the
  first two ``<|begin_of_text|>`` (BOS) and ``<|end_of_text|>`` (EOS); so Meta's Llama 3 file gives its ids.
- ``sentencepiece``: a ``*.model`` of the sentencepiece library; BOS/EOS are its ``bos_id()``/``eos_id()``.

Added tokens (tiktoken, sentencepiece): a ``tokenizer_config.json`` beside the file whose ``added_tokens_decoder``
(transformers' form, ``{"id": {"content": ...}}``) names ids past the file's own (its ranks and Llama 3's 256, or its
pieces) adds them as special tokens, ids in order from there, as transformers' tokenizers add them; the file's
SHA-256 then covers that config too. ``meshtrain prepare --format chat`` writes such a pair for ChatML's tokens
(:mod:`meshtrain.data.chat`). Ids the file has already (a Llama 2 folder's ``<s>``) are left as the file defines them.

Every file kind also has ``token_to_id`` / ``id_to_token`` (a special token's text and id) and
``encode_with_special``, which encodes the text of each special token as that token, as transformers'
``apply_chat_template`` tokenizes its render.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Protocol

from meshtrain.config.checks import tokenizer_kind
from meshtrain.config.sections import HF_TOKENIZER_FILE
from meshtrain.errors import ConfigError

TOKENIZER_KIND = "char"
VOCAB_MULTIPLE = 128
"""Megatron-LM's ``--make-vocab-size-divisible-by`` default (``_vocab_size_with_padding`` in
``megatron/training/tokenizer/tokenizer.py``): the padded vocabulary is a multiple of this times tp."""
TIKTOKEN_PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""The pre-tokenizer regex of a ``*.tiktoken`` file: Llama 3's, the cl100k_base pattern (words with their
leading space, numbers in groups of up to 3 digits, punctuation runs, newlines, other whitespace)."""
TIKTOKEN_NUM_SPECIAL = 256
TIKTOKEN_SPECIAL = (["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
                    + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                    + [f"<|reserved_special_token_{i}|>" for i in range(5, TIKTOKEN_NUM_SPECIAL - 5)])
"""Llama 3's 256 special tokens, in id order after the BPE ranks."""
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
ADDED_TOKENS_FILE = "tokenizer_config.json"
"""Beside a tiktoken or sentencepiece file: its ``added_tokens_decoder`` adds special tokens past the file's ids."""
HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
HF_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    kind: str
    """"char", "hf", "tiktoken" or "sentencepiece"."""
    vocab_size: int
    """Number of ids, special tokens included."""
    bos_id: int | None
    eos_id: int | None
    """The document separator; None where the tokenizer has none (char)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def to_dict(self) -> dict[str, Any]: ...


class CharTokenizer:
    """Maps each distinct character of a text to an id: ids follow the sorted order of the characters."""

    kind = TOKENIZER_KIND
    bos_id = None
    eos_id = None

    def __init__(self, chars: list[str]) -> None:
        """``chars``: the vocabulary, one character per id (sorted and de-duplicated here)."""
        self.chars = sorted(set(chars))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(list(text))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """``text`` -> token ids, one per character.

        Raises:
            ValueError: a character outside the vocabulary (named, with its position).
        """
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as e:
            ch = e.args[0]
            raise ValueError(f"character {ch!r} (position {text.index(ch)}) is not in the vocabulary "
                             f"of {self.vocab_size} characters") from None

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text; an id with no character (a model whose vocabulary is larger than the text's,
        e.g. one imported from Hugging Face) becomes U+FFFD, as undecodable bytes do in ``errors="replace"``."""
        return "".join(self.chars[i] if 0 <= i < len(self.chars) else "\ufffd" for i in ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, stored in checkpoints."""
        return {"kind": TOKENIZER_KIND, "chars": "".join(self.chars)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        """Inverse of :meth:`to_dict`. Raises ValueError for another tokenizer kind."""
        if d.get("kind") != TOKENIZER_KIND:
            raise ValueError(f"tokenizer kind {d.get('kind')!r} is not supported: expected {TOKENIZER_KIND!r}")
        return cls(list(d["chars"]))


class FileTokenizer:
    """What the tokenizers read from files share: the path, the SHA-256 of the file(s) read, and a decode that
    turns ids outside the vocabulary into U+FFFD. Subclasses set ``vocab_size``, ``bos_id``, ``eos_id`` and
    implement ``_encode``/``_decode``."""

    kind = ""

    def __init__(self, path: Path, files: list[Path]) -> None:
        """``path``: what ``data.tokenizer`` named (a file or folder); ``files``: the files read, in order."""
        self.path = path
        self.data = [f.read_bytes() for f in files]  # read once: the hash and the tokenizer see the same bytes
        self.sha256 = _sha256(self.data)

    def encode(self, text: str) -> list[int]:
        """``text`` -> ids, no special tokens added. Raises ValueError: text the tokenizer cannot encode."""
        try:
            return self._encode(text)
        except Exception as e:  # the libraries raise their own exception types
            raise ValueError(f"the {self.kind} tokenizer '{self.path}' cannot encode it ({e})") from None

    def decode(self, ids: list[int]) -> str:
        """Ids -> text; each run of ids outside ``0 .. vocab_size - 1`` becomes one U+FFFD per id."""
        out, run = [], []
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            if run:
                out.append(self._decode(run))
                run = []
            out.append("\ufffd")
        if run:
            out.append(self._decode(run))
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "sha256": self.sha256, "vocab_size": self.vocab_size}

    def _read_added(self, file: Path, first: int) -> dict[str, int]:
        """{token: id} of the special tokens that :data:`ADDED_TOKENS_FILE` beside ``file`` adds past the file's
        ``first`` ids (module docstring); when it adds any, its bytes join the SHA-256.

        Raises:
            ValueError: a config that is not JSON, or added ids that do not run ``first, first + 1, ...``.
        """
        config_file = file.parent / ADDED_TOKENS_FILE
        if not config_file.is_file():
            return {}
        blob = config_file.read_bytes()
        try:
            decoder = json.loads(blob).get("added_tokens_decoder") or {}
            added = {int(i): (e["content"] if isinstance(e, dict) else e) for i, e in decoder.items()}
        except (ValueError, AttributeError, KeyError, TypeError) as e:
            raise ValueError(f"'{config_file}' is not a tokenizer config with an added_tokens_decoder of "
                             f"{{\"id\": {{\"content\": ...}}}} entries ({e})") from None
        past = sorted(i for i in added if i >= first)
        if past != list(range(first, first + len(past))) or not all(isinstance(added[i], str) for i in past):
            raise ValueError(f"'{config_file}' adds ids {past[:4]}... that do not follow the file's {first} ids in "
                             f"order ({first}, {first + 1}, ...)")
        if past:
            self.data.append(blob)
            self.sha256 = _sha256(self.data)
        return {added[i]: i for i in past}

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class HFTokenizer(FileTokenizer):
    """A ``tokenizer.json`` of the Hugging Face ``tokenizers`` library (``path``: the file or its folder)."""

    kind = "hf"

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFLib

        file = path / HF_TOKENIZER_FILE if path.is_dir() else path
        configs = [file.parent / name for name in HF_CONFIG_FILES if (file.parent / name).is_file()]
        super().__init__(path, [file, *configs])
        self.tokenizer = HFLib.from_str(self.data[0].decode("utf-8"))
        self.tokenizer.encode_special_tokens = True  # "<|endoftext|>" in the text is text, not the separator
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        named = _hf_special_names([json.loads(b) for b in self.data[1:]])
        self.bos_id = self._find(named.get("bos_token"), HF_BOS)
        self.eos_id = self._find(named.get("eos_token"), HF_EOS)

    def _find(self, name: str | None, known: tuple[str, ...]) -> int | None:
        """Id of ``name`` (from the config files), else of the first of ``known`` in the vocabulary."""
        for token in ([name] if name else list(known)):
            if (i := self.tokenizer.token_to_id(token)) is not None:
                return i
        return None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a special token's text), or None."""
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        return self.tokenizer.id_to_token(i)

    def encode_with_special(self, text: str) -> list[int]:
        """``text`` -> ids, no special tokens added, the text of each added token (``<|im_end|>``) encoded as that
        token: what transformers' ``apply_chat_template`` does with the chat it renders (``encode`` instead keeps
        such text plain). Raises ValueError: text the tokenizer cannot encode."""
        self.tokenizer.encode_special_tokens = False
        try:
            return self.encode(text)
        finally:
            self.tokenizer.encode_special_tokens = True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class TiktokenTokenizer(FileTokenizer):
    """A tiktoken BPE file (``<base64 token> <rank>`` lines) with Llama 3's special tokens after the ranks, then the
    tokens a ``tokenizer_config.json`` beside it adds."""

    kind = "tiktoken"

    def __init__(self, path: Path) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        super().__init__(path, [path])
        # expected_hash: tiktoken caches files by path in a temp folder; the hash makes it re-read a changed file
        ranks = load_tiktoken_bpe(str(path.absolute()), expected_hash=self.sha256)
        first = max(ranks.values(), default=-1) + 1
        special = {token: first + i for i, token in enumerate(TIKTOKEN_SPECIAL)}
        self.added = self._read_added(path, first + len(special))
        """{token: id} of the added tokens, ids from the ranks' and Llama 3's on."""
        special |= self.added
        self.encoding = tiktoken.Encoding(name=path.stem, pat_str=TIKTOKEN_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=special)
        self.vocab_size = self.encoding.n_vocab
        self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_with_special(self, text: str) -> list[int]:
        """``text`` -> ids, each special token's text encoded as that token (tiktoken's ``allowed_special="all"``).
        Raises ValueError: text the tokenizer cannot encode."""
        try:
            return self.encoding.encode(text, allowed_special="all")
        except Exception as e:
            raise ValueError(f"the tiktoken tokenizer '{self.path}' cannot encode it ({e})") from None

    def token_to_id(self, token: str) -> int | None:
        """The id of the special token ``token``, or None."""
        return self.encoding._special_tokens.get(token)

    def id_to_token(self, i: int) -> str:
        return self.encoding.decode_single_token_bytes(i).decode("utf-8", errors="replace")

    def _decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


class SentencePieceTokenizer(FileTokenizer):
    """A sentencepiece ``*.model`` (its BOS/EOS ids; -1, "none", becomes None), then the tokens a
    ``tokenizer_config.json`` beside it adds (the library has no added tokens: they are cut out of the text here)."""

    kind = "sentencepiece"

    def __init__(self, path: Path) -> None:
        import sentencepiece

        super().__init__(path, [path])
        self.processor = sentencepiece.SentencePieceProcessor(model_proto=self.data[0])
        pieces = self.processor.get_piece_size()
        self.added = self._read_added(path, pieces)
        """{token: id} of the added tokens, ids from the model's piece count on."""
        self.vocab_size = pieces + len(self.added)
        self.bos_id = self.processor.bos_id() if self.processor.bos_id() >= 0 else None
        self.eos_id = self.processor.eos_id() if self.processor.eos_id() >= 0 else None
        own = [i for i in (self.processor.unk_id(), self.bos_id, self.eos_id) if i is not None and i >= 0]
        self.special = {self.processor.id_to_piece(i): i for i in own} | self.added
        """The texts ``encode_with_special`` encodes as one token: <unk>, BOS, EOS and the added tokens, which
        transformers' sentencepiece tokenizers split out of a text."""
        names = sorted(self.special, key=len, reverse=True)  # the longest first where one starts another
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def _encode(self, text: str) -> list[int]:
        return self.processor.encode(text, out_type=int)

    def encode_with_special(self, text: str) -> list[int]:
        """``text`` -> ids, the text of each special token (:attr:`special`) encoded as that token and each piece
        between them by sentencepiece on its own, as transformers' ``SentencePieceBackend`` tokenizes. Raises
        ValueError: text the tokenizer cannot encode."""
        parts = self._split.split(text) if self._split else [text]  # odd indices: the special tokens' texts
        return [i for k, part in enumerate(parts) if part
                for i in ([self.special[part]] if k % 2 else self.encode(part))]

    def token_to_id(self, token: str) -> int | None:
        """The id of the special token ``token`` (:attr:`special`), or None."""
        return self.special.get(token)

    def id_to_token(self, i: int) -> str:
        added = {j: t for t, j in self.added.items()}
        return added[i] if i in added else self.processor.id_to_piece(i)

    def _decode(self, ids: list[int]) -> str:
        pieces = self.processor.get_piece_size()
        out, run = [], []
        for i in ids + [-1]:  # runs of the model's ids decoded together, an added token as its text
            if 0 <= i < pieces:
                run.append(i)
                continue
            out.append(self.processor.decode(run) if run else "")
            run = []
            if i >= pieces:
                out.append(self.id_to_token(i))
        return "".join(out)


FILE_KINDS: dict[str, Callable[[Path], FileTokenizer]] = {
    "hf": HFTokenizer, "tiktoken": TiktokenTokenizer, "sentencepiece": SentencePieceTokenizer}


def load_tokenizer(spec: str, text: str | None = None) -> Tokenizer:
    """The tokenizer ``data.tokenizer = spec`` names: "char" built from ``text``, else the file or folder.

    Raises:
        ConfigError: (naming ``data.tokenizer``) an unknown kind, a missing file, a file its library cannot read,
            or "char" without a text.
    """
    kind = tokenizer_kind(spec)
    if kind == TOKENIZER_KIND:
        if text is None:
            raise ConfigError("data.tokenizer = 'char' builds its vocabulary from the training text, and none was "
                              "given: pass the text, or use a tokenizer file")
        return CharTokenizer.from_text(text)
    return _load_file(kind, Path(spec).expanduser().absolute(), f"data.tokenizer = '{spec}'")


def _load_file(kind: str, path: Path, what: str) -> FileTokenizer:
    """The ``kind`` tokenizer at ``path``. Raises ConfigError naming ``what`` when its library cannot read it."""
    try:
        return FILE_KINDS[kind](path)
    except Exception as e:  # each library raises its own error types
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{what} cannot be read as a {kind} tokenizer: {reason}") from None


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Inverse of ``to_dict`` (checkpoints, exports): char from its characters; a file kind re-read from its
    path and checked against the recorded SHA-256.

    Raises:
        ConfigError: an unknown kind, or a tokenizer file that is gone or changed since it was recorded.
    """
    kind = d.get("kind")
    if kind == TOKENIZER_KIND:
        return CharTokenizer.from_dict(d)
    if kind not in FILE_KINDS:
        raise ConfigError(f"the recorded tokenizer kind {kind!r} is unknown: valid kinds are "
                          f"{', '.join([TOKENIZER_KIND, *FILE_KINDS])}")
    path = Path(d["path"])
    if not path.exists():
        raise ConfigError(f"the {kind} tokenizer '{path}' this model was trained with is gone: put it back "
                          f"(SHA-256 {d['sha256'][:12]}...)")
    tok = _load_file(kind, path, f"the recorded {kind} tokenizer '{path}'")
    if tok.sha256 != d["sha256"]:
        raise ConfigError(f"the {kind} tokenizer '{path}' changed since this model was trained with it (SHA-256 "
                          f"{tok.sha256[:12]}..., recorded {d['sha256'][:12]}...): restore the original file")
    return tok


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``to_dict`` forms are one tokenizer: the same characters, or the same kind and file contents
    (SHA-256) wherever the file now lies."""
    drop = ("path",)
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def padded_vocab_size(n_tokens: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n_tokens`` rounded up to a multiple of ``multiple * tp``: Megatron-LM's ``_vocab_size_with_padding``
    (``--make-vocab-size-divisible-by 128``), so each tp shard of the embedding holds a multiple of 128 rows,
    which keeps the head's GEMM on aligned tiles. E.g. GPT-2's 50257 -> 50304 (tp 1), 50688 (tp 4)."""
    step = multiple * tp
    return -(-n_tokens // step) * step


def model_vocab_size(kind: str, n_tokens: int, vocab_size: int, tp: int) -> int:
    """V the model is built with: ``model.vocab_size`` when set (non-zero); else the char tokenizer's size as it
    is (V = 65 on Tiny Shakespeare), any other kind's padded by :func:`padded_vocab_size`."""
    if vocab_size:
        return vocab_size
    return n_tokens if kind == TOKENIZER_KIND else padded_vocab_size(n_tokens, tp)


def _sha256(blobs: list[bytes]) -> str:
    """Hex SHA-256 of the concatenated ``blobs`` (one file: its ``sha256sum``)."""
    h = hashlib.sha256()
    for blob in blobs:
        h.update(blob)
    return h.hexdigest()


def _hf_special_names(configs: list[dict[str, Any]]) -> dict[str, str]:
    """``bos_token``/``eos_token`` of ``tokenizer_config.json`` then ``special_tokens_map.json`` (a string or an
    ``AddedToken`` dict with ``content``); the first file that names one wins."""
    names: dict[str, str] = {}
    for config in configs:
        for role in ("bos_token", "eos_token"):
            value = config.get(role) if isinstance(config, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and role not in names:
                names[role] = value
    return names
