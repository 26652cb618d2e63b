"""Elastic DiLoCo workers (``diloco.lighthouse``, :mod:`meshtrain.parallel.diloco.elastic`): each worker its own
``meshtrain train`` job, joined through torchft's lighthouse on 127.0.0.1.

- With every worker alive from the start, two worker jobs are the two-worker DiLoCo of one job: the same
  losses step by step and the same final outer weights; both stopped and resumed from their own checkpoints, the
  same as uninterrupted.
- One worker's rank killed (SIGKILL) under ``--max-restarts 1``: the other worker's rank is never restarted
  and runs every step once; the killed one comes back, takes over the living worker's state at one of its
  outer steps, and both end with the same outer weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import elastic_jobs
from conftest import CONFIG, ROOT, TINY, assert_close_losses, final_params, losses, override_args, read_records
from elastic_jobs import Lighthouse, logged_steps, rank_pid

pytest.importorskip("torchft")

MODEL = {**TINY, "model.n_head": "4", "model.dropout": "0.0", "batch.micro_batch_size": "2",
         "parallel.sync_mode": "diloco", "diloco.group": "1", "diloco.inner_steps": "4",
         "train.steps": "12", "checkpoint.interval": "4", "checkpoint.keep": "3"}
"""The two-worker DiLoCo of tests/test_diloco.py's runs (AdamW inside, H = 4, outer Nesterov 0.7/0.9)."""


def start_worker(lighthouse: Lighthouse, worker: int, out: Path, overrides: dict[str, str], *extra: str,
                 ranks: int = 1) -> subprocess.Popen:
    """Worker ``worker`` of 2 of :data:`MODEL`'s run (:func:`elastic_jobs.start_worker`)."""
    return elastic_jobs.start_worker(CONFIG, lighthouse, worker, 2, out, {**MODEL, **overrides}, *extra, ranks=ranks)


def finish(proc: subprocess.Popen, out: Path, timeout: float = 300) -> None:
    assert proc.wait(timeout=timeout) == 0, Path(f"{out}.log").read_text()[-4000:]


def assert_took_over_the_same_state(out: Path, source: Path) -> None:
    """``out``'s final checkpoint holds the step count of its AdamW, the sampler's position and the LR schedule that
    ``source``'s does: what a rejoining worker took over went on in step. Had it not been taken over, the joined
    worker's AdamW would count only the steps since it joined and its sampler only the samples it read."""
    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpoint import store as ckpt

    metas, steps = [], []
    for run in (out, source):
        path = ckpt.resolve_checkpoint(run)
        metas.append(ckpt.read_meta(path))
        state = {"optim.state.tok_emb.weight.step": torch.zeros(())}
        dcp.load(state, checkpoint_id=str(path))
        steps.append(float(state["optim.state.tok_emb.weight.step"]))
    assert metas[0]["step"] == metas[1]["step"] and steps[0] == steps[1] == metas[0]["step"], (metas, steps)
    assert metas[0]["sampler"] == metas[1]["sampler"]
    assert metas[0]["scheduler"]["last_epoch"] == metas[1]["scheduler"]["last_epoch"]


@pytest.mark.parametrize("ranks,precision", [  # in make test-slow, for make test's time (44 s of it here): make test
    # keeps an elastic job's rejoin (test_a_killed_worker_rejoins_while_the_other_goes_on) and the lighthouse checks
    pytest.param(1, "fp32", marks=pytest.mark.slow), pytest.param(2, "fp32", marks=pytest.mark.slow),
    pytest.param(1, "bf16", marks=pytest.mark.slow)],
    ids=["1-rank-workers", "dp2-workers", "bf16-exchange"])
