"""Shared helpers: tiny model settings, the real CLI in a subprocess, and the trainer in this process."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import hermetic

ROOT = Path(__file__).resolve().parents[1]

# Before anything reads HOME: every test, and every process a test starts (they inherit os.environ), sees a
# fresh, empty home and XDG folders, so no test reads the machine's calibrated hardware profile
# (~/.cache/meshtrain) or writes into the user's real cache. The real folders are remembered for the check
# below. (tests/hermetic.py)
REAL_FOLDERS = hermetic.watched_folders(os.environ)
FAKE_HOME = Path(tempfile.mkdtemp(prefix="meshtrain-test-home-"))
os.environ.update(hermetic.isolated_environment(FAKE_HOME))
atexit.register(shutil.rmtree, FAKE_HOME, True)  # every pytest process (an xdist worker, its controller) has one


@pytest.fixture(scope="session", autouse=True)
def nothing_written_outside_the_test_folders():
    """Fails the session (an error at the last test's teardown) when any test wrote into the real home's
    meshtrain cache or config folders, or left a new file in the checkout."""
    before = hermetic.snapshot(REAL_FOLDERS, ROOT)
    yield
    changed = hermetic.changes(before, hermetic.snapshot(REAL_FOLDERS, ROOT))
    assert not changed, f"tests wrote outside their temporary folders: {changed[:10]}"
CONFIG = ROOT / "configs" / "shakespeare_char.toml"

# A model small enough that a 2-rank, 10-step run costs ~1 s of compute on 2 cores.
TINY = {
    "model.n_layer": "2", "model.n_head": "2", "model.n_embd": "32", "model.block_size": "32",
    "optim.warmup_steps": "2", "optim.lr": "3e-3", "train.steps": "10", "train.log_interval": "1",
    "train.eval_interval": "0", "train.eval_steps": "2", "checkpoint.interval": "0",
    "train.dtype": "float32",  # the equality tests compare fp32 arithmetic ("auto" is bf16 on a bf16 CPU)
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a test's own gloo rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def override_args(overrides: dict[str, str]) -> list[str]:
    return [tok for key, value in overrides.items() for tok in (f"--{key}", str(value))]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``meshtrain ARGS`` in a fresh interpreter (the installed console script's entry point)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "meshtrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def cli_here(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``meshtrain ARGS`` in this process (``meshtrain.cli.main.main``), answered as :func:`run_cli` answers: exit code,
    stdout, stderr. For commands that start no rank (``generate``, ``export``, ``prepare``, ``plan``, ``batch``, and
    ``train`` refused before launch): a fresh interpreter costs ~2 s of torch's import each, more than most such
    commands. torchrun's engine is a trap here (:func:`artefacts.run_cli_here`): a command that launches, hangs past
    ``timeout`` or raises is exit code 1 with ``Traceback`` and the reason on stderr, as a fresh process would fail."""
    from artefacts import run_cli_here

    code, stderr, stdout = run_cli_here(list(args), limit=timeout)
    if not isinstance(code, int):
        code, stderr = 1, f"{stderr}\nTraceback (in this process): {code}\n"
    return subprocess.CompletedProcess(["meshtrain", *args], code, stdout, stderr)


def launch_here(*args: str) -> int:
    """``meshtrain ARGS`` in this process with torchrun's engine for real: the ranks are this process's children (their
    output goes to its file descriptors, not to the value returned); returns the exit code. Saves the launcher's
    process (~2 s of torch's import) of a run whose exit code and files are what a test reads. The signal handlers
    torchrun's engine installs and the environment the launcher sets for its ranks are put back afterwards."""
    import signal

    from meshtrain.cli.main import main

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    handlers, environ = {s: signal.getsignal(s) for s in signals}, dict(os.environ)
    try:
        return main(list(args))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        os.environ.clear()
        os.environ.update(environ)


def train_cli(out: Path, nproc: int, **overrides: str) -> list[dict]:
    """Train through ``meshtrain train`` on ``nproc`` gloo ranks; return the metrics records."""
    args = {**TINY, **overrides, "train.out_dir": str(out)}
    proc = run_cli("train", str(CONFIG), "--nproc", str(nproc), *override_args(args))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_records(out)


def train_here(out: Path, **overrides: str) -> list[dict]:
    """Train in this process (a 1-rank group, no launcher); return the metrics records."""
    from meshtrain.config.load import load_config
    from meshtrain.train.entry import train

    train(load_config(CONFIG, {**TINY, **overrides, "train.out_dir": str(out)}))
    return read_records(out)


def train_config_here(config: Path, **overrides: str) -> list[dict]:
    """Train ``config`` with ``overrides`` (``train.out_dir`` among them; nothing of :data:`TINY` added) in this process
    (a 1-rank group, no launcher), as :func:`train_here` does; return the metrics records. For a run that is a test's
    starting point, not its subject: a ``meshtrain train --nproc 1`` costs a launcher and a rank seconds of imports."""
    from meshtrain.config.load import load_config
    from meshtrain.train.entry import train

    train(load_config(config, overrides))
    return read_records(Path(overrides["train.out_dir"]))


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_close_losses(got: dict[int, float], want: dict[int, float], rel: float = 1e-5) -> None:
    """Every step's loss within ``rel`` (docs/architecture.md's contract: 1e-5). A loss is a mean of B*T fp32
    log-softmax terms: summed in another order its rounding error is ~log2(B*T) * 2**-24 ~ 1e-6, and
    the parameters it is computed from differ by AdamW's rounding amplification (see
    :func:`assert_close_params`), which a loss averages out; 1e-5 leaves room for both, while a
    dropped or doubled micro-batch or a wrongly averaged gradient moves losses by >= 1e-4 here."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=rel), f"step {step}: {got[step]} vs {want[step]}"


def assert_resumed_losses(got: dict[int, float], want: dict[int, float]) -> None:
    """A run resumed from step k, perhaps at another layout, against the uninterrupted run's steps k+1...

    Step k+1 within 1e-6 relative: resharding moves bytes, so it starts from bit-identical parameters and
    optimizer state, and its loss differs only by the forward's summation order under the new layout
    (each logit a dot product over n_embd = 32 terms in 2 layers, each sum's rounding ~log2(32) * 2**-24
    ~ 3e-7 relative, averaged over the B*T terms of the mean): 1e-6 leaves 3x for that, while a value
    read from the wrong shard or a lost optimizer state moves it by >= 1e-4. Later steps as
    :func:`assert_close_losses` (1e-5: AdamW amplifies the rounding over steps)."""
    first = min(want)
    assert got.get(first) == pytest.approx(want[first], rel=1e-6), f"step {first}: {got.get(first)} vs {want[first]}"
    assert_close_losses(got, want)


def assert_close_grads(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Gradients after step 1, element by element, within ``rel`` of the global gradient norm.

    Each element is a sum over the batch's tokens (and, under tp/sp/dp, over ranks, in another
    order). fp32 summation of n terms errs by at most ~n * 2**-24 of the sum of their magnitudes
    (Higham 2002, Sec. 4.2), ~sqrt(n) * 2**-24 in practice; with n <= 256 * 32 terms here that is
    <= ~5e-6 of the norm, so 1e-5 of the norm holds on any CPU. A gradient averaged over the wrong
    group is off by a factor (1/2 at dp=2), far outside it.
    """
    import torch

    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in want.values())))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=rel * norm,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")


