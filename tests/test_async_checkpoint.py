"""``checkpoint.async_save = true``: checkpoints written in the background keep a blocking save's guarantees.

- The background write is a snapshot of the step it saves, though training goes on while it runs (the
  writer is slowed here so that it spans later steps): its checkpoint holds the same parameters as a
  blocking save of that step, and resuming from it gives the uninterrupted run's losses bit for bit.
- A stop signal while a write is in flight waits for it, commits it, then saves and commits its own step.
- A rank killed while it trains on with its write in flight (2 ranks under torchrun) leaves that step
  uncommitted under ``step_N.tmp`` and the previous checkpoint complete. ``make test-slow``: ``--resume``
  continues from it, and every other kill point of ``test_preemption.py`` with the write in the background.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import (CONFIG, TINY, assert_close_params, final_params, losses, override_args, read_records,
                      run_cli, train_here)

RUN = {"checkpoint.interval": "5", "checkpoint.keep": "3"}
ASYNC = {**RUN, "checkpoint.async_save": "true"}


def test_async_save_is_refused_with_the_parameter_server():
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError

    overrides = {**TINY, "checkpoint.async_save": "true"}
    assert load_config(CONFIG, overrides).checkpoint.async_save is True
    with pytest.raises(ConfigError, match=r"checkpoint.async_save = true needs a synchronous parallel.sync_mode"):
        load_config(CONFIG, {**overrides, "parallel.sync_mode": "async"})


@pytest.fixture(scope="module")
def blocking(tmp_path_factory):
    """The reference: 10 steps, blocking saves at steps 5 and 10."""
    out = tmp_path_factory.mktemp("blocking")
    return out, losses(train_here(out, **RUN))


@pytest.fixture
def slow_writer(monkeypatch):
    """DCP's writer sleeps 5 ms per tensor (the tiny model's write spans several steps); yields the
    steps committed, each with the newest step logged when it was."""
    import torch.distributed.checkpoint.filesystem as fs

    from meshtrain.checkpoint import store as ckpt  # the writer commits through the store

    write_item, commit = fs._write_item, ckpt.commit
    committed: list[tuple[int, int]] = []

    def slow_item(*args, **kwargs):
        time.sleep(0.005)
        return write_item(*args, **kwargs)

    def recorded_commit(out_dir, step, *args, **kwargs):
        committed.append((step, max(r["step"] for r in read_records(out_dir) if "loss" in r)))
        return commit(out_dir, step, *args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", slow_item)
    monkeypatch.setattr(ckpt, "commit", recorded_commit)
    yield committed


def test_background_save_is_a_snapshot_and_resumes_exactly(blocking, slow_writer, tmp_path):
    from meshtrain.checkpoint import store as ckpt

    ref_dir, ref_losses = blocking
    out = tmp_path / "async"
    assert losses(train_here(out, **ASYNC)) == ref_losses  # saving in the background changes no step
    assert [step for step, _ in slow_writer] == [5, 10]
    assert slow_writer[0][1] > 5, slow_writer  # step 5 was committed after later steps trained
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000005", "step_000010"]
    assert not list((out / "checkpoints").glob("*.tmp"))
    for name in ("step_000005", "step_000010"):
        folder = out / "checkpoints" / name
        ckpt.verify_files(folder)
        assert_close_params(final_params(folder), final_params(ref_dir / "checkpoints" / name), atol=0)
        ref_meta, meta = (json.loads((d / "checkpoints" / name / "meta.json").read_text()) for d in (ref_dir, out))
        assert {**meta, "files": None, "config": None} == {**ref_meta, "files": None, "config": None}  # sampler, LR
    resumed = losses(train_here(tmp_path / "resumed", **RUN,
                                **{"checkpoint.resume": str(out / "checkpoints" / "step_000005")}))
    assert resumed == {s: ref_losses[s] for s in range(6, 11)}  # the optimizer state and sampler too


def test_a_stop_waits_for_the_write_in_flight_and_commits_both(blocking, slow_writer, tmp_path, monkeypatch):
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.runtime.faults import STOP, Stopped
    from meshtrain.train.loop import Trainer

    ref_dir, ref_losses = blocking
    forward_backward = Trainer.forward_backward
    calls = []

    def signalled_at_step_7(self, micro_batches):
        calls.append(1)
        if len(calls) == 7:
            monkeypatch.setattr(STOP, "signum", signal.SIGTERM)  # as the handler does; the loop stops after step 7
        return forward_backward(self, micro_batches)

    monkeypatch.setattr(Trainer, "forward_backward", signalled_at_step_7)
    out = tmp_path / "run"
    with pytest.raises(Stopped) as stopped:
        train_here(out, **ASYNC)
    assert stopped.value.step == 7 and stopped.value.checkpoint == out / "checkpoints" / "step_000007"
    assert [step for step, _ in slow_writer] == [5, 7]  # step 5's write was in flight at the stop
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_000005", "step_000007"]
    assert not list((out / "checkpoints").glob("*.tmp"))
    monkeypatch.setattr(STOP, "signum", 0)
    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    resumed = losses(train_here(out, **ASYNC, **{"checkpoint.resume": str(out)}))
    assert {s: loss for s, loss in resumed.items() if s > 7} == {s: ref_losses[s] for s in range(8, 11)}
    assert_close_params(final_params(out), final_params(ref_dir), atol=0)


@pytest.mark.slow  # a 2-rank torchrun launch killed mid-write, ~20 s: `make test-slow` (make test is at its limit)
def test_a_rank_killed_while_its_write_runs_leaves_the_previous_checkpoint(tmp_path):
    from test_preemption import kill_in_save_trial

    found = kill_in_save_trial(tmp_path, 1, "training", async_save=True)  # checks step 3 is whole and loads
    assert found.name == "step_000003" and (found.parent / "step_000006.tmp").is_dir()


@pytest.mark.slow
def test_resume_after_a_kill_during_the_background_write(tmp_path):
    from test_preemption import kill_in_save_trial

    kill_in_save_trial(tmp_path, 0, "training", async_save=True)
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--resume",
                   *override_args({**TINY, "train.steps": "8", "checkpoint.interval": "3", "checkpoint.keep": "1",
                                   "checkpoint.async_save": "true", "train.out_dir": str(tmp_path / "run")}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 3 " in proc.stderr
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000008"]