def test_two_worker_jobs_are_the_two_worker_diloco_of_one_job(tmp_path, ranks, precision):
    """Both jobs join before step 1 (the lighthouse waits for 2), so every outer step averages both
    pseudo-gradients, as the one-job DiLoCo's all-reduce does: same inputs, same operations, so every loss of
    worker 0 and the final weights agree to the contract's tolerance (the runs order no sum differently). With
    dp2 inside, each rank sends half the pseudo-gradient through its own torchft group, as in one job; in bf16 the
    pseudo-gradients are rounded and summed in bf16 by both (the count of 2 is exact in bf16)."""
    exchange = {"diloco.precision": precision}
    lighthouse = Lighthouse(min_replicas=2, heartbeat_ms=2000)
    try:
        jobs = [(start_worker(lighthouse, w, tmp_path / f"w{w}", exchange, ranks=ranks), tmp_path / f"w{w}")
                for w in (0, 1)]
        for proc, out in jobs:
            finish(proc, out)
    finally:
        lighthouse.close()
    one_job = {**MODEL, **exchange, "diloco.group": str(ranks), "train.out_dir": str(tmp_path / "one-job")}
    proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "train", str(CONFIG), "--nproc", str(2 * ranks),
                           *override_args(one_job)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # rank 0 logs the loss of worker 0's batch in both runs
    assert_close_losses(losses(read_records(tmp_path / "w0")), losses(read_records(tmp_path / "one-job")))
    want = final_params(tmp_path / "one-job")
    for w in (0, 1):
        got = final_params(tmp_path / f"w{w}")
        for name in want:  # the last outer step's weights: equal inputs to equal fp32 operations
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        summary = json.loads((tmp_path / f"w{w}" / "summary.json").read_text())["diloco"]
        assert (summary["workers"], summary["outer_steps"], summary["healed_at"]) == (2, 3, None)
    if (ranks, precision) == (1, "fp32"):  # both workers stopped and resumed from their own step-8 checkpoints: the uninterrupted run
        lighthouse = Lighthouse(min_replicas=2, heartbeat_ms=2000)
        try:
            jobs = [(start_worker(lighthouse, w, tmp_path / f"r{w}", {}, "--resume",
                                  str(tmp_path / f"w{w}" / "checkpoints" / "step_000008")), tmp_path / f"r{w}")
                    for w in (0, 1)]
            for proc, out in jobs:
                finish(proc, out)
        finally:
            lighthouse.close()
        for w in (0, 1):
            want = losses(read_records(tmp_path / f"w{w}"))
            got = losses(read_records(tmp_path / f"r{w}"))
            assert sorted(got) == [9, 10, 11, 12]
            assert_close_losses(got, {s: want[s] for s in got})
            got, want = final_params(tmp_path / f"r{w}"), final_params(tmp_path / f"w{w}")
            for name in want:  # each worker's own AdamW state, sampler and schedule, the outer weights and momentum
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_killed_worker_rejoins_while_the_other_goes_on(tmp_path):
    """Two worker jobs under ``--max-restarts 1``. The lighthouse lets one worker form a quorum alone, so the
    one that starts later may join the other at an outer step, taking over its state; the survivor is a worker
    that started at step 1. The other's rank is killed (SIGKILL) 8 steps later and restarted by torchrun with no
    checkpoint to resume (``checkpoint.interval = 0``), so it can only continue past the kill by taking over the
    survivor's state. The survivor's rank is the same process throughout: it logs every step once, in order.

    Timing: at its next outer step the survivor waits until the lighthouse declares the dead worker gone (its
    heartbeats missing for torchft's default 5 s), then goes on alone until the restarted worker asks to join (the
    bench measures both). The restart must end before the survivor's last step: 5 s plus the survivor's ~1,100
    remaining steps (>= 8 s on an idle 2-core machine; slowed by the same load that slows the restart)."""
    steps, H = 1200, 4
    overrides = {"train.steps": str(steps), "checkpoint.interval": "0", "train.log_interval": "1"}
    outs = [tmp_path / f"w{w}" for w in (0, 1)]
    lighthouse = Lighthouse(min_replicas=1)
    try:
        jobs = [start_worker(lighthouse, w, outs[w], overrides, "--max-restarts", "1") for w in (0, 1)]
        deadline = time.monotonic() + 240
        while not all(logged_steps(out) for out in outs):
            assert time.monotonic() < deadline and all(job.poll() is None for job in jobs), \
                [Path(f"{out}.log").read_text()[-2000:] for out in outs]
            time.sleep(0.05)
        s, v = (0, 1) if logged_steps(outs[0])[0] == 1 else (1, 0)  # the survivor never took over a state
        joined_at = logged_steps(outs[v])[0] - 1
        while len(logged_steps(outs[v])) < 8:
            assert time.monotonic() < deadline and jobs[v].poll() is None, Path(f"{outs[v]}.log").read_text()
            time.sleep(0.05)
        survivor_pid, killed = rank_pid(jobs[s].pid), rank_pid(jobs[v].pid)
        assert survivor_pid and killed
        os.kill(killed, signal.SIGKILL)
        killed_after = logged_steps(outs[v])[-1]
        finish(jobs[v], outs[v])
        assert rank_pid(jobs[s].pid) in (survivor_pid, None)  # None: it has finished meanwhile
        finish(jobs[s], outs[s])
    finally:
        lighthouse.close()
    survivor_steps = logged_steps(outs[s])
    assert survivor_steps == list(range(1, steps + 1)), (  # never restarted: each step once, in order
        sorted(set(range(1, steps + 1)) ^ set(survivor_steps))[:20], Path(f"{outs[s]}.log").read_text()[-3000:])
    after = json.loads((outs[v] / "summary.json").read_text())["diloco"]
    assert after["healed_at"] is not None and after["healed_at"] % H == 0 and after["healed_at"] > killed_after, \
        (after, joined_at, killed_after)
    summary = json.loads((outs[s] / "summary.json").read_text())["diloco"]
    assert summary["healed_at"] is None and summary["workers"] == 2  # the last outer step had both again
    got, want = final_params(outs[v]), final_params(outs[s])
    for name in want:  # the same outer weights: taken over exactly, then the same outer steps on the same sums
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert_took_over_the_same_state(outs[v], outs[s])


