"""Writing files so that a crash never leaves a half-written one under the real name, and reading back the files
meshtrain wrote only after checking that each is one (:func:`read_checked`)."""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fresh_temp_file(path: Path) -> Path:
    """A new, empty file next to ``path`` under a name no other file has (``.NAME.<random>.tmp``), with the
    permissions a new file gets (0666 less the umask): write it, then ``os.replace`` it onto ``path``. A user's
    own ``NAME.tmp`` is never touched."""
    fd, name = tempfile.mkstemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(name, 0o666 & ~_umask())
    return Path(name)


def fresh_temp_dir(path: Path) -> Path:
    """A new, empty folder next to ``path`` under a name no other file has (``.NAME.<random>.tmp``), with the
    permissions a new folder gets (0777 less the umask): fill it, then ``os.replace`` it onto ``path``."""
    name = tempfile.mkdtemp(dir=Path(path).parent, prefix=f".{Path(path).name}.", suffix=".tmp")
    os.chmod(name, 0o777 & ~_umask())
    return Path(name)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a fresh temporary file next to ``path`` (:func:`fresh_temp_file`), then rename it
    to ``path`` (atomic on POSIX)."""
    path = Path(path)
    tmp = fresh_temp_file(path)
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_writable_dir(folder: str | Path, what: str) -> None:
    """Raise ConfigError (one line naming ``what``) unless ``folder`` is a folder, or can be made as one,
    in which new files can be created. The nearest existing ancestor is probed by making and removing an
    empty temporary folder in it (permissions alone do not tell: root may "write" to /proc).
    """
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} = '{folder}' is a file, not a folder: choose a folder path")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{what} = '{folder}' is under '{ancestor}', which is a file: choose a folder path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshtrain-probe-", dir=ancestor))
    except OSError as e:
        raise ConfigError(f"{what} = '{folder}' cannot be written ({e.strerror} in '{ancestor}'): choose a "
                          f"writable folder") from None


def check_new_file(path: str | Path, what: str) -> Path:
    """Raise ConfigError unless ``path`` names a file that can be written: not a folder, in a writable
    folder (made if missing). Returns it as a Path."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{what} = '{path}' is a folder: give a file name, e.g. {Path(path) / 'plan.png'}")
    check_writable_dir(p.parent if str(p.parent) else Path("."), f"the folder of {what}")
    return p


def unwritten(out: Path, error: BaseException) -> str:
    """The line for an export that could not be written (``error`` from the write: a full disk, a quota)."""
    text = str(error).strip()
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = text.splitlines()[-1] if text else type(error).__name__
    return f"could not write '{out}': {reason}; nothing was written: free space there or choose another --out"


MAX_RECORD_BYTES = 64 * 2**20
"""Most bytes a record meshtrain writes and reads back may hold (a run's plan_vs_actual.json or summary.json, a hardware
profile, a prepared folder's meta.json): each is kilobytes, a prepared meta.json of 100,000 shards ~10 MB. A larger file
is not one of them (a 1 GB file would be read whole before being refused)."""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _open_problem(path: Path, error: OSError) -> str:
    """Why ``open(path)`` failed, as the end of a sentence naming ``path``."""
    from meshtrain.paths import path_problem

    if error.errno == errno.ELOOP:
        return "is a symbolic link that loops (it leads back to itself)"
    if error.errno == errno.EACCES:
        return "cannot be read (permission denied)"
    if error.errno in (errno.ENOENT, errno.ENOTDIR):
        return path_problem(path) or "does not exist"
    return f"cannot be opened ({error.strerror})"


def read_checked(path: str | Path, what: str, fix: str, max_bytes: int = MAX_RECORD_BYTES,
                 missing_ok: bool = False) -> bytes | None:
    """The bytes of ``path`` after checking that it is a file to read: a regular file (a link to one counts; a FIFO,
    a device such as ``/dev/zero``, a folder, a dangling or looping link are not), of at most ``max_bytes``, and
    readable (a file whose mode lets nobody read it is refused for root too, who could read it anyway). The check is
    made on the opened file (``O_NONBLOCK``: opening a FIFO never waits for a writer), so nothing can be swapped in
    between the check and the read. ``missing_ok``: None for a path that does not exist (a dangling link still errs).

    Raises:
        ConfigError: one line, ``{what} '{path}' <what is wrong>: {fix}`` (``fix`` says what to do about it).
    """
    return _checked(Path(path), what, fix, max_bytes, missing_ok, read=True)


def check_readable(path: str | Path, what: str, fix: str, max_bytes: int = MAX_RECORD_BYTES) -> None:
    """:func:`read_checked`'s checks alone, for a file another function then reads and parses (a TOML file
    :func:`meshtrain.config.load.read_toml` reads). Raises ConfigError as it does (a missing file too)."""
    _checked(Path(path), what, fix, max_bytes, missing_ok=False, read=False)


def _checked(path: Path, what: str, fix: str, max_bytes: int, missing_ok: bool, read: bool) -> bytes | None:
    from meshtrain.paths import path_problem

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if missing_ok and e.errno == errno.ENOENT and not path.is_symlink():
            return None
        raise ConfigError(f"{what} '{path}' {_open_problem(path, e)}: {fix}") from None
    data, problem = b"", None
    limit = f"more than any {what} meshtrain writes ({_size(max_bytes)} at most)"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problem = path_problem(path) or "is not a regular file"
        elif st.st_size > max_bytes:
            problem = f"is {_size(st.st_size)}, {limit}"
        elif not st.st_mode & (stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH):
            problem = "cannot be read (permission denied)"
        elif read:
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as f:
                # read(n) allocates n bytes first: ask for the size fstat gave (+1, to see growth), never the bound
                data = f.read(min(st.st_size, max_bytes) + 1)
                if st.st_size < len(data) <= max_bytes:  # it grew after fstat: read on, up to the bound
                    data += f.read(max_bytes + 1 - len(data))
            if len(data) > max_bytes:  # it grew after fstat
                problem = f"is {limit}"
    except OSError as e:
        problem = f"cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    if problem:
        raise ConfigError(f"{what} '{path}' {problem}: {fix}")
    return data


def read_text_checked(path: str | Path, what: str, fix: str, max_bytes: int = MAX_RECORD_BYTES,
                      missing_ok: bool = False) -> str | None:
    """:func:`read_checked`, decoded as UTF-8 (a byte that is not is one line naming its offset)."""
    data = read_checked(path, what, fix, max_bytes, missing_ok)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}): {fix}") from None
