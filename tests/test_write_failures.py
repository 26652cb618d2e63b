"""Writes that fail are one line, and nothing committed is damaged (issue 25, Sec. 2): a full disk during a
checkpoint save (a small tmpfs mounted for the test; skipped where mounting is not allowed), a path the file
system refuses (a name too long) before launch, and a resume that would write over later checkpoints of its
own folder (refused before launch, not at its first save)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import CONFIG, TINY, cli_here, override_args, read_records, run_cli, train_here


def test_a_name_the_file_system_refuses_is_one_line_before_launch(tmp_path):
    out = tmp_path / ("x" * 300)  # NAME_MAX is 255 on Linux file systems
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), *override_args(TINY))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "File name too long" in lines[0]


def _tmpfs(mount, size: str):
    """A tmpfs of ``size`` mounted at ``mount`` for the test, unmounted after (skipped where mounting is not allowed)."""
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                                       capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MB tmpfs: room for the run's first checkpoint (~0.4 MB per save of this model), not its second."""
    yield from _tmpfs(tmp_path / "disk", "1200k")


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KB tmpfs: too small for an export of the tests' model (~0.2 MB)."""
    yield from _tmpfs(tmp_path / "full", "64k")


@pytest.mark.parametrize("form", ["safetensors", "hf"])
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(artefacts, full_disk, form):
    """``export`` whose write runs out of space (safetensors' own error, or an OSError): exit 2, one line naming the
    output and the reason, and no file left on that disk (the temporary ones removed)."""
    from artefacts import run_cli_here

    out = full_disk / ("model.safetensors" if form == "safetensors" else "exported")
    argv = ["export", "--checkpoint", str(artefacts / "run"), "--out", str(out)]
    code, err, _ = run_cli_here(argv + (["--format", "hf"] if form == "hf" else []))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith(f"meshtrain export: error: could not write '{out}'") and "No space left" in lines[0]
    assert list(full_disk.iterdir()) == []


@pytest.mark.slow  # two 2-rank launches, ~40 s
def test_a_full_disk_during_a_save_is_one_line_per_rank_and_the_run_resumes(small_disk, tmp_path):
    run = small_disk / "run"
    args = override_args({**TINY, "train.steps": "20", "checkpoint.interval": "5", "checkpoint.keep": "5"})
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(run), *args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "No space left on device" in line]
    assert len(errors) == 2 and all("stopped in step 10: checkpoint save" in line and
                                    "--resume continues from step_000005" in line for line in errors), errors
    assert f"The same command with --resume continues from step_000005 in {run}." in proc.stderr  # the launcher
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept[0] == "step_000005" and json.loads((run / "checkpoints" / "step_000005" / "meta.json").read_text())
    # nothing committed is damaged: moved to a disk with room, the same command with --resume finishes the run
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(moved), "--resume", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_records(moved) if "loss" in r][-1] == 20
    assert sorted(p.name for p in (moved / "checkpoints").iterdir())[-1] == "step_000020"


def test_resuming_an_earlier_checkpoint_into_its_own_folder_is_refused_before_launch(tmp_path):
    """Going back to step 5 in a folder that holds step 10 would write step 10 again (torch refuses at the first
    save, after the steps were trained) and drop the metrics after step 5: refused before launch, nothing changed."""
    out = tmp_path / "run"
    train_here(out, **{"train.steps": "10", "checkpoint.interval": "5", "checkpoint.keep": "3"})  # in this process
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = cli_here("train", str(CONFIG), "--nproc", "1", "--out", str(out), "--resume",
                   str(out / "checkpoints" / "step_000005"), *override_args({**TINY, "train.steps": "20",
                                                                              "checkpoint.interval": "5"}))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "goes back to step 5, but train.out_dir" in proc.stderr
    assert "holds later checkpoints this run would save again (step_000010)" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