@pytest.mark.slow  # ~75 s: 4 ranks on 2 cores, and the first worker must outlast the second's start
def test_a_tp2_worker_that_starts_late_takes_over_the_sharded_state(tmp_path):
    """Two tp2 worker jobs, the second started once the first has taken a step: it joins at the first's next outer
    step and takes over its state, AdamW's tp-sharded moments (DTensors, sent as each rank's local shard and placed
    again) included; both end with the same weights, AdamW step count, sampler position and LR schedule."""
    overrides = {"train.steps": "800", "checkpoint.interval": "0", "parallel.tp": "2"}  # the second joins ~step 250
    outs = [tmp_path / f"w{w}" for w in (0, 1)]
    lighthouse = Lighthouse(min_replicas=1)
    try:
        first = start_worker(lighthouse, 0, outs[0], overrides, ranks=2)
        deadline = time.monotonic() + 240
        while not logged_steps(outs[0]):
            assert time.monotonic() < deadline and first.poll() is None, Path(f"{outs[0]}.log").read_text()
            time.sleep(0.05)
        second = start_worker(lighthouse, 1, outs[1], overrides, ranks=2)
        finish(second, outs[1])
        finish(first, outs[0])
    finally:
        lighthouse.close()
    joined = json.loads((outs[1] / "summary.json").read_text())["diloco"]["healed_at"]
    assert joined is not None and joined > 0 and logged_steps(outs[1])[0] == joined + 1
    got, want = final_params(outs[1]), final_params(outs[0])
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert_took_over_the_same_state(outs[1], outs[0])


ELASTIC = {**MODEL, "diloco.lighthouse": "http://127.0.0.1:29510", "diloco.workers": "2"}
REFUSED = {  # key: values an elastic run refuses (each alone on ELASTIC)
    "diloco.lighthouse": ["127.0.0.1:29510", "http://127.0.0.1", "http://127.0.0.1:0", "http://h:70000",
                                   "ftp://h:1"],
    "diloco.workers": ["1", "0"],
    "diloco.worker": ["2", "-1"],
    "diloco.fragments": ["2", "4"],
    "diloco.alpha": ["0.5"],
    "diloco.delay": ["1"],
    "diloco.precision": ["int8"],
    "parallel.zero_stage": ["1"],
    "checkpoint.interval": ["6", "2"],
    "train.steps": ["10", "13"],
}


@pytest.mark.parametrize("key,value", [(k, v) for k, values in REFUSED.items() for v in values])
def test_what_elastic_workers_do_not_support_is_refused_naming_the_key(key, value):
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError

    load_config(CONFIG, ELASTIC)  # the base is valid
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        load_config(CONFIG, {**ELASTIC, key: value})
    assert "\n" not in str(error.value)


