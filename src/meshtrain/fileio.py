"""Writing files so that a crash never leaves a half-written one under the real name."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError


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
