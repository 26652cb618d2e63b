"""What is wrong with a path a command was given to read, in words (a leaf module: it imports nothing of
meshtrain, so the config, the Hugging Face reader and the checkpoint code share it without an import cycle)."""

from __future__ import annotations

import os
from pathlib import Path


def path_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file to read (a link to one counts), as the end of a sentence naming it, or
    None: it does not exist, is a dangling link, a folder, a FIFO (a read would wait forever for a writer) or a
    device (``/dev/zero`` never ends)."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_symlink() and not path.exists():
        return f"is a symbolic link to '{os.readlink(path)}', which does not exist"
    if not path.exists():
        return "does not exist"
    kind = "a folder" if path.is_dir() else "a FIFO" if path.is_fifo() else "a device" if (
        path.is_char_device() or path.is_block_device()) else "not a regular file"
    return f"is {kind}, not a file"