def adamw_drift_bound(cfg_overrides: dict[str, str]) -> float:
    """Largest parameter difference two runs that agree up to rounding can reach: 2 * sum_t lr_t.

    AdamW's step is ``lr * m_hat / (sqrt(v_hat) + eps)``, whose magnitude is at most ``lr`` when
    ``1 - beta1 <= sqrt(1 - beta2)`` (Kingma & Ba 2015, Sec. 2.1; 0.1 <= 0.1 here). A gradient that
    is ~0 and rounds to +tiny in one run and -tiny in the other turns into steps of +lr and -lr, so
    per step two such runs can drift apart by 2 * lr_t, and no less can be promised. (Decoupled weight
    decay multiplies both by the same factor < 1, which only shrinks the gap.) This bound is loose by
    design: the losses of every step and the step-1 gradients carry the tight checks.
    """
    from meshtrain.config.load import load_config
    from meshtrain.optim.schedule import lr_at

    cfg = load_config(CONFIG, {**TINY, **cfg_overrides})
    return 2 * sum(lr_at(step, cfg.optim, cfg.train.steps) for step in range(cfg.train.steps))


def assert_close_params(got: dict, want: dict, atol: float) -> None:
    import torch

    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def final_params(out: Path) -> dict:
    """Parameters of the run's latest checkpoint, loaded into a plain single-process model."""
    from meshtrain.checkpoint import store as ckpt

    path = ckpt.resolve_checkpoint(out)
    model = ckpt.described_model(ckpt.read_meta(path))
    ckpt.load(path, model, None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_layout(got: tuple, want: tuple, overrides: dict[str, str]) -> None:
    """The contract for one layout against the one-process reference, both ``(losses, grads, params)``
    (:func:`layout_worker.load_result`): every step's loss, step-1 gradients, final parameters."""
    assert len(got[0]) == int(overrides["train.steps"])
    assert_close_losses(got[0], want[0])
    assert_close_grads(got[1], want[1])
    assert_close_params(got[2], want[2], atol=adamw_drift_bound(overrides))


def _json_values():
    from hypothesis import strategies as st

    return st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=5)


JSON_VALUES = _json_values()
"""Any JSON value (NaN and infinities too: Python's json writes and reads them), for property tests of readers."""


def json_paths(value, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON object (list items by index)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    return [p for key, item in items for p in [(*prefix, key), *json_paths(item, (*prefix, key))]]


def damaged_json_copy(data, source: Path, name: str, tmp_path: Path) -> Path:
    """A fresh copy of the folder ``source`` whose JSON file ``name`` has, at a key path ``data`` (hypothesis's
    ``st.data()``) draws, any JSON value it draws, or (in an object) that key removed; returns the copy."""
    import shutil
    import tempfile

    from hypothesis import strategies as st

    content = json.loads((source / name).read_text())
    path = data.draw(st.sampled_from(json_paths(content)))
    folder = Path(tempfile.mkdtemp(dir=tmp_path)) / source.name
    shutil.copytree(source, folder)
    target = content
    for key in path[:-1]:
        target = target[key]
    if data.draw(st.booleans()) and isinstance(target, dict):
        del target[path[-1]]
    else:
        target[path[-1]] = data.draw(JSON_VALUES)
    (folder / name).write_text(json.dumps(content))
    return folder


from artefacts import artefacts  # noqa: E402,F401 (a session fixture: one of each artefact, built once)
