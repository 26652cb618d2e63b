"""The fitted stacks table, ``planner/data/stacks.toml``, and its reader: torch-free and importing no planner model,
so both the memory model (its ``[memory]`` error range) and :mod:`meshtrain.planner.stack` (speed factors) read it.
``python -m meshtrain.planner.refit`` writes it (:func:`meshtrain.planner.stack.write_stacks`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

STACKS_FILE = Path(__file__).parent / "data" / "stacks.toml"
"""Fitted speed factors and step-time ranges per stack, and the memory model's error range."""


def load_stacks(path: Path = STACKS_FILE) -> dict[str, Any]:
    """The fitted table: ``{"stack": {name: {factor, low, high, runs, sources}}, "pooled": {...}, "calibrated": {...},
    "memory": {low, high}}``; {} when the file is absent. Raises ``ConfigError`` (one line) when it cannot be read."""
    from meshtrain.fileio import read_text_checked

    text = read_text_checked(path, "stacks table", "reinstall meshtrain (python -m meshtrain.planner.refit writes it)",
                             missing_ok=True)
    return {} if text is None else tomllib.loads(text)
