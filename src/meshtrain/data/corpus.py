"""Character-level corpus: a tokenizer over the text's characters and a train/val split of token ids.

The split follows nanoGPT's ``shakespeare_char`` preparation: the first ``1 - val_fraction`` of the
text (in characters) is train, the rest val. The bundled Tiny Shakespeare corpus
(``meshtrain.config.BUNDLED_CORPUS``, ~1.1 MB) has a vocabulary of 65 characters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.config import ConfigError

TOKENIZER_KIND = "char"


class CharTokenizer:
    """Maps each distinct character of a text to an id: ids follow the sorted order of the characters."""

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


@dataclass
class Corpus:
    """Token ids of the two splits (int64, 1-D) and the tokenizer that made them."""

    train: torch.Tensor
    """(N_train,) int64 token ids."""
    val: torch.Tensor
    """(N_val,) int64 token ids."""
    tokenizer: CharTokenizer
    sha256: str = ""
    """Hex SHA-256 of the text's UTF-8 bytes: a checkpoint records it, so a resume on another text is refused."""


def load_corpus(path: Path, val_fraction: float, block_size: int) -> Corpus:
    """Read the UTF-8 text at ``path``, tokenize it by character and split it train | val.

    The first ``round(len(text) * (1 - val_fraction))`` characters are train, the rest val. Each split
    must hold at least ``block_size + 1`` tokens (one sample window).

    Raises:
        ConfigError: (naming ``data.path``) unreadable, not UTF-8, empty, or a split too short.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.path = '{path}' is not UTF-8 text (byte {e.start}): give a UTF-8 file") from None
    except OSError as e:
        raise ConfigError(f"data.path = '{path}' cannot be read: {e.strerror}") from None
    if not text:
        raise ConfigError(f"data.path = '{path}' is empty: give a non-empty UTF-8 text file")
    tokenizer = CharTokenizer.from_text(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)  # (N,)
    n_train = round(len(ids) * (1.0 - val_fraction))
    train, val = ids[:n_train], ids[n_train:]
    need = block_size + 1
    for name, split in (("train", train), ("val", val)):
        if len(split) < need:
            raise ConfigError(f"data.path = '{path}' gives a {name} split of {len(split)} tokens "
                              f"(data.val_fraction = {val_fraction}); model.block_size = {block_size} needs "
                              f">= {need}: use a longer text or a smaller block_size")
    return Corpus(train=train, val=val, tokenizer=tokenizer, sha256=hashlib.sha256(text.encode()).hexdigest())
