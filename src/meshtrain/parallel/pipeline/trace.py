"""What every pipeline rank did during a step, and when: for the Chrome trace, the timeline and the bubble.

:class:`TimedStage` is torch's ``PipelineStage`` that records each forward, backward (or its
input-gradient and weight-gradient halves) it runs. :class:`PipelineTracer` also records every wait
on a point-to-point send or receive: during a step it wraps ``torch.distributed.pipelining``'s
``_batch_p2p``/``_wait_batch_p2p`` (the two functions every schedule issues and completes its sends
and receives with) and restores them afterwards. Times are wall-clock nanoseconds
(``time.time_ns``), comparable between the processes of one machine.

Measured bubble of a step: ``1 - mean over ranks(compute time) / (last end - first start)``, the idle
fraction of the pipeline's ranks (the quantity the theory ``(p-1)/(m+p-1)`` predicts).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

COMPUTE = ("forward", "backward", "backward-input", "backward-weight")


@dataclass
class StepRecord:
    """One step on one rank: its span and the events in it (dicts with name, cat, stage, ts, dur in ns)."""

    start: int
    end: int = 0
    events: list[dict] = field(default_factory=list)

    @property
    def compute_ns(self) -> int:
        return sum(e["dur"] for e in self.events if e["cat"] in COMPUTE)


class PipelineTracer:
    """Records the events of each step (:meth:`step`); :meth:`event` is called by the stages."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None

    def event(self, name: str, cat: str, stage: int, start: int, end: int) -> None:
        if self._current is not None:
            self._current.events.append({"name": name, "cat": cat, "stage": stage, "ts": start, "dur": end - start})

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Record one schedule step (compute from the stages, p2p waits from the wrapped torch helpers)."""
        self._current = StepRecord(time.time_ns())
        kinds: dict[int, str] = {}
        batch_p2p, wait_batch_p2p = torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p

        def traced_batch(ops, desc=None):
            works = batch_p2p(ops, desc)
            kinds[id(works)] = desc or ("send" if all(op.op is dist.isend for op in ops) else "recv")
            return works

        def traced_wait(works):
            start = time.time_ns()
            wait_batch_p2p(works)
            kind = kinds.pop(id(works), "p2p")
            self.event(kind, "send" if "send" in kind and "recv" not in kind else "recv", -1, start, time.time_ns())

        torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p = traced_batch, traced_wait
        try:
            yield
        finally:
            torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p
            self._current.end = time.time_ns()
            self.steps.append(self._current)
            self._current = None


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that reports each forward and backward it runs to a :class:`PipelineTracer`."""

    def __init__(self, submodule, stage_index: int, num_stages: int, device, tracer: PipelineTracer,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(submodule, stage_index, num_stages, device, group=group)
        self.tracer = tracer

    def _timed(self, name: str, cat: str, fn, *args, **kwargs):
        start = time.time_ns()
        out = fn(*args, **kwargs)
        self.tracer.event(name, cat, self.stage_index, start, time.time_ns())
        return out

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        return self._timed(f"F{fwd_chunk_id}", "forward", super().forward_one_chunk, fwd_chunk_id, args, kwargs,
                           save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        name, cat = (f"B{bwd_chunk_id}", "backward") if full_backward else (f"I{bwd_chunk_id}", "backward-input")
        return self._timed(name, cat, super().backward_one_chunk, bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return self._timed(f"W{bwd_chunk_id}", "backward-weight", super().backward_weight_one_chunk, bwd_chunk_id,
                           last_backward)


def measured_bubble(per_rank: list[list[StepRecord]]) -> list[float]:
    """Idle fraction of each step across the pipeline's ranks (``per_rank[r][step]``)."""
    out = []
    for records in zip(*per_rank):
        span = max(r.end for r in records) - min(r.start for r in records)
        busy = sum(r.compute_ns for r in records) / len(records)
        out.append(1.0 - busy / span if span > 0 else 0.0)
    return out
