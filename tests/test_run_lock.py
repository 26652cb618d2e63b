"""Run folders that never lose work: one run per output folder (:mod:`meshtrain.runlock`), and a run never
writes into a folder that holds files meshtrain did not write (:func:`meshtrain.preflight.foreign_entries`).

A second run on a folder in use is refused before it starts, in one line naming the folder and the holder's
pid, and the first finishes intact; the lock goes with its process however it ends (``flock``), so a killed
run never blocks the next."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONFIG, ROOT, TINY, cli_here, free_port, override_args, read_records, train_here
from meshtrain.errors import ConfigError
from meshtrain.runlock import hold, holder_pid

HOLD = "import sys, time; from meshtrain.runlock import hold; hold(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def test_a_held_folder_is_refused_naming_it_and_the_pid_and_release_cleans_up(tmp_path):
    out = tmp_path / "run"
    lock = hold(out)
    assert holder_pid(out) == os.getpid()
    with pytest.raises(ConfigError, match=rf"^train.out_dir = '{out}' is in use by another run \(pid {os.getpid()}\): "
                                          r"wait for it to end, or choose another --out$"):
        hold(out)
    lock.release()
    assert not out.exists()  # the lock made the folder and nothing was written into it: it is gone again
    (out / "checkpoints").mkdir(parents=True)
    before = out.stat().st_mtime_ns
    hold(out).release()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints"] and out.stat().st_mtime_ns == before
    (tmp_path / "file").write_text("x")
    assert hold(tmp_path / "file") is None  # preflight says "is a file" in its own line


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_the_lock_dies_with_its_process(tmp_path, sig):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=rf"\(pid {proc.pid}\)"):
            hold(out)
        proc.send_signal(sig)
        proc.wait(30)
        hold(out).release()
    finally:
        proc.kill()
        proc.wait()


def _wait_for_metrics(out: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None, f"the first run ended (rc {proc.returncode}) before its first step"
        assert time.monotonic() < end, "no step within the timeout"
        time.sleep(0.02)


# the torchrun variant in `make test-slow`: a second 200-step run, ~20 s, keeps `make test` under 15 min
@pytest.mark.slow  # two real runs side by side, ~25 s; the lock itself is tested above in make test
@pytest.mark.parametrize("first", ["meshtrain-train", "torchrun"])
def test_a_second_run_on_the_same_out_is_refused_and_the_first_finishes_intact(tmp_path, first):
    """The first run holds the folder, from ``meshtrain train`` (its launcher's pid) or from ``torchrun``
    directly (rank 0's pid); the second, ``meshtrain train`` with the same ``--out``, stops in one line."""
    out, steps = tmp_path / "run", 200  # long enough to be running when the second one starts
    args = override_args({**TINY, "train.steps": str(steps), "train.out_dir": str(out)})
    if first == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "meshtrain.train", str(CONFIG), *args]
    else:
        argv = [sys.executable, "-m", "meshtrain.cli", "train", str(CONFIG), "--nproc", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "first.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_for_metrics(out, proc)
        holder = holder_pid(out)
        second = cli_here("train", str(CONFIG), "--nproc", "2", *args)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.strip().splitlines() == [
            f"meshtrain train: error: train.out_dir = '{out}' is in use by another run (pid {holder}): wait for it "
            f"to end, or choose another --out"], second.stderr
        if first == "meshtrain-train":
            assert holder == proc.pid
        else:  # rank 0, a child of torchrun's agent
            assert holder != proc.pid and f"PPid:\t{proc.pid}" in Path(f"/proc/{holder}/status").read_text()
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    assert [r["step"] for r in read_records(out) if "loss" in r] == list(range(1, steps + 1))
    assert holder_pid(out) is None


def test_a_run_writes_only_what_the_foreign_file_check_knows(tmp_path):
    """``RUN_FILES``/``RUN_DIRS`` are the names a run writes: a finished run (with TensorBoard) holds nothing
    else, and the modules that write them agree on the names."""
    from meshtrain.metrics import METRICS_FILE, SUMMARY_FILE, TB_DIR
    from meshtrain.preflight import RUN_DIRS, RUN_FILES, foreign_entries
    from meshtrain.profiling import PROFILE_DIR

    assert {METRICS_FILE, SUMMARY_FILE} <= set(RUN_FILES) and {TB_DIR, PROFILE_DIR, "checkpoints"} <= set(RUN_DIRS)
    out = tmp_path / "run"
    train_here(out, **{"train.steps": "2"})
    assert foreign_entries(out) == [], sorted(p.name for p in out.iterdir())
    (out / "summary.json.tmp").write_text("{")  # an atomic write cut short is still meshtrain's
    (out / ".summary.json.k3j2_x9.tmp").write_text("{")  # under its fresh temporary name too
    (out / ".meshtrain-probe-x").mkdir()
    assert foreign_entries(out) == []
    (out / "checkpoints.txt").write_text("")
    (out / "loss.png.bak").write_text("")
    assert foreign_entries(out) == ["checkpoints.txt", "loss.png.bak"]


def test_a_folder_with_files_meshtrain_did_not_write_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes\n")
    (out / "data").mkdir()
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), *override_args(TINY))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"meshtrain train: error: train.out_dir = '{out}' holds files meshtrain did not write (data and 1 more): "
        f"choose a new or empty folder for --out"], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["data", "notes.txt"]


@pytest.mark.parametrize("name", ["summary.json", "loss.png", "plan_vs_actual.json", ".summary.json.x1.tmp"])
def test_a_run_file_with_no_run_beside_it_is_the_users(name, tmp_path):
    """A ``summary.json`` (``loss.png``, ``plan_vs_actual.json``, a temporary of one) in a folder that holds no run
    (no metrics.jsonl, no checkpoints) is the user's own; beside a run's metrics.jsonl it is the run's."""
    from meshtrain.preflight import foreign_entries

    (tmp_path / name).write_text("mine\n")
    assert foreign_entries(tmp_path) == [name]
    (tmp_path / "metrics.jsonl").write_text("")
    assert foreign_entries(tmp_path) == []


def test_a_users_summary_json_is_refused_before_launch_and_left_alone(tmp_path):
    """It was overwritten by the run's own at the end."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text("mine\n")
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), *override_args(TINY))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"meshtrain train: error: train.out_dir = '{out}' holds files meshtrain did not write (summary.json): "
        f"choose a new or empty folder for --out"], proc.stderr
    assert [p.name for p in out.iterdir()] == ["summary.json"] and (out / "summary.json").read_text() == "mine\n"
