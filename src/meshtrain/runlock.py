"""One run per output folder: an exclusive ``flock`` on the folder itself, held while the run lives.

``meshtrain train`` takes it before its checks and holds it until it exits; ranks started by ``torchrun``
directly take it in global rank 0 (:mod:`meshtrain.train.entry`). A second run on the same folder is
refused at once with one line naming the folder and the holder's pid (Linux lists every ``flock`` with
its process in ``/proc/locks``). The kernel drops a ``flock`` when its process dies, however it dies
(SIGKILL, OOM), so nothing stale is ever left to block a later run, and the lock writes nothing into the
folder (a refused run changes no file of it). A folder the lock had to make is removed again on release
if nothing was written into it.
Importing this module imports no torch (the launcher and the ranks take the lock before torch loads).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from meshtrain.errors import ConfigError

HELD_ENV = "MESHTRAIN_OUT_LOCK_PID"
"""Set by ``meshtrain train`` to its pid when it holds the lock, so that its ranks do not take it again."""


class RunLock:
    """The held lock of one output folder; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, folder: Path, fd: int, made_folder: bool) -> None:
        self.folder, self.fd, self.made_folder = folder, fd, made_folder

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.made_folder and not any(self.folder.iterdir()):
                self.folder.rmdir()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def hold(out_dir: str | Path, key: str = "train.out_dir") -> RunLock | None:
    """Take the lock of ``out_dir`` (made if missing) for this process, or None where no folder can be
    there (a file, an unwritable parent: the pre-launch checks say so in one line).

    Raises:
        ConfigError: another live process holds it; the line names the folder and that process's pid.
    """
    folder = Path(out_dir).expanduser()
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = holder_pid(folder)
        os.close(fd)
        holder = f"pid {pid}" if pid else "a process of another machine"
        raise ConfigError(f"{key} = '{out_dir}' is in use by another run ({holder}): wait for it to end, or choose "
                          f"another --out") from None
    return RunLock(folder, fd, made)


def holder_pid(folder: str | Path) -> int | None:
    """The pid of the process holding ``folder``'s ``flock`` (from ``/proc/locks``), or None: not held
    here (another machine on a shared file system), or not Linux."""
    try:
        inode = os.stat(folder).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF" ("->" marks a waiter)
        fields = line.split()
        if "FLOCK" in fields and "->" not in fields:
            at = fields.index("FLOCK")
            if len(fields) > at + 4 and fields[at + 4].rsplit(":", 1)[-1] == str(inode):
                return int(fields[at + 3])
    return None
