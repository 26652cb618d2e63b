"""A text corpus: its token ids (``data.tokenizer``, :mod:`meshtrain.data.tokenizers`; by default one id per
character) and their train/val split.

The split follows nanoGPT's ``shakespeare_char`` preparation: the first ``1 - val_fraction`` of the
token ids (characters, with the char tokenizer) are train, the rest val. The bundled Tiny Shakespeare corpus
(``meshtrain.config.sections.BUNDLED_CORPUS``, ~1.1 MB) has a vocabulary of 65 characters.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshtrain.config.sections import Config
from meshtrain.data.conversations import PACKINGS as CONVERSATION_PACKINGS
from meshtrain.data.conversations import Conversations, Pairs
from meshtrain.errors import ConfigError, DataError
from meshtrain.data.shards import TokenView
from meshtrain.data.sampler import Tokens
from meshtrain.data.tokenizers import TOKENIZER_KIND, CharTokenizer, Tokenizer, load_tokenizer

TEXT_PACKINGS = ("concat", "document")
"""``data.packing`` values that text takes (:mod:`meshtrain.data.packing`)."""

__all__ = ["TOKENIZER_KIND", "CharTokenizer", "Corpus", "PreparedTokens", "load_corpus", "load_prepared"]  # CharTokenizer: kept importable from here


@dataclass
class Corpus:
    """Token ids of the two splits (int64, 1-D: ids of large vocabularies, >= 65536, fit) and the tokenizer
    that made them."""

    train: Tokens
    """(N_train,) int64 token ids: in memory (a text file), or read a window at a time (prepared data)."""
    val: Tokens
    """(N_val,) int64 token ids."""
    tokenizer: Tokenizer
    sha256: str = ""
    """Hex SHA-256 of the text's UTF-8 bytes (of a prepared folder's ``meta.json``): a checkpoint records it, so
    a resume on other data is refused."""
    added_tokens: dict[int, str] = field(default_factory=dict)
    """The ids ``meshtrain prepare`` added to the tokenizer it was given (a prepared folder's ``added_tokens``: ChatML's
    tokens) -> their tokens; a starting model may grow its vocabulary by these (:mod:`meshtrain.data.growth`)."""


class PreparedTokens:
    """One split of a prepared dataset as a :class:`meshtrain.data.sampler.TokenSource`: ``gather`` reads the
    ``n * length`` tokens it returns (:meth:`meshtrain.data.shards.TokenView.windows`, ``os.pread``), never
    the whole split, and checks them against the vocabulary (a shard of garbage bytes of the right size passes
    every check before launch)."""

    def __init__(self, view: TokenView, vocab_size: int, where: str = "prepared data") -> None:
        self.view, self.vocab_size, self.where = view, vocab_size, where

    def __len__(self) -> int:
        return len(self.view)

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """(n, length) int64 windows at ``starts`` (n,) int64, each inside ``[0, len(self))``.

        Raises:
            DataError: a token id outside ``[0, vocab_size)`` (a damaged shard), naming its position.
        """
        windows = self.view.windows(starts.numpy(), length)
        if windows.size and (windows.min() < 0 or windows.max() >= self.vocab_size):
            row, col = divmod(int(((windows < 0) | (windows >= self.vocab_size)).argmax()), length)
            position = int(starts[row]) + col
            raise DataError(f"{self.where} holds token id {int(windows[row, col])} at token {position}, outside its "
                            f"vocabulary of {self.vocab_size} (meta.json): a shard is damaged; run meshtrain prepare "
                            f"again")
        return torch.from_numpy(windows)


def load_prepared(folder: Path, block_size: int, tokenizer: str = TOKENIZER_KIND, packing: str = "concat",
                  objective: str = "lm") -> Corpus:
    """The corpus of a ``meshtrain prepare`` folder: its splits read through memory maps, its tokenizer
    rebuilt from ``meta.json`` (checked against the file it was made with).

    Raises:
        ConfigError: a folder that is not a complete prepared dataset (:meth:`PreparedData.open`), a tokenizer
            that changed since, ``data.tokenizer`` naming another tokenizer than the one it was prepared
            with, or a split shorter than one window.
    """
    from meshtrain.data.shards import META_FILE, PreparedData
    from meshtrain.data.tokenizers import same_tokenizer, tokenizer_from_dict

    data = PreparedData.open(folder)
    tok = tokenizer_from_dict(data.meta["tokenizer"])
    if tok.vocab_size != data.vocab_size:  # prepare writes the tokenizer's own
        raise ConfigError(f"'{Path(folder) / META_FILE}': 'vocab_size' = {data.vocab_size} is not the "
                          f"{tok.vocab_size} tokens of its tokenizer '{data.meta['tokenizer'].get('path')}': the "
                          f"prepared data is damaged or was edited; run meshtrain prepare again")
    if tokenizer != TOKENIZER_KIND and not same_tokenizer(load_tokenizer(tokenizer).to_dict(), tok.to_dict()):
        raise ConfigError(f"data.tokenizer = '{tokenizer}' is not the tokenizer data.path = '{folder}' was prepared "
                          f"with ({data.meta['tokenizer'].get('path')}): leave data.tokenizer as \"char\" (the "
                          f"folder names its own) or prepare the data again")
    train, val = (PreparedTokens(data.tokens(split), data.vocab_size, f"prepared data '{folder}' ({split} split)")
                  for split in ("train", "val"))
    digest = hashlib.sha256((Path(folder) / META_FILE).read_bytes()).hexdigest()
    added = added_tokens(data.meta, tok, Path(folder) / META_FILE)
    pairs = data.meta.get("content") == "preference"
    if pairs != (objective == "dpo"):
        raise ConfigError(f"data.path = '{folder}' holds preference pairs: set train.objective = 'dpo'" if pairs else
                          f"train.objective = 'dpo' trains on preference pairs and data.path = '{folder}' holds "
                          f"{data.meta.get('content', 'text')}: prepare pairs with meshtrain prepare --format "
                          f"preference")
    if data.has_masks:
        train, val = (_conversations(data, split, tokens, block_size, packing, tok, folder, pairs)
                      for split, tokens in (("train", train), ("val", val)))
        return Corpus(train=train, val=val, tokenizer=tok, sha256=digest, added_tokens=added)
    if packing not in TEXT_PACKINGS:
        raise ConfigError(f"data.packing = '{packing}' is for prepared conversations, and data.path = '{folder}' holds "
                          f"text: use 'concat' or 'document'")
    for name, split in (("train", train), ("val", val)):
        if len(split) < block_size + 1:
            raise ConfigError(f"data.path = '{folder}' has a {name} split of {len(split)} tokens; model.block_size = "
                              f"{block_size} needs >= {block_size + 1}: use a smaller block_size or more data")
    return Corpus(train=train, val=val, tokenizer=tok, sha256=digest, added_tokens=added)


def added_tokens(meta: dict, tok: Tokenizer, where: Path) -> dict[int, str]:
    """{id: token} of a prepared folder's ``added_tokens`` (:mod:`meshtrain.data.preprocess`: the ids prepare added to
    the tokenizer it was given, the last ones of its tokenizer); {} where it added none.

    Raises:
        ConfigError: an entry that is not such an id of the folder's tokenizer (the meta.json was edited).
    """
    entries = meta.get("added_tokens", [])
    ok = isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("id"), int)
                                           and isinstance(e.get("content"), str) for e in entries)
    added = {e["id"]: e["content"] for e in entries} if ok else {}
    lookup = getattr(tok, "token_to_id", None)  # file kinds' special tokens (char has none)
    if not ok or (added and (lookup is None or any(lookup(t) != i for i, t in added.items())
                             or sorted(added) != list(range(tok.vocab_size - len(added), tok.vocab_size)))):
        raise ConfigError(f"'{where}': 'added_tokens' = {str(entries)[:60]} are not the last ids of its tokenizer: the "
                          f"prepared data is damaged or was edited; run meshtrain prepare again")
    return added


def _conversations(data, split: str, tokens: PreparedTokens, block_size: int, packing: str, tok: Tokenizer,
                   folder: Path, pairs: bool = False) -> Conversations:
    """One split of prepared conversations (:class:`meshtrain.data.conversations.Conversations`), or of preference
    pairs (:class:`~meshtrain.data.conversations.Pairs`).

    Raises:
        ConfigError: ``packing`` is not one conversations take.
    """
    if packing not in CONVERSATION_PACKINGS:
        raise ConfigError(f"data.path = '{folder}' holds conversations (meshtrain prepare --format "
                          f"{data.meta.get('content')}), which data.packing = '{packing}' would cut anywhere: use "
                          f"'document' (whole conversations packed into windows, attention kept inside each) or 'pad' "
                          f"(one conversation per sample)")
    masks = PreparedTokens(data.masks(split), 2, f"prepared data '{folder}' ({split} split's loss masks)")
    if pairs:
        return Pairs(tokens, masks, np.asarray(data.documents(split)), block_size, pad_id=tok.eos_id or 0)
    return Conversations(tokens, masks, np.asarray(data.documents(split)), block_size, packing,
                         pad_id=tok.eos_id or 0)


def read_text_corpus(path: Path) -> str:
    """The text of the corpus file ``data.path``.

    Raises:
        ConfigError: (naming ``data.path``) unreadable, not UTF-8 or empty.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.path = '{path}' is not UTF-8 text (byte {e.start}): give a UTF-8 file") from None
    except OSError as e:
        raise ConfigError(f"data.path = '{path}' cannot be read: {e.strerror}") from None
    if not text:
        raise ConfigError(f"data.path = '{path}' is empty: give a non-empty UTF-8 text file")
    return text


