"""The ``meshtrain`` command: ``train | plan | batch | generate | export | tokenizer | prepare`` (benchmarks live in ``bench/``, run by ``make bench``).

Each subcommand lives next to what it drives and registers itself through ``add_parser(subparsers, line)``;
this module lists them with their one-line help, imports only the one a command line names, dispatches and turns
user errors (:class:`ConfigError`) into one line on stderr and exit code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys

from meshtrain.argtypes import OneLineParser
from meshtrain.errors import ConfigError

DESCRIPTION = ("Train PyTorch models on an N-dimensional device mesh (dp, tp, pp, sp; ep for experts) and plan what "
               "a layout costs before launch: memory per device, time per step, MFU, total training time.")


SUBCOMMANDS = {
    "train": "train a model on the device mesh (starts the ranks through torchrun)",
    "plan": "predict memory, step time, MFU and total time of layouts; pick the best",
    "batch": "batch arithmetic of a layout: global batch, tokens, steps, time",
    "generate": "sample text from a checkpoint",
    "export": "write a checkpoint as safetensors, a Hugging Face model folder or peft adapters",
    "tokenizer": "train a tokenizer (byte-level BPE) for data.tokenizer",
    "prepare": "tokenize text, jsonl or parquet files into token shards to train on (--format "
               "chat|prompt-completion|preference: conversations with a loss mask)",
}
"""The subcommands and their line in ``meshtrain --help``, each the module ``meshtrain.cli.<name>`` with an
``add_parser(subparsers, line)`` (:func:`add_subcommand`)."""


class WholeFlagsParser(OneLineParser):
    """:class:`OneLineParser` that takes whole option names only (``allow_abbrev=False``): argparse would otherwise
    take ``plan --ep 2`` as ``--epochs 2``. Every subcommand's parser, and a subcommand's own subparsers, are of
    this class (argparse makes subparsers of their parent's class)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**kwargs, "allow_abbrev": False})


def add_subcommand(sub: argparse._SubParsersAction, name: str) -> None:
    """Register subcommand ``name`` with all its options: its module, imported here and only here (a plain import
    each, so that readers and tools follow it; ``meshtrain plan`` imports nothing ``prepare`` needs)."""
    if name == "train":
        from meshtrain.cli import train as command
    elif name == "plan":
        from meshtrain.cli import plan as command
    elif name == "batch":
        from meshtrain.cli import batch as command
    elif name == "generate":
        from meshtrain.cli import generate as command
    elif name == "export":
        from meshtrain.cli import export as command
    elif name == "tokenizer":
        from meshtrain.cli import tokenizer as command
    elif name == "prepare":
        from meshtrain.cli import prepare as command
    else:
        raise ValueError(f"no subcommand {name!r}: one of {', '.join(SUBCOMMANDS)}")
    command.add_parser(sub, SUBCOMMANDS[name])


def build_parser(only: str | None = None, listing: bool = False) -> argparse.ArgumentParser:
    """The command line parser; ``only``: register that subcommand alone (its module is the only one imported, so
    ``meshtrain plan`` does not import what ``prepare`` needs: parsing its arguments is the same); ``listing``: each
    subcommand by its name and line only, no module imported (what ``meshtrain --help`` prints and what a command
    line naming no subcommand needs to be refused)."""
    parser = WholeFlagsParser(prog="meshtrain", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS if only is None else (only,):
        if listing:
            sub.add_parser(name, help=SUBCOMMANDS[name])
        else:
            add_subcommand(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = any(arg in SUBCOMMANDS for arg in argv)  # else argparse refuses the line or prints the listing
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None, listing=not named)
    args, extra = parser.parse_known_args(argv)
    try:
        if getattr(args, "accepts_overrides", False):
            return int(args.func(args, extra) or 0)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"meshtrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system refused (name too long, read-only, no space, permission): not a bug
        if e.errno is None:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"meshtrain {args.command}: error: {where}{e.strerror} (check the path, its permissions and the free "
              f"space)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before any rank started (checks, planning): nothing was written
        print(f"meshtrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
