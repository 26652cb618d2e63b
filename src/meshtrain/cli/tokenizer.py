"""``meshtrain tokenizer train --input FILE [FILE ...] --vocab-size N --out tokenizer.json``: train a tokenizer.

Trains a byte-level BPE (GPT-2's scheme: text as UTF-8 bytes, each byte one of 256 base symbols, so any text
encodes and decodes exactly; Radford et al. 2019, Sec. 2.2) with the Hugging Face ``tokenizers`` library:
``ByteLevel`` pre-tokenizer and decoder, the 256 byte symbols as the initial alphabet, and ``<|endoftext|>``
as its one special token (id 0, the EOS that separates documents). The result is a ``tokenizer.json`` that
``data.tokenizer`` reads (:mod:`meshtrain.data.tokenizers`). It is written under a temporary name and renamed
into place, and an existing ``--out`` is never overwritten.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshtrain.argtypes import int_in
from meshtrain.errors import ConfigError

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN,)
BYTE_ALPHABET = 256
"""Base symbols of a byte-level BPE: one per byte value."""
MAX_VOCAB = 2**24
"""Largest ``--vocab-size`` (16.8 M ids, past any tokenizer): the ``tokenizers`` trainer sizes its tables from it
(2**63 made it panic)."""


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser("tokenizer", help=line,
                       description="Tokenizer tools. 'train' fits a byte-level BPE on text files and writes a "
                                   "tokenizer.json for data.tokenizer.")
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="{train}")
    t = actions.add_parser("train", help="train a byte-level BPE on text files",
                           description="Train a byte-level BPE (tokenizers library, special token <|endoftext|> "
                                       "as EOS) on UTF-8 text files and write it as a tokenizer.json.")
    t.add_argument("--input", required=True, nargs="+", metavar="FILE", help="UTF-8 text files to learn merges from")
    t.add_argument("--vocab-size", required=True, type=int_in(1, MAX_VOCAB), metavar="N",
                   help=f"ids in the vocabulary, special tokens included (>= {BYTE_ALPHABET + len(SPECIAL_TOKENS)})")
    t.add_argument("--out", required=True, metavar="FILE", help="tokenizer.json to write; it must not exist")
    t.add_argument("--min-frequency", type=int_in(1, 2**32 - 1), default=2, metavar="K",
                   help="merge only pairs seen at least K times (default 2)")
    t.set_defaults(func=run)


def train_bpe(inputs: list[str | Path], vocab_size: int, out: str | Path, min_frequency: int = 2) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids on ``inputs`` and write it to ``out`` (a new file).

    Raises:
        ConfigError: a missing input, ``vocab_size`` below 256 bytes + the special tokens, ``out`` that exists
            or cannot be written, or input the trainer cannot read (not UTF-8).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from meshtrain.fileio import check_new_file

    for path in inputs:
        if not Path(path).expanduser().is_file():
            raise ConfigError(f"--input '{path}' is not a file: give UTF-8 text files to train on")
    least = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size < least:
        raise ConfigError(f"--vocab-size = {vocab_size} is below the {BYTE_ALPHABET} byte symbols + "
                          f"{len(SPECIAL_TOKENS)} special token(s): use >= {least}")
    target = Path(out).expanduser()
    if target.exists():
        raise ConfigError(f"--out '{out}' already exists: tokenizer train never overwrites a file; choose another --out")
    check_new_file(target, "--out")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train([str(Path(p).expanduser()) for p in inputs], trainer)
    except Exception as e:  # tokenizers raises its own exception type (e.g. invalid UTF-8)
        raise ConfigError(f"--input cannot be trained on: {str(e).splitlines()[0] if str(e) else e!r}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tok.save(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def run(args: argparse.Namespace) -> int:
    out = train_bpe(args.input, args.vocab_size, args.out, args.min_frequency)
    from meshtrain.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(out))
    print(f"wrote {out}: byte-level BPE, vocab_size {tok.vocab_size}, EOS {EOS_TOKEN} = id {tok.eos_id}; "
          f"train with --data.tokenizer {out}")
    return 0
