"""``meshtrain prepare --tokenizer T --input PATHS_OR_GLOBS... --out DATA_DIR
[--format text|chat|prompt-completion|preference]``: token shards to train on (conversation and preference formats
add loss-mask shards; docs/posttraining.md).

The work is :func:`meshtrain.data.preprocess.prepare`; this module parses the options and shows a rich progress
bar on stderr (documents, tokens, input MB/s, ETA from the input bytes read). docs/data.md, "Preparing a
dataset", describes the output folder.
"""

from __future__ import annotations

import argparse
import time

from meshtrain.argtypes import int_in, positive_float, positive_int
from meshtrain.data.preprocess import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, FORMATS, default_workers, prepare
from meshtrain.data.sources import DOC_SPLITS

REFRESH_PER_S = 4
MAX_WORKERS = 1024
"""Most tokenizing processes ``--workers`` starts (2**63 overflowed the process pool)."""


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser("prepare", help=line,
                       description="Tokenize documents (text files, jsonl, parquet) in worker processes into "
                                   "fixed-size token shards (uint16/uint32 memmaps), a document index per split "
                                   "and meta.json, written into DATA_DIR.tmp and renamed to DATA_DIR at the end. "
                                   "--format chat|prompt-completion reads conversations (jsonl/parquet records), "
                                   "renders them with the tokenizer's chat template and adds loss-mask shards; "
                                   "--format preference writes each {prompt, chosen, rejected} pair as two "
                                   "documents, chosen then rejected (docs/posttraining.md).")
    p.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="a tokenizer.json, a *.tiktoken file, a sentencepiece *.model or a Hugging Face model folder")
    p.add_argument("--input", required=True, nargs="+", metavar="PATH",
                   help="files or globs (sorted): *.jsonl/*.ndjson, *.parquet, anything else is UTF-8 text")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="the folder to create; it must not exist")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="jsonl key / parquet column holding the text (default: text)")
    p.add_argument("--val-fraction", type=positive_float, default=DEFAULT_VAL_FRACTION, metavar="F",
                   help="one document (preference: one pair) in every 1/F goes to val, spread evenly "
                        "(default: %(default)s)")
    p.add_argument("--workers", type=int_in(1, MAX_WORKERS), default=default_workers(), metavar="N",
                   help="tokenizing processes (default: min(4, CPUs) = %(default)s)")
    p.add_argument("--doc-split", choices=DOC_SPLITS, default="file",
                   help="text files: one document per file, or per blank-line-separated block (default: file)")
    p.add_argument("--format", dest="data_format", choices=FORMATS, default="text",
                   help="text: documents; chat: {\"messages\": [...]} records; prompt-completion: {\"prompt\", "
                        "\"completion\"} records; preference: {\"prompt\", \"chosen\", \"rejected\"} records (two "
                        "documents each); all but text add a loss mask (default: text)")
    p.add_argument("--prompt-loss", action="store_true",
                   help="--format prompt-completion: supervise the prompt's tokens too (default: the completion only)")
    p.add_argument("--shard-tokens", type=positive_int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help="tokens per shard file (default: %(default)s)")
    p.set_defaults(func=run)


class _Bar:
    """The progress bar on a terminal (nothing when stderr is a file or a pipe): started on the first report
    (after the inputs are hashed), stopped by ``close``."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.progress = None

    def __call__(self, done_bytes: int, total_bytes: int, documents: int, tokens: int) -> None:
        if not self.console.is_terminal:
            return
        if self.progress is None:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.progress = Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                     TextColumn("{task.fields[counts]}"), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=self.console, refresh_per_second=REFRESH_PER_S,
                                     transient=True)  # gone when done: the result (or the error) is one line
            self.task = self.progress.add_task("prepare", total=total_bytes, counts="")
            self.progress.start()
        self.progress.update(self.task, completed=done_bytes, counts=f"{documents:,} docs  {tokens:,} tokens")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def run(args: argparse.Namespace) -> int:
    bar = _Bar()
    t0 = time.perf_counter()
    try:
        result = prepare(args.tokenizer, args.input, args.out, text_field=args.text_field,
                         val_fraction=args.val_fraction, workers=args.workers, doc_split=args.doc_split,
                         shard_tokens=args.shard_tokens, data_format=args.data_format,
                         prompt_loss=args.prompt_loss, progress=bar)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    splits = result.meta["splits"]
    counts = ", ".join(_split_counts(name, s) for name, s in splits.items())
    if result.already_done:
        print(f"{result.out} already holds these inputs prepared with this tokenizer ({counts}): nothing to do")
        return 0
    if result.removed_leftover:
        print(f"removed {result.out}.tmp, left by an interrupted prepare")
    total = sum(s["tokens"] for s in splits.values())
    print(f"wrote {result.out}: {counts}; {result.meta['dtype']}, vocab {result.meta['vocab_size']:,}; "
          f"{total / seconds:,.0f} tokens/s")
    return 0


def _split_counts(name: str, split: dict) -> str:
    """One split of the report: documents (or conversations or pairs, and supervised tokens), tokens, shards."""
    if "pairs" in split:
        return (f"{name} {split['pairs']:,} pairs ({split['documents']:,} documents) {split['tokens']:,} tokens "
                f"({split['supervised_tokens']:,} supervised) in {len(split['shards'])} shard(s)")
    if "supervised_tokens" in split:
        return (f"{name} {split['documents']:,} conversations {split['tokens']:,} tokens "
                f"({split['supervised_tokens']:,} supervised) in {len(split['shards'])} shard(s)")
    return f"{name} {split['documents']:,} documents {split['tokens']:,} tokens in {len(split['shards'])} shard(s)"
