"""Synchronous vs asynchronous data parallelism: local SGD and the parameter server.

- local SGD during its synchronous warm-up is plain DDP: equal to one process (the contract of
  docs/architecture.md); after it, replicas hold identical parameters right after each average and different
  ones between (a probe records each rank's parameter digest after every step).
- local SGD and async (drop and wait) converge: the val loss ends below the unigram entropy of the
  training text (3.31 nats/char, what a model that learned only character frequencies reaches; a run
  whose updates are lost stays near ln 65 = 4.17).
- The staleness bound holds with a slow worker: "drop" drops its stale gradients and applies none
  staler than s; "wait" applies every gradient, none staler than s.
- Bad combinations are refused before launch with one line.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIG, ROOT, TINY, check_layout, cli_here, override_args, read_records, run_cli
from layout_worker import launch_layouts, load_result, reference_run

MODEL = {**TINY, "model.n_head": "4", "train.steps": "6", "batch.micro_batch_size": "8"}
CONVERGE = {**TINY, "train.steps": "150", "optim.warmup_steps": "10", "train.log_interval": "10",
            "batch.micro_batch_size": "8", "train.eval_steps": "8"}
"""8 val micro-batches (2,048 tokens), not 2: the val estimate's noise is a fraction of the margin."""


def unigram_entropy() -> float:
    """Entropy (nats) of the character frequencies of the training split (the first 90% of the text)."""
    text = (ROOT / "src/meshtrain/assets/tinyshakespeare.txt").read_text()
    counts = collections.Counter(text[:int(len(text) * 0.9)])
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def torchrun(nproc: int, probe: str, out, overrides: dict[str, str]) -> subprocess.CompletedProcess:
    """``tests/sync_worker.py PROBE`` on ``nproc`` gloo ranks (what ``meshtrain train`` starts, plus the probe)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    args = override_args({**overrides, "train.out_dir": str(out)})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(ROOT / "tests/sync_worker.py"), probe, str(CONFIG), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


LOCAL_SGD = {
    "warmup": {**MODEL, "parallel.sync_mode": "local-sgd", "local_sgd.warmup": "6", "batch.micro_batch_size": "4"},
    "replicas": {**TINY, "train.steps": "12", "batch.micro_batch_size": "4", "parallel.sync_mode": "local-sgd",
                 "local_sgd.steps": "3", "local_sgd.warmup": "2"},
}
"""The two local-SGD runs of the tests below, trained in one 2-rank launch (:func:`local_sgd_runs`)."""


@pytest.fixture(scope="module")
def local_sgd_runs(tmp_path_factory) -> Path:
    """A folder holding each run of :data:`LOCAL_SGD` (``NAME/``), trained by ``tests/sync_worker.py`` with its
    ``local-sgd`` probe on (each rank's digests in ``NAME/local_sgd_rank{R}.json``), in one torchrun launch: a
    launch costs every rank torch's and the trainer's import (seconds), these runs a fraction of that."""
    root = tmp_path_factory.mktemp("lsgd")
    launch_layouts(2, root, LOCAL_SGD, worker=ROOT / "tests" / "sync_worker.py", results=False)
    return root


def test_local_sgd_warmup_is_synchronous_data_parallelism(local_sgd_runs, tmp_path_factory):
    """Within local_sgd_warmup the post-local-SGD hook all-reduces gradients: one process's run exactly."""
    got = load_result(local_sgd_runs / "warmup")
    want = reference_run(tmp_path_factory.mktemp("ref"), MODEL)
    check_layout(got, want, MODEL)


def test_local_sgd_replicas_agree_exactly_after_each_average_and_only_then(local_sgd_runs):
    run = local_sgd_runs / "replicas"
    ranks = [json.loads((run / f"local_sgd_rank{r}.json").read_text()) for r in range(2)]
    averaged = [r["averaged"] for r in ranks[0]]
    # PeriodicModelAverager: synchronous steps 1-2, then averages after steps 3, 6, 9, 12 (warmup + k*H + 1, 1-based)
    assert averaged == [True, True, True, False, False, True, False, False, True, False, False, True]
    for step, (a, b) in enumerate(zip(*ranks), start=1):
        if a["averaged"]:
            assert a["digest"] == b["digest"], step  # the same all-reduced values on both ranks: bit-identical
        else:
            assert a["digest"] != b["digest"], step  # different data since the last average


@pytest.mark.parametrize("mode, extra", [
    # local-sgd (~10 s) in `make test-slow`: its averaging and warmup are checked exactly in `make test`
    # (test_local_sgd_*); both parameter-server policies' convergence stays
    pytest.param("local-sgd", {"parallel.sync_mode": "local-sgd", "local_sgd.steps": "4",
                               "batch.micro_batch_size": "4"}, marks=pytest.mark.slow),
    # async-drop counts a dropped gradient as a step: 150 steps with 7 of 150 dropped reached val 3.16, but a
    # loaded CI machine dropped more and ended at 3.32 (> 3.31); 400 steps (val 3.09 at 300) leave room
    pytest.param("async-drop", {"parallel.sync_mode": "async", "parameter_server.max_staleness": "1", "train.steps": "400"},
                 marks=pytest.mark.serial),  # how many gradients are dropped depends on the ranks' timing: alone
    # async-wait: a loaded CI run ended at 3.318 (> 3.309) after 150 steps (3.159 unloaded), the staleness depending
    # on the ranks' timing; 400 steps, as async-drop above (3.133 unloaded at 300)
    pytest.param("async-wait", {"parallel.sync_mode": "async", "parameter_server.max_staleness": "1",
                                "parameter_server.stale_policy": "wait", "train.steps": "400"}, marks=pytest.mark.serial),
])
def test_runs_converge_below_the_unigram_entropy(tmp_path, mode, extra):
    proc = run_cli("train", str(CONFIG), "--nproc", "3" if "async" in mode else "2", "--out", str(tmp_path),
                   *override_args({**CONVERGE, **extra}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    val = [r["val_loss"] for r in read_records(tmp_path) if "val_loss" in r]
    assert val[-1] < unigram_entropy(), val


@pytest.mark.slow  # a slowed worker, ~12 s per policy: `make test-slow` keeps `make test` under 15 min
@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_staleness_bound_holds_with_a_slow_worker(tmp_path, policy):
    """Three workers, the first 50 ms slower per gradient than the others' ~5 ms: by the time its
    gradient arrives the others have made many updates."""
    s = 1
    overrides = {**TINY, "train.steps": "60", "parallel.sync_mode": "async", "parameter_server.max_staleness": str(s),
                 "parameter_server.stale_policy": policy, "train.eval_interval": "0"}
    torchrun(4, "slow-worker", tmp_path, overrides)
    stats = json.loads((tmp_path / "summary.json").read_text())["async"]
    assert stats["staleness_max"] <= s
    if policy == "drop":
        assert stats["dropped"] >= 1 and stats["applied"] + stats["dropped"] == 60
        assert stats["applied_by_worker"][0] < stats["pushed"][0]  # the slow worker's stale gradients went
    else:
        assert stats["dropped"] == 0 and stats["applied"] == 60
        assert stats["applied_by_worker"][0] >= 1  # the slow worker's gradients are applied: the others waited


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1", "--parallel.sync_mode", "async"], "needs at least one worker besides parameter_server.servers = 1"),
    (["--nproc", "1", "--parallel.sync_mode", "local-sgd"], "needs dp >= 2 replicas to average, got dp = 1"),
    (["--nproc", "2", "--parallel.sync_mode", "async", "--parameter_server.max_staleness", "-1"],
     "parameter_server.max_staleness = -1 must be >= 0"),
    (["--nproc", "4", "--parallel.sync_mode", "async", "--parallel.tp", "2"],
     "parallel.tp = 2 cannot be combined with parallel.sync_mode = 'async'"),
    (["--nproc", "4", "--parallel.sync_mode", "async", "--parallel.pp", "2", "--batch.gradient_accumulation_steps", "2"],
     "parallel.pp = 2 cannot be combined with parallel.sync_mode = 'async'"),
    (["--nproc", "2", "--parallel.sync_mode", "local-sgd", "--parallel.zero_stage", "3"],
     "parallel.zero_stage = 3 cannot be combined with parallel.sync_mode = 'local-sgd'"),
    (["--nproc", "4", "--parallel.sync_mode", "async", "--parameter_server.servers", "2", "--parameter_server.stale_policy", "wait"],
     "parameter_server.stale_policy = 'wait' needs parameter_server.servers = 1"),
    (["--nproc", "2", "--parallel.sync_mode", "bulk"], "parallel.sync_mode = 'bulk' is not valid"),
    (["--nproc", "2", "--parallel.sync_mode", "local-sgd", "--local_sgd.steps", "0"],
     "local_sgd.steps = 0 must be >= 1"),
])
def test_bad_sync_settings_are_refused_before_launch(tmp_path, args, message):
    proc = cli_here("train", str(CONFIG), "--out", str(tmp_path / "run"), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_async_run_resumes_from_its_checkpoint(tmp_path):
    """A parameter-server run saved at gradient 10 continues to 20: the count, the servers' AdamW state
    and each worker's place in the data stream come back (the metrics run 1..20 once each)."""
    from meshtrain.checkpoint import store as ckpt

    run = tmp_path / "run"
    base = {**TINY, "parallel.sync_mode": "async", "checkpoint.interval": "10", "parameter_server.max_staleness": "1000"}
    for steps, extra in (("10", []), ("20", ["--resume"])):
        proc = run_cli("train", str(CONFIG), "--nproc", "3", "--out", str(run), *extra,
                       *override_args({**base, "train.steps": steps}))
        assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r["step"] for r in read_records(run) if "loss" in r]
    assert steps == list(range(1, 21))
    meta = ckpt.read_meta(ckpt.resolve_checkpoint(run))
    assert meta["step"] == 20 and meta["dp"] == 2
    assert meta["async"]["version"] == 20  # nothing is too stale for a bound of 1000: every gradient applied
    per_step = int(TINY.get("batch.micro_batch_size", "12")) * 2  # each worker's stride in the shared stream
    assert all(seen % per_step == 0 and seen > 0 for seen in meta["async"]["samples_seen"])
