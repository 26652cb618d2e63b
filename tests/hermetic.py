"""The test suite's isolation from the machine it runs on: a fresh home and XDG folders for every test and
every process a test starts, and a check that nothing was written outside them.

A test must neither read state the developer's machine holds (``meshtrain plan --calibrate`` leaves a hardware
profile in ``~/.cache/meshtrain``, whose device names then show up in error messages) nor write into the
user's real folders. :func:`isolated_environment` gives the variables that point every per-user folder at a
temporary one; :func:`snapshot` and :func:`changes` compare the real folders and the checkout before and
after the session.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

XDG_FOLDERS = {"XDG_CACHE_HOME": ".cache", "XDG_CONFIG_HOME": ".config", "XDG_DATA_HOME": ".local/share",
               "XDG_STATE_HOME": ".local/state"}
"""The XDG Base Directory variables and the folder under ``HOME`` each defaults to."""


def isolated_environment(home: Path) -> dict[str, str]:
    """Variables that point ``HOME``, every XDG folder and torch's compile caches (Inductor's and Triton's, which
    default to ``/tmp/torchinductor_$USER`` and ``~/.triton``: a compiled test would otherwise run warm from an
    earlier session's kernels) into ``home`` (created, empty), for ``os.environ``."""
    env = {"HOME": str(home)}
    for variable, default in XDG_FOLDERS.items():
        folder = home / default
        folder.mkdir(parents=True, exist_ok=True)
        env[variable] = str(folder)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(home / ".cache" / "torchinductor")
    env["TRITON_CACHE_DIR"] = str(home / ".cache" / "triton")
    return env


def watched_folders(env: Mapping[str, str]) -> list[Path]:
    """meshtrain's folders in the real per-user cache, config and data folders that ``env`` (the environment
    before isolation) names: what a test must never create or change."""
    home = Path(env.get("HOME") or Path.home())
    folders = {home / default / "meshtrain" for default in XDG_FOLDERS.values()}
    folders |= {Path(env[v]) / "meshtrain" for v in XDG_FOLDERS if env.get(v)}
    return sorted(folders)


def snapshot(folders: list[Path], checkout: Path | None = None) -> dict[str, tuple[int, int]]:
    """{path: (size in bytes, mtime in ns)} of every file under ``folders``, and of every untracked file of the
    git checkout ``checkout`` that git does not ignore (a test that writes into the project)."""
    files: dict[str, tuple[int, int]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")) if folder.is_dir() else ():
            if path.is_file():
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    if checkout is not None and (checkout / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=checkout,
                                capture_output=True, text=True, check=True).stdout
        for name in filter(None, listed.split("\0")):
            path = checkout / name
            if path.is_file():
                stat = path.stat()
                files[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return files


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """What differs between two :func:`snapshot` results: "new PATH", "changed PATH", "removed PATH"."""
    out = [f"new {p}" for p in sorted(after.keys() - before.keys())]
    out += [f"changed {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    out += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    return out

