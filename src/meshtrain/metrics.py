"""Run metrics from one rank: a live rich progress bar, ``OUT/metrics.jsonl`` and a loss-curve PNG.

``metrics.jsonl`` holds one JSON object per line: train records ``{"step", "loss", "lr",
"tokens_per_s", "grad_norm", "step_time_s", "peak_memory_bytes"}`` every ``log_interval`` steps, and eval
records ``{"step", "val_loss"}``. On resume into the same folder, records after the resumed step are dropped
(the file is rewritten atomically), so the file always describes one consistent run.

With ``train.tensorboard`` the same records also go to ``OUT/tb/`` as TensorBoard scalars, one tag per
numeric key (:class:`TensorBoardSink`); metrics.jsonl stays the source of truth.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

TIMING_WARMUP_STEPS = 3
"""Steps left out of the median step time (allocator and autotuning warm-up); the summary has no step time
when a run goes no further."""

logger = logging.getLogger("meshtrain")

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TB_DIR = "tb"
"""``OUT/tb/``: TensorBoard event files of rank 0 (``train.tensorboard``)."""
"""Written by global rank 0 at the end of a run: val loss, median step time, peak memory, the layout."""
REFRESH_PER_S = 2
"""Progress-bar redraws per second. rich's default of 10 costs its drawing thread ~24 ms of CPU per second
on a terminal (2.4% of a core that the training threads share); 2 costs ~8 ms."""


MAX_METRICS_BYTES = 512 * 2**20
"""Most bytes a metrics.jsonl may hold: a record is ~250 bytes, so this is ~2 M logged steps (a larger file is not
one meshtrain wrote: it would be read whole before being refused)."""


def read_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """The records of ``OUT/metrics.jsonl`` (none without the file), checked as a file first
    (:func:`meshtrain.fileio.read_checked`).

    Raises:
        ConfigError: it is not a regular file of at most :data:`MAX_METRICS_BYTES`, not UTF-8, or a line is not a
            JSON object with a ``step`` (one line naming the file and the line).
    """
    from meshtrain.errors import ConfigError
    from meshtrain.fileio import read_text_checked

    path = Path(out_dir) / METRICS_FILE
    fix = "move it away (or delete it) to start the run's metrics afresh"
    text = read_text_checked(path, "metrics file", fix, MAX_METRICS_BYTES, missing_ok=True)
    records = []
    for number, line in enumerate((text or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(f"metrics file '{path}': line {number} is not a record of meshtrain's (a JSON object "
                              f"with a step): {fix}")
        records.append(record)
    return records


class TensorBoardSink:
    """Every numeric field of a metrics record (but ``step`` and ``elapsed_s``) as a TensorBoard scalar at the
    record's step, tag = the key (``torch.utils.tensorboard.SummaryWriter``, stored as float32). A resumed run
    purges the events after its start step, as metrics.jsonl drops its records."""

    FLUSH_S = 10
    """Seconds between the writer's flushes to disk, so a live run shows up in TensorBoard within them."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step else None,
                                    flush_secs=self.FLUSH_S)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in ("step", "elapsed_s") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


FILE_WIDTH = 160
"""Columns of the progress bar and messages when stderr is not a terminal (a log file, a pipe): wide enough that
the bar's loss, lr, tokens/s, elapsed time and ETA are never cut off."""


class MetricsLog:
    """Writes metrics and shows progress; every method is a no-op unless ``enabled`` (rank 0). With
    ``tensorboard``, every record also goes to ``OUT/tb/`` (:class:`TensorBoardSink`)."""

    def __init__(self, out_dir: Path, enabled: bool, start_step: int, total_steps: int,
                 tensorboard: bool = False) -> None:
        self.out_dir, self.enabled = Path(out_dir), enabled
        self.start_time = time.perf_counter()
        self.console = Console(stderr=True)
        if not self.console.is_terminal:  # a file or pipe: rich would clip every line at 80 columns
            self.console = Console(stderr=True, width=FILE_WIDTH)
        self.progress: Progress | None = None
        self.tb: TensorBoardSink | None = None
        if not enabled:
            return
        if tensorboard:
            self.tb = TensorBoardSink(self.out_dir / TB_DIR, start_step)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.out_dir) if r["step"] <= start_step]
        tmp = self.out_dir / (METRICS_FILE + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.out_dir / METRICS_FILE)
        self.file = open(self.out_dir / METRICS_FILE, "a")
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                 TimeRemainingColumn(), console=self.console, transient=False,
                                 refresh_per_second=REFRESH_PER_S)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` with ``elapsed_s``: wall seconds since this log opened (this run's start)."""
        if self.enabled:
            record = {**record, "elapsed_s": round(time.perf_counter() - self.start_time, 3)}
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            if self.tb is not None:
                self.tb.write(record)

    def step(self, step: int, record: dict[str, Any] | None) -> None:
        """Advance the bar to ``step``; write ``record`` (a train record) if given."""
        if not self.enabled:
            return
        if record is not None:
            self.write(record)
            self.progress.update(self.task, stats=f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                                                  f"{record['tokens_per_s']:,.0f} tok/s")
        self.progress.update(self.task, completed=step)

    def eval(self, step: int, val_loss: float, **extra: float) -> None:
        """Write an eval record ``{"step", "val_loss", **extra}`` (DPO adds its validation rewards)."""
        if self.enabled:
            self.write({"step": step, "val_loss": val_loss, **extra})
            self.progress.console.print(f"step {step}: val_loss {val_loss:.4f}")

    def info(self, text: str) -> None:
        if self.enabled:
            (self.progress.console if self.progress else self.console).print(text)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def plot_loss(out_dir: Path) -> Path | None:
    """Write ``OUT/loss.png`` (train loss and val loss against step) from metrics.jsonl; None if no records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(out_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(out_dir) / "loss.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory of this rank in bytes: the CUDA allocator's peak on ``"cuda"``, the peak resident set
    size (``ru_maxrss``, KiB on Linux) elsewhere."""
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    """Global rank 0 at the end of a run: ``OUT/loss.png`` from metrics.jsonl and ``OUT/summary.json``
    (written atomically), which ``meshtrain train`` then compares with the planner."""
    from meshtrain.fileio import write_json_atomic

    plot_loss(out_dir)
    write_json_atomic(Path(out_dir) / SUMMARY_FILE, summary)
