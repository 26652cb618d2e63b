"""The parallel strategies, one module or folder each (``tensor``, ``sequence/``, ``pipeline/``, ``data_parallel``,
``hierarchical``, ``local_sgd``, ``async_ps``, ``recompute``), what they share (``reduce``, ``rng``, ``model``),
and how they compose: :func:`parallelize` (:mod:`meshtrain.parallel.compose`), the one function the trainer calls.

Importing this package imports no torch, so that the torch-free rules of a strategy (the pipeline's schedule
rules and cost-balanced split, :mod:`meshtrain.rules.pipeline` and :mod:`.pipeline.balance`) can be
read by config validation and the planner; :func:`parallelize` and the other names of :mod:`.compose` load on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    """A name of :mod:`meshtrain.parallel.compose` (PEP 562), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    compose = importlib.import_module(f"{__name__}.compose")
    try:
        return getattr(compose, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