def test_diloco_workers_without_a_lighthouse_is_refused_before_launch(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "meshtrain.cli", "train", str(CONFIG), "--nproc", "2",
                           *override_args({**MODEL, "diloco.workers": "2", "train.out_dir": str(out)})],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
                          timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "diloco.lighthouse" in proc.stderr.strip().splitlines()[-1]
    assert not out.exists()


def _said(out: Path) -> list[str]:
    """The lines of a worker job's console that are not its progress (``step N: val_loss``, the bar)."""
    return [line for line in Path(f"{out}.log").read_text().splitlines() if line.startswith("meshtrain train: ")]


@pytest.mark.slow  # ~65 s on a loaded 2-core machine: two worker jobs
def test_two_jobs_started_together_with_one_index_one_stops_in_one_line(tmp_path):
    """Two jobs with ``diloco.worker = 0`` started at once both pass the pre-launch check (neither heartbeats yet).
    They meet in a quorum (the lighthouse waits for a heartbeating worker), where the claims of an index summed with
    the exchange show the index twice: the job behind, or of two level ones the later started, stops before it reads
    any data, in one line, exit 2; the other goes on and finishes (``min_replicas`` 1)."""
    overrides = {"train.steps": "400", "checkpoint.interval": "0"}  # long enough for the second to meet the first
    outs = [tmp_path / f"job{j}" for j in (0, 1)]
    lighthouse = Lighthouse(min_replicas=1, heartbeat_ms=2000)
    try:
        jobs = [start_worker(lighthouse, 0, out, overrides) for out in outs]
        codes = [job.wait(timeout=300) for job in jobs]
    finally:
        lighthouse.close()
    assert sorted(codes) == [0, 2], [Path(f"{out}.log").read_text()[-3000:] for out in outs]
    stopped = outs[codes.index(2)]
    log = Path(f"{stopped}.log").read_text()
    assert "Traceback" not in log and "rank(s) failed" not in log, log[-3000:]
    said = _said(stopped)
    assert len(said) == 1 and said[0].startswith(
        f"meshtrain train: error: diloco.worker = 0 is taken: another job at the lighthouse {lighthouse.url} runs as "
        "worker 0 too"), log[-3000:]
    assert "so this job stopped before its first step: give it another index in [0, 2)" in said[0], said
    assert not logged_steps(stopped)
    assert logged_steps(outs[codes.index(0)])[-1] == 400


@pytest.mark.slow  # ~65 s on a loaded 2-core machine: two worker jobs
def test_a_worker_that_diverges_stops_every_worker_at_the_next_outer_step(tmp_path):
    """Worker 0's job takes its outer steps at an outer lr of 1e30 (each job applies the outer step itself), so its
    steps 3 and 4 are non-finite (``train.max_nonfinite_steps`` 2) and worker 1's are not. The vote to stop goes with
    the outer step of step 4: both jobs stop there, each with its one line and exit 3; none waits out a timeout."""
    overrides = {"diloco.inner_steps": "2", "train.max_nonfinite_steps": "2", "train.steps": "12",
                 "checkpoint.interval": "0"}
    outs = [tmp_path / f"w{w}" for w in (0, 1)]
    lighthouse = Lighthouse(min_replicas=2, heartbeat_ms=2000)
    try:
        jobs = [start_worker(lighthouse, w, outs[w], {**overrides, **({"diloco.outer_lr": "1e30"} if w == 0 else {})})
                for w in (0, 1)]
        codes = [job.wait(timeout=300) for job in jobs]
    finally:
        lighthouse.close()
    logs = [Path(f"{out}.log").read_text() for out in outs]
    assert codes == [3, 3], [log[-3000:] for log in logs]
    for out, log in zip(outs, logs):
        assert "Traceback" not in log and "rank(s) failed" not in log, log[-3000:]
        assert logged_steps(out)[-1] == 4
    said = [_said(out) for out in outs]
    assert len(said[0]) == 1 and said[0][0].startswith("meshtrain train: error: 2 steps in a row (up to step 4)"), said
    assert "stopped after step 4 with every worker (DiLoCo worker 0 of 2 diverged)" in said[0][0], said
    assert len(said[1]) == 1 and said[1][0].startswith(
        "meshtrain train: error: DiLoCo worker 0 of 2 had train.max_nonfinite_steps = 2 steps in a row"), said
    assert "every worker stopped after step 4" in said[1][0] and "diloco.outer_lr" in said[1][0], said
