"""Runs that go wrong: non-finite steps are skipped and stop the run, a resume never changes the batch silently.

- ``optim.lr = 1e30``: step 1 is finite and applied; its update makes every later loss non-finite.
  Those steps are skipped (no update, a ``"skipped": true`` record each), so the model stays at step
  1's finite weights. ``train.max_nonfinite_steps`` of them in a row stop the run with one line from
  rank 0 and a non-zero exit, and the checkpoint written before stays loadable.
- Resuming on another number of ranks would change the global batch: refused with the flag that
  keeps it, and with that flag the run resumes and says from which step and layout.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import CONFIG, TINY, cli_here, launch_here, override_args, read_records, run_cli, train_cli


def _params(run):
    from conftest import final_params

    return final_params(run)


def test_nonfinite_steps_are_skipped_and_the_weights_stay_finite(tmp_path):
    run = tmp_path / "run"
    assert launch_here("train", str(CONFIG), "--nproc", "2", "--out", str(run),
                       *override_args({**TINY, "optim.lr": "1e30", "optim.warmup_steps": "0", "train.steps": "6",
                                       "train.max_nonfinite_steps": "100", "train.log_interval": "1"})) == 0
    records = [r for r in read_records(run) if "loss" in r]
    assert math.isfinite(records[0]["loss"]) and not records[0].get("skipped")
    skipped = [r for r in records if r.get("skipped")]
    assert [r["step"] for r in skipped] == [2, 3, 4, 5, 6]
    assert all(torch.isfinite(p).all() for p in _params(run).values())


@pytest.mark.slow  # ~14 s: `make test-slow` keeps `make test` under 15 min
def test_too_many_nonfinite_steps_stop_the_run_keeping_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(run),
                   *override_args({**TINY, "optim.lr": "1e30", "optim.warmup_steps": "0", "train.steps": "20",
                                   "train.max_nonfinite_steps": "3", "checkpoint.interval": "1",
                                   "train.log_interval": "100"}))
    assert proc.returncode != 0
    skipped = [r["step"] for r in read_records(run) if r.get("skipped")]
    assert skipped == [2, 3, 4]  # each logged although log_interval is 100
    said = [line for line in proc.stderr.splitlines() if "steps in a row" in line]
    assert len(said) == 1 and said[0].startswith("meshtrain train: error: 3 steps in a row (up to step 4)"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(torch.isfinite(p).all() for p in _params(run).values())  # the newest checkpoint loads, finite


@pytest.mark.slow  # the refusal itself is in the bad-input catalogue (resume-other-global-batch)
def test_resume_on_other_ranks_keeps_the_global_batch_or_says_how(tmp_path):
    run = tmp_path / "run"
    train_cli(run, 1, **{"train.steps": "2", "checkpoint.interval": "2"})  # global batch 12 on one rank
    base = ["train", str(CONFIG), "--nproc", "2", "--out", str(run), "--resume",
            *override_args({**TINY, "train.steps": "4"})]
    refused = run_cli(*base)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "was trained at global batch 12" in refused.stderr and "--batch.micro_batch_size 6" in refused.stderr
    resumed = run_cli(*base, "--batch.micro_batch_size", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2 of" in resumed.stderr and "global batch 12; now dp=2" in resumed.stderr
    assert [r["step"] for r in read_records(run) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow  # a run and its refused resumes, ~20 s: `make test-slow` keeps `make test` under 15 min
def test_resume_refuses_another_model_or_text_before_launch(tmp_path):
    """A checkpoint of another width or another corpus would fail inside every rank's DCP load (a
    traceback per rank); it is one line before launch, naming the override that fits."""
    run = tmp_path / "run"
    train_cli(run, 1, **{"train.steps": "2"})
    other = tmp_path / "other.txt"
    other.write_text("abcdefgh " * 2000)
    for extra, message in ((["--model.n_embd", "64"], "holds a model with model.n_embd = 32, this config has 64: "
                                                      "resume it with --model.n_embd 32"),
                           (["--data.path", str(other)], "was trained on a text with other characters")):
        proc = run_cli("train", str(CONFIG), "--nproc", "1", "--out", str(run), "--resume",
                       *override_args({**TINY, "train.steps": "4"}), *extra)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1



@pytest.fixture
def held_port():
    """A TCP port held by a program that is no rendezvous (it accepts connections and never answers)."""
    from conftest import free_port

    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", "import socket, time\n"
                               "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                               f"s.bind(('0.0.0.0', {port})); s.listen(); print('up', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "up"
    yield port, holder.pid
    holder.kill()
    holder.wait()


@pytest.mark.parametrize("static", [False, True], ids=["c10d", "node-rank-0"])
def test_a_rendezvous_port_held_by_another_program_is_refused_not_waited_on(tmp_path, held_port, static):
    """Before: a c10d rendezvous on it waited forever, a static one (--node-rank 0) was a traceback."""
    port, pid = held_port
    out = tmp_path / "run"
    extra = ["--node-rank", "0"] if static else []
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), "--rdzv-endpoint", f"127.0.0.1:{port}",
                    *extra, *override_args(TINY))
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert line.startswith(f"meshtrain train: error: --rdzv-endpoint = 127.0.0.1:{port}: port {port} on this machine "
                           f"is already held by pid {pid} ({sys.executable} -c import socket"), line
    assert line.endswith("; choose a free port") and not out.exists()


def test_the_ranks_store_port_is_held_from_launch_to_the_end(monkeypatch):
    """Before: torchrun's ``MASTER_PORT`` was free between the launcher picking it and rank 0 binding it, and
    another program's socket (a parallel test's gloo pair) could take it: rank 0 stopped with "Address already in
    use". The launcher's reservation now keeps any other socket off the port while rank 0's store listens on it."""
    import errno
    import os
    import socket

    from meshtrain.runtime.distributed import STORE_PORT_ENV, loopback_store, reserve_loopback_port

    reserved = reserve_loopback_port()
    port = reserved.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        monkeypatch.setenv(STORE_PORT_ENV, str(port))
        monkeypatch.setenv("MASTER_PORT", "1")  # torchrun's pick, which the reservation replaces
        store = loopback_store(0, 1)
        store.set("key", "value")
        assert store.get("key") == b"value" and os.environ["MASTER_PORT"] == str(port)
    finally:
        reserved.close()


def test_a_socket_error_is_not_called_a_failed_write():
    """Before: rank 0's ``EADDRINUSE`` read "could not write: Address already in use" and blamed the run folder."""
    import errno
    import os

    from meshtrain.train.entry import write_error

    assert write_error(OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))) is None
    assert write_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) == "could not write: No space left on device"
    assert write_error(OSError(errno.EACCES, os.strerror(errno.EACCES), "/x/y")).startswith("could not write /x/y")
