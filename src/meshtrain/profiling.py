"""``train.profile_steps = [a, b]``: every rank records a ``torch.profiler`` trace of steps a..b.

The trace (CPU ops, CUDA kernels on a GPU, memory allocations) goes to ``OUT/profile/rank{r}.json`` in the
Chrome trace format (open it in chrome://tracing or https://ui.perfetto.dev); each step is a span named
``step N``. On CUDA the allocator's history over the same steps is also dumped to
``OUT/profile/rank{r}_memory.pickle`` (drag it onto https://pytorch.org/memory_viz).
"""

from __future__ import annotations

from pathlib import Path

import torch

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept for the CUDA memory snapshot (torch's own example uses 100k: ~tens of MB)."""


class StepProfiler:
    """Calls around each step of the loop; a no-op outside ``steps`` (``[first, last]``, or empty = off)."""

    def __init__(self, steps: list[int], out_dir: Path, rank: int, device_type: str) -> None:
        self.first, self.last = steps if steps else (0, -1)
        self.folder = Path(out_dir) / PROFILE_DIR
        self.rank, self.cuda = rank, device_type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.span: torch.profiler.record_function | None = None

    def begin(self, step: int) -> None:
        """Before step ``step``: start recording at the first profiled step (or the first one run after a
        resume inside the range), and open the step's span."""
        if not self.first <= step <= self.last:
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self.prof = torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True)
            self.prof.start()
        self.span = torch.profiler.record_function(f"step {step}")
        self.span.__enter__()

    def end(self, step: int) -> None:
        """After step ``step``: close its span; after the last profiled step, write the files."""
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Stop recording and write what was recorded (also when the run ends inside the range)."""
        if self.prof is None:
            return
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        self.prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.folder / f"rank{self.rank}.json"))
        self.prof = None
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