def load_corpus(path: Path, val_fraction: float, block_size: int, tokenizer: str = TOKENIZER_KIND,
                packing: str = "concat", objective: str = "lm") -> Corpus:
    """Read the UTF-8 text at ``path``, tokenize it with ``tokenizer`` (``data.tokenizer``: "char", or a file
    :func:`meshtrain.data.tokenizers.load_tokenizer` reads) and split it train | val; or, when ``path`` is a
    folder, open the dataset ``meshtrain prepare`` wrote there (:func:`load_prepared`; ``val_fraction`` is the
    one it was prepared with).

    The first ``round(n_tokens * (1 - val_fraction))`` token ids are train, the rest val. Each split
    must hold at least ``block_size + 1`` tokens (one sample window).

    Raises:
        ConfigError: (naming ``data.path``) unreadable, not UTF-8, empty, or a split too short; (naming
            ``data.tokenizer``) a tokenizer that cannot be read or cannot encode the text.
    """
    path = Path(path)
    if path.is_dir():
        return load_prepared(path, block_size, tokenizer, packing, objective)
    if objective == "dpo":
        raise ConfigError(f"train.objective = 'dpo' trains on preference pairs and data.path = '{path}' is a text "
                          f"file: prepare pairs with meshtrain prepare --format preference")
    if packing not in TEXT_PACKINGS:
        raise ConfigError(f"data.packing = '{packing}' is for prepared conversations (meshtrain prepare --format chat), "
                          f"and data.path = '{path}' is a text file: use 'concat' or 'document'")
    text = read_text_corpus(path)
    tok = load_tokenizer(tokenizer, text)
    try:
        ids = torch.tensor(tok.encode(text), dtype=torch.long)  # (N,) int64: holds ids >= 65536
    except ValueError as e:
        raise ConfigError(f"data.tokenizer = '{tokenizer}' cannot tokenize data.path = '{path}': {e}") from None
    n_train = round(len(ids) * (1.0 - val_fraction))
    train, val = ids[:n_train], ids[n_train:]
    need = block_size + 1
    for name, split in (("train", train), ("val", val)):
        if len(split) < need:
            raise ConfigError(f"data.path = '{path}' gives a {name} split of {len(split)} tokens "
                              f"(data.val_fraction = {val_fraction}); model.block_size = {block_size} needs "
                              f">= {need}: use a longer text or a smaller block_size")
    return Corpus(train=train, val=val, tokenizer=tok, sha256=hashlib.sha256(text.encode()).hexdigest())


def corpus_of(cfg: Config) -> Corpus:
    """The corpus of a run's config (:class:`meshtrain.config.sections.Config`): :func:`load_corpus` of its
    ``[data]``, block size and objective. Raises what :func:`load_corpus` raises."""
    d = cfg.data
    return load_corpus(d.resolved_path(), d.val_fraction, cfg.model.block_size, d.tokenizer, d.packing,
                       cfg.train.objective)
