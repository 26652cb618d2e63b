"""The suite is hermetic (tests/hermetic.py): every test and every process it starts sees a fresh home, and a
write into the real per-user folders or the checkout is found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hermetic
from conftest import FAKE_HOME, REAL_FOLDERS


def test_tests_and_their_processes_see_a_fresh_home():
    """The planner's default profile, as a child process resolves it, lies in the suite's own empty home."""
    code = "from meshtrain.planner.hardware import DEFAULT_PROFILE as p; print(p.expanduser())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).is_relative_to(FAKE_HOME), out
    assert not Path(out).exists(), f"{out} exists: a test wrote the default profile instead of its own path"
    assert all(not folder.is_relative_to(FAKE_HOME) for folder in REAL_FOLDERS), REAL_FOLDERS
    assert os.environ["XDG_CACHE_HOME"] == str(FAKE_HOME / ".cache")


def test_a_write_into_a_watched_folder_is_found(tmp_path):
    """A new, a changed and a removed file in a watched folder are each reported (the check can fail)."""
    folder = tmp_path / ".cache" / "meshtrain"
    folder.mkdir(parents=True)
    (folder / "kept.toml").write_text("a")
    (folder / "edited.toml").write_text("a")
    (folder / "deleted.toml").write_text("a")
    watched = hermetic.watched_folders({"HOME": str(tmp_path)})
    assert folder in watched
    before = hermetic.snapshot(watched)
    (folder / "hardware_profile.toml").write_text("[cpu]\n")
    (folder / "edited.toml").write_text("bb")
    (folder / "deleted.toml").unlink()
    assert hermetic.changes(before, hermetic.snapshot(watched)) == [
        f"new {folder / 'hardware_profile.toml'}", f"changed {folder / 'edited.toml'}",
        f"removed {folder / 'deleted.toml'}"]


def test_a_new_file_in_the_checkout_is_found(tmp_path):
    """An untracked file git does not ignore, left in a checkout, is reported; an ignored one is not."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("out/\n")
    before = hermetic.snapshot([], tmp_path)
    (tmp_path / "stray.txt").write_text("x")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("{}")
    assert hermetic.changes(before, hermetic.snapshot([], tmp_path)) == [f"new {tmp_path / 'stray.txt'}"]
