"""One of each artefact meshtrain reads, built once per session (the :func:`artefacts` fixture, which conftest.py
makes every test module's), and :func:`run_cli_here`, the CLI in this process with a time limit and a trap
instead of torchrun's engine: the bad-input matrix (tests/test_input_matrix.py) damages copies of the
artefacts, and the numeric extremes (tests/test_numeric_extremes.py) run the commands that read them."""

from __future__ import annotations

import contextlib
import io
import json
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

LIMIT_S = 30
"""Seconds a command may take in :func:`run_cli_here`: past them it hangs (a FIFO read blocks forever)."""


def _quiet_main(argv: list[str]) -> None:
    from meshtrain.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    return "".join(f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
                   for name, table in sections.items())


@pytest.fixture(scope="session")
def artefacts(tmp_path_factory) -> Path:
    """A folder holding corpus.txt (20 kB of Tiny Shakespeare), config.toml (the tests' tiny model on it),
    run/ (2 steps, one process, a checkpoint), its exports export/model.safetensors and hf/ (sharded, with an
    index and a tokenizer.json), bpe/tokenizer.json (a BPE with an EOS) and prepared/ (the corpus prepared
    with it). About 15 s."""
    from conftest import ROOT, TINY, train_here

    root = tmp_path_factory.mktemp("artefacts")
    corpus = root / "corpus.txt"
    corpus.write_text((ROOT / "src/meshtrain/assets/tinyshakespeare.txt").read_text()[:20000])
    overrides = {**TINY, "data.path": str(corpus)}
    sections: dict[str, dict[str, Any]] = {}
    for dotted, text in overrides.items():
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = text if key in ("dtype", "path") else json.loads(text)
    (root / "config.toml").write_text(_toml(sections))
    train_here(root / "run", **{**overrides, "train.steps": "2"})
    (root / "export").mkdir()
    _quiet_main(["export", "--checkpoint", str(root / "run"), "--out", str(root / "export/model.safetensors")])
    _quiet_main(["export", "--checkpoint", str(root / "run"), "--format", "hf", "--out", str(root / "hf"),
                 "--max-shard-mb", "0.05"])
    _quiet_main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out",
                 str(root / "bpe/tokenizer.json")])
    _quiet_main(["prepare", "--tokenizer", str(root / "bpe/tokenizer.json"), "--input", str(corpus), "--out",
                 str(root / "prepared"), "--workers", "1", "--doc-split", "blank-line", "--shard-tokens", "3000",
                 "--val-fraction", "0.1"])
    return root


class _Launched(Exception):
    """torchrun's engine was called: the bad input passed every check."""


class _TimeUp(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    def up(signum, frame):
        raise _TimeUp

    old = signal.signal(signal.SIGALRM, up)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli_here(argv: list[str], limit: float = LIMIT_S) -> tuple[int | str, str, str]:
    """(exit code, or "launched", "hang" or "traceback: ERROR"; stderr; stdout) of ``meshtrain ARGV`` in this
    process, with torchrun's engine replaced by a trap."""
    import torch.distributed.run  # noqa: F401 (patched below)

    from meshtrain.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    code: int | str
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
            mock.patch("torch.distributed.run.run", side_effect=_Launched):
        try:
            with _time_limit(limit):
                code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except _Launched:
            code = "launched"
        except _TimeUp:
            code = "hang"
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # what a user would see as a traceback (DCP's CheckpointException is a BaseException)
            code = f"traceback: {type(e).__name__}: {str(e)[:300]}"
    return code, err.getvalue(), out.getvalue()
