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


def build_parser() -> argparse.ArgumentParser:
    from meshtrain.cli import batch, export, generate, plan, prepare, tokenizer, train

    parser = OneLineParser(prog="meshtrain", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,plan,batch,generate,export,tokenizer,prepare}")
    train.add_parser(sub)
    plan.add_parser(sub)
    batch.add_parser(sub)
    generate.add_parser(sub)
    export.add_parser(sub)
    tokenizer.add_parser(sub)
    prepare.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
