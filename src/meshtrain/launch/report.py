"""After a run: the planner's prediction next to what the ranks measured (``OUT/summary.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshtrain.config import Config, ConfigError


def report_plan_vs_actual(cfg: Config, threads: int) -> None:
    """Print and save the planner's prediction next to what the run measured (``OUT/summary.json``).
    No summary here (global rank 0 ran on another node) or no measured step: nothing to compare. The
    planner failing never fails a finished run: it costs one warning line."""
    from meshtrain.metrics import SUMMARY_FILE

    path = Path(cfg.train.out_dir) / SUMMARY_FILE
    if not path.is_file():
        return
    try:
        summary = json.loads(path.read_text())
        if summary.get("step_time_s") is None:
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
