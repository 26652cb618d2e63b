"""After a run: the planner's prediction next to what the ranks measured (``OUT/summary.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError


def report_plan_vs_actual(cfg: Config, threads: int) -> None:
    """Print and save the planner's prediction next to what the run measured (``OUT/summary.json``).
    No summary here (global rank 0 ran on another node) or no measured step: nothing to compare. The
    planner failing never fails a finished run: it costs one warning line."""
    from meshtrain.metrics import SUMMARY_FILE, TIMING_WARMUP_STEPS

    from meshtrain.fileio import read_text_checked

    path = Path(cfg.train.out_dir) / SUMMARY_FILE
    if not path.is_file():
        return
    try:
        summary = json.loads(read_text_checked(path, "run summary", "the run's ranks write it; train again"))
        if summary.get("step_time_s") is None:
            print(f"meshtrain train: no step time and no plan vs actual: the first {TIMING_WARMUP_STEPS} steps of a "
                  f"run are warm-up and not timed, and this one ran no step past them (train.steps = "
                  f"{cfg.train.steps}); run more steps to measure", file=sys.stderr)
            return
        pipeline = summary.get("pipeline")
        if pipeline:
            print(f"pipeline bubble: {pipeline['bubble_measured']:.1%} measured, {pipeline['bubble_theory']:.1%} in "
                  f"theory; timeline {path.parent / 'pipeline_schedule.png'}, trace "
                  f"{path.parent / 'pipeline_trace.json'}", file=sys.stderr)
        from meshtrain.planner.actual import report_run
        report_run(cfg, summary, threads)
    except (ConfigError, OSError, KeyError, TypeError, ValueError) as e:
        print(f"meshtrain train: warning: no plan vs actual: {e}", file=sys.stderr)


def describe_run_folder(out_dir: Path) -> str:
    """One line naming the run folder and what is in it: its files and folders, the committed checkpoints
    (:func:`meshtrain.checkpoint.store.list_checkpoints`) counted with the newest named."""
    from meshtrain.checkpoint.store import list_checkpoints

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return f"run folder {out_dir}: not written"
    parts = []
    for entry in sorted(out_dir.iterdir(), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and entry.name == "checkpoints":
            steps = [p.name for p in list_checkpoints(out_dir)]
            parts.append(f"checkpoints/ ({len(steps)}, newest {steps[-1]})" if steps else "checkpoints/ (none)")
        else:
            parts.append(entry.name + ("/" if entry.is_dir() else ""))
    return f"run folder {out_dir}: " + ", ".join(parts)
