"""The ``meshtrain`` command: ``train | plan | batch | generate | export | tokenizer | prepare`` (benchmarks live in ``bench/``, run by ``make bench``).

Each subcommand lives next to what it drives and registers itself through ``add_parser(subparsers)``;
this module only dispatches and turns user errors (:class:`ConfigError`) into one line on stderr
and exit code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys

from meshtrain.argtypes import OneLineParser
from meshtrain.config import ConfigError

DESCRIPTION = ("Train PyTorch models on an N-dimensional device mesh (dp, tp, pp, sp) and plan what a layout "
               "costs before launch: memory per device, time per step, MFU, total training time.")


SUBCOMMANDS = ("train", "plan", "batch", "generate", "export", "tokenizer", "prepare")
"""The subcommands, each the module ``meshtrain.cli.<name>`` with an ``add_parser(subparsers)``."""


class WholeFlagsParser(OneLineParser):
    """:class:`OneLineParser` that takes whole option names only (``allow_abbrev=False``): argparse would otherwise
    take ``plan --ep 2`` as ``--epochs 2``. Every subcommand's parser, and a subcommand's own subparsers, are of
    this class (argparse makes subparsers of their parent's class)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**{**kwargs, "allow_abbrev": False})


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line parser; ``only``: register that subcommand alone (its module is the only one imported, so
    ``meshtrain plan`` does not import what ``prepare`` needs: parsing its arguments is the same)."""
    import importlib

    parser = WholeFlagsParser(prog="meshtrain", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS if only is None else (only,):
        importlib.import_module(f"meshtrain.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
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
