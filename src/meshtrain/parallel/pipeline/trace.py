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
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.nn.parallel import DistributedDataParallel

COMPUTE = ("forward", "backward", "backward-input", "backward-weight")


@dataclass
class StepRecord:
    """One step on one rank: its span and the events in it (dicts with name, cat, stage, ts, dur in ns)."""

    start: int
    end: int = 0
    compute_ns: int = 0
    """Time spent in forward and backward passes."""
    events: list[dict] = field(default_factory=list)
    """Kept for the latest step only (the trace shows one step)."""


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
            self._current.compute_ns = sum(e["dur"] for e in self._current.events if e["cat"] in COMPUTE)
            if self.steps:
                self.steps[-1].events = []
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

    def _compute_outputs(self, *args, module: nn.Module, **kwargs):
        """The forward torch 2.13 runs once, before the first step, to infer the shapes sent between stages.

        torch runs it with gradients on and, unlike every later forward of a stage, outside DDP's ``no_sync``:
        DDP then expects its reducer's hooks in the next backward, which is an early micro-batch's (the
        schedule arms the reducer itself before the last one only). Two backwards in a row (1F1B with
        ``gradient_accumulation_steps <= pp``, GPipe, interleaved) then record every gradient twice and step 2
        stops in DDP's bucket rebuild ("rebuilt parameter indices size ... 18 versus 36"). Run it in
        ``no_sync`` as the schedule runs the others.

        A router that counts its experts' tokens for auxiliary-loss-free balancing (``step_counts``,
        :meth:`meshtrain.models.moe.layer.MoE.update_bias`) would count this forward too, on a later stage's made-up
        inputs: its counts are put back afterwards, so the first step's biases move by the step's real tokens only."""
        routers = [m for m in module.modules() if hasattr(m, "step_counts")]
        counts = [m.step_counts for m in routers]
        try:
            if isinstance(module, DistributedDataParallel):
                with module.no_sync():
                    return super()._compute_outputs(*args, module=module, **kwargs)
            return super()._compute_outputs(*args, module=module, **kwargs)
        finally:
            for m, c in zip(routers, counts):
                m.step_counts = c


def measured_bubble(per_rank: list[list[StepRecord]]) -> list[float]:
    """Idle fraction of each step across the pipeline's ranks (``per_rank[r][step]``)."""
    out = []
    for records in zip(*per_rank):
        span = max(r.end for r in records) - min(r.start for r in records)
        busy = sum(r.compute_ns for r in records) / len(records)
        out.append(1.0 - busy / span if span > 0 else 0.0)
    return out


COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "backward-input": "#dd8452", "backward-weight": "#55a868",
          "send": "#c44e52", "recv": "#8172b3"}


def chrome_trace(per_rank: list[StepRecord]) -> dict:
    """One step of every pipeline rank (``per_rank[r]``) as a Chrome trace (``chrome://tracing``, Perfetto):
    one process per rank, compute on thread 0, waits on sends/receives on thread 1, times in µs
    from the step's first start."""
    origin = min(r.start for r in per_rank)
    events: list[dict] = []
    for rank, record in enumerate(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"pp rank {rank}"}})
        for e in record.events:
            comm = e["cat"] in ("send", "recv")
            name = e["name"] if comm else f"{e['name']} (stage {e['stage']})"
            events.append({"name": name, "cat": e["cat"], "ph": "X", "pid": rank, "tid": int(comm),
                           "ts": (e["ts"] - origin) / 1e3, "dur": e["dur"] / 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_timeline(per_rank: list[StepRecord], path, title: str) -> None:
    """Draw one step as a timeline PNG: one row per pipeline rank, compute as coloured bars (labelled with
    the micro-batch), waits on receives as thin bars; the white space is the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(r.start for r in per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(per_rank) + 1.5))
    for rank, record in enumerate(per_rank):
        for e in record.events:
            start, width = (e["ts"] - origin) / 1e6, e["dur"] / 1e6  # ms
            comm = e["cat"] in ("send", "recv")
            y, h = (rank - 0.4, 0.15) if comm else (rank - 0.2, 0.6)
            ax.broken_barh([(start, width)], (y, h), color=COLORS[e["cat"]], edgecolor="white" if not comm else None,
                           linewidth=0.5)
            if not comm and width > 0:
                ax.text(start + width / 2, rank + 0.1, e["name"], ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(per_rank)), [f"pp rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k != "backward-input"],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gather(tracer: PipelineTracer, pp_group: dist.ProcessGroup) -> list[list[StepRecord]] | None:
    """Every pipeline rank's records on pipeline rank 0 (``per_rank[r][step]``); None on the others."""
    out: list | None = [None] * dist.get_world_size(pp_group) if dist.get_rank(pp_group) == 0 else None
    dist.gather_object(tracer.steps, out, group=pp_group, group_dst=0)
    return out
