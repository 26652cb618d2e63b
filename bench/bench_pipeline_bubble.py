"""Pipeline bubble against the number of micro-batches: measured by the trainer, the theory, the planner.

    python bench/bench_pipeline_bubble.py [--steps 12] [--pp 2 4]      # ~10 min on 2 CPU cores

For pp = 2 and 4, every schedule and micro-batch counts m in {pp, 2pp, 4pp} (where the schedule
allows it), one real ``meshtrain train`` run of an 8-layer ``configs/shakespeare_char.toml`` model
(micro-batch 2). Reported per run:

- measured: the trainer's bubble (``OUT/summary.json`` -> ``pipeline.bubble_measured``: 1 - mean over
  pipeline ranks of their forward/backward time / the step's span, median over the steps after the
  first 3);
- theory: ``meshtrain.rules.pipeline.bubble_fraction`` (equal stage times);
- planner: the share of the planner's predicted pipeline time that a rank spends outside forward and
  backward, as the trainer measures it (``OUT/plan_vs_actual.json``: (bubble + p2p) / (compute + p2p +
  bubble)), from the calibrated CPU profile.

pp = 4 runs 4 ranks on this machine's 2 cores: two ranks share a core, so a rank waiting in the
bubble lends its core to another and the measured bubble differs from a machine with a core (or GPU)
per rank. Writes ``bench/results/pipeline_bubble.md``/``.json`` and ``docs/pipeline_bubble.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

from meshtrain.rules.pipeline import RULES, bubble_fraction, schedule_error  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
SCHEDULES = {"naive": 1, "gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2, "zbv": 2}
LAYERS = 8


def run(pp: int, schedule: str, v: int, m: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshtrain-bubble-") as tmp:
        out = Path(tmp) / "run"
        args = {"parallel.pp": pp, "parallel.pp_schedule": schedule, "parallel.virtual_stages": v,
                "batch.micro_batch_size": 2, "batch.gradient_accumulation_steps": m, "model.n_layer": LAYERS,
                "train.eval_interval": 0, "train.eval_steps": 1, "checkpoint.interval": 0, "optim.warmup_steps": 2}
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", str(pp), "--steps", str(steps), "--out", str(out)]
        cmd += [tok for key, value in args.items() for tok in (f"--{key}", str(value))]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        pipeline = json.loads((out / "summary.json").read_text())["pipeline"]
        t = json.loads((out / "plan_vs_actual.json").read_text())["predicted"]["time_breakdown_s"]
        if pp == 4 and schedule == "1f1b" and m == 8:
            shutil.copy(out / "pipeline_schedule.png", REPO / "docs" / "pipeline_1f1b_pp4.png")
        idle = t["bubble"] + t["pp_comm"]  # what a rank spends outside forward/backward, as the trainer measures it
        return {**pipeline, "planner": idle / (t["compute"] + idle), "predicted_breakdown_s": t}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows, records = [], []
    for pp in args.pp:
        for schedule, v in SCHEDULES.items():
            for m in (pp, 2 * pp, 4 * pp):
                if schedule_error(schedule, pp, v, m, LAYERS) or (schedule == "naive" and m > pp):
                    continue
                r = run(pp, schedule, v, m, args.steps)
                records.append(r)
                rows.append([pp, schedule, v, m, f"{r['bubble_measured']:.1%}", f"{r['bubble_theory']:.1%}",
                             f"{r['planner']:.1%}"])
                print(rows[-1], flush=True)
    notes = [f"{LAYERS}-layer {CONFIG} model, micro-batch 2, {args.steps} steps per run; measured = median over "
             "the steps after the first 3 of 1 - mean(rank compute) / step span",
             "theory = meshtrain.rules.pipeline.bubble_fraction (equal stage times, no communication; zero-bubble at "
             "F = I = W); planner = (bubble + p2p) / (compute + p2p + bubble) of the calibrated CPU prediction",
             "pp = 4 runs 4 ranks on 2 cores: ranks share cores, so waiting ranks lend theirs and compute "
             "stretches; compare schedules within one pp",
             f"placements: {', '.join(f'{s} {RULES[s].placement}' for s in SCHEDULES)}; "
             f"bubble_fraction(1f1b, 4, 8) = {bubble_fraction('1f1b', 4, 8):.3f}"]
    path = write_results("pipeline_bubble", "Pipeline bubble vs micro-batches: measured, theory, planner",
                         ["pp", "schedule", "chunks/rank", "micro-batches", "measured", "theory", "planner"],
                         rows, notes, {"runs": records})
    text = path.read_text()
    (REPO / "docs" / "pipeline_bubble.md").write_text(
        text.replace("# Pipeline bubble", "# Pipeline bubble (copied from bench/results/pipeline_bubble.md)", 1)
        + "\nRegenerate: `python bench/bench_pipeline_bubble.py`. How the schedules work: [pipeline.md](pipeline.md).\n")
    print(text)


if __name__ == "__main__":
    main()
