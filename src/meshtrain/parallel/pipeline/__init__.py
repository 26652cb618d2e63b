"""Pipeline parallelism (``pp``): consecutive layers on consecutive ranks, micro-batches streamed through.

The model is cut into ``pp * virtual_stages`` chunks balanced by cost (:mod:`meshtrain.parallel.pipeline.balance`);
each rank keeps its chunks (the embedding on the first, the final norm, head and loss on the last)
and runs a schedule from ``torch.distributed.pipelining`` over them. Pipeline micro-batches are the
step's ``gradient_accumulation_steps`` micro-batches, so a step's gradient is the same mean as
without a pipeline (the schedules divide it by the number of micro-batches).

Embedding and head: when they sit in different chunks the head gets its own copy of the tied weight
(equal at the start), and after every backward the two gradients are summed across the ranks that
hold them -- Megatron-LM's embedding group -- so both copies stay equal to the single tied weight of
one process. The gradient norm counts that weight once.

Each schedule's rules (torch-free: what config validation and the planner check) are :mod:`meshtrain.rules.pipeline`.
Modules:
``balance.py`` (the cut into chunks balanced by cost, torch-free: the launcher prints it), ``split.py`` (:func:`split_model`: this rank's chunks; :func:`embedding_group`),
``schedule.py`` (:data:`SCHEDULES`, with their bubbles, and :class:`Pipeline`, which runs this rank's
stages), ``naive.py`` (the naive schedule), ``trace.py`` (what each rank did when: Chrome trace,
timeline, measured bubble).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SCHEDULES", "Pipeline", "embedding_group", "split_model"]
_HOMES = {"SCHEDULES": "schedule", "Pipeline": "schedule", "embedding_group": "split", "split_model": "split"}


def __getattr__(name: str) -> Any:
    """:data:`__all__`'s names, imported on first use: the package stays torch-free, so that its split
    (``balance.py``) can be read before torch loads (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
