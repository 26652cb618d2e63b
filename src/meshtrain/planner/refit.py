"""``python -m meshtrain.planner.refit``: refit the shipped stacks table (``planner/data/stacks.toml``) on the shipped
published runs (:func:`meshtrain.planner.validate.fit_stacks`) and, in a clone with benchmark results, the CPU range
of ``bench/results/plan_vs_actual.json`` (:func:`cpu_spread`). A test checks the shipped table is this fit."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from meshtrain.config.load import read_toml
from meshtrain.planner.stack import STACKS_FILE, load_stacks, write_stacks
from meshtrain.planner.validate import PUBLISHED_RUNS, fit_stacks


def cpu_spread(path: Path) -> dict[str, Any]:
    """The signed step-time errors of ``bench/plan_vs_actual.py``'s results (``path``): each layout's median
    prediction against its median measurement, as its table reports them; ``low``/``high`` and how many layouts."""
    import json
    import statistics

    errors = []
    from meshtrain.fileio import read_text_checked

    text = read_text_checked(path, "benchmark results", "run python bench/plan_vs_actual.py again")
    for layout in json.loads(text)["layouts"]:
        runs = [r for r in layout["runs"] if "step_time_s" in r.get("measured", {})]
        if runs:
            predicted = statistics.median(r["predicted"]["step_time_s"] for r in runs)
            errors.append(predicted / statistics.median(r["measured"]["step_time_s"] for r in runs) - 1)
    return {"low": min(errors), "high": max(errors), "runs": len(errors)}


def main() -> int:
    """Refit the shipped stacks table on the shipped published runs and write it."""
    fit = fit_stacks(read_toml(PUBLISHED_RUNS, "validation file")["run"])
    bench = Path(__file__).resolve().parents[3] / "bench" / "results" / "plan_vs_actual.json"
    if bench.is_file():
        fit["cpu"] = cpu_spread(bench)
    else:
        fit["cpu"] = load_stacks().get("cpu", {"low": math.nan, "high": math.nan})
    write_stacks(fit)
    print(f"wrote {STACKS_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
