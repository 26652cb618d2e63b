"""Writing files so that a crash never leaves a half-written one under the real name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path.tmp`` then rename it to ``path`` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
