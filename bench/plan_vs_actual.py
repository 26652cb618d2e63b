"""Planner vs trainer on this machine: predicted and measured time per step and peak memory per rank
for layouts of ``configs/shakespeare_char.toml`` (dp 1/2, zero_stage 0/2/3, micro batch and
accumulation splits, widths, fp32 (``train.dtype`` pinned: its default ``auto`` is bf16 on a CPU with
bf16 matmul) and bf16, tp 2 with and without sequence parallelism, sp 2 Ulysses and ring,
pp 2 with every pipeline schedule).

    python bench/plan_vs_actual.py [--steps 40] [--repeats 1] [--calibrate] [--match pp2]   # ~10 min per round

Each run waits until the machine is idle (under 10% of the cores busy over 2 s) so that other work
does not slow the measurement.

Each layout is one real ``meshtrain train`` command line; after the ranks finish, the launcher compares
the trainer's ``OUT/summary.json`` with the planner and writes ``OUT/plan_vs_actual.json`` (prediction
from the profile of ``meshtrain plan --calibrate``, measured median step time excluding the first
steps, peak RSS of the busiest rank). ``--calibrate``
(re)measures the machine into the default profile at the start of every round, so that each round's
predictions come from a calibration taken minutes before its runs; the table gives, per layout, the
median prediction and the median measurement over the rounds. Writes ``bench/results/plan_vs_actual.md``
and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

from meshtrain.planner.calibrate import busy_fraction  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
LAYOUTS = [  # (name, nproc, overrides)
    ("dp1 z0 mbs12", 1, {}),
    ("dp2 z0 mbs12", 2, {}),
    ("dp2 z2 mbs12", 2, {"parallel.zero_stage": 2}),
    ("dp2 z3 mbs12", 2, {"parallel.zero_stage": 3}),
    ("dp2 z0 mbs6 ga2", 2, {"batch.micro_batch_size": 6, "batch.gradient_accumulation_steps": 2}),
    ("dp2 z3 mbs4 ga3", 2, {"parallel.zero_stage": 3, "batch.micro_batch_size": 4,
                            "batch.gradient_accumulation_steps": 3}),
    ("dp2 z0 C256", 2, {"model.n_embd": 256}),
    ("dp1 C256 mbs8 ga2", 1, {"model.n_embd": 256, "batch.micro_batch_size": 8, "batch.gradient_accumulation_steps": 2}),
    ("dp2 z2 C384 T128 mbs8", 2, {"parallel.zero_stage": 2, "model.n_embd": 384, "model.n_head": 6,
                                  "model.block_size": 128, "batch.micro_batch_size": 8}),
    ("dp1 bf16", 1, {"train.dtype": "bfloat16"}),
    ("dp2 z0 bf16", 2, {"train.dtype": "bfloat16"}),
    ("tp2 mbs12", 2, {"parallel.tp": 2}),
    ("tp2+SP mbs12", 2, {"parallel.tp": 2, "parallel.tp_sequence_parallel": "true"}),
    ("tp2 C256", 2, {"parallel.tp": 2, "model.n_embd": 256}),
    ("sp2 ulysses mbs12", 2, {"parallel.sp": 2}),
    ("sp2 ring mbs12", 2, {"parallel.sp": 2, "parallel.sp_mode": "ring"}),
    ("sp2 ulysses T256 mbs4", 2, {"parallel.sp": 2, "model.block_size": 256, "batch.micro_batch_size": 4}),
    ("sp2 ring T256 mbs4", 2, {"parallel.sp": 2, "parallel.sp_mode": "ring", "model.block_size": 256,
                               "batch.micro_batch_size": 4}),
    *[(f"pp2 {name} mbs6 ga4", 2, {"parallel.pp": 2, "parallel.pp_schedule": sched, "parallel.virtual_stages": v,
                                   "batch.micro_batch_size": 6, "batch.gradient_accumulation_steps": 4})
      for name, sched, v in (("naive", "naive", 1), ("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
                             ("interleaved v2", "interleaved-1f1b", 2), ("zero-bubble v2", "zero-bubble", 2),
                             ("zbv", "zbv", 2))],
    ("pp2 1f1b mbs3 ga8", 2, {"parallel.pp": 2, "batch.micro_batch_size": 3, "batch.gradient_accumulation_steps": 8}),
    ("pp2 1f1b C256 mbs6 ga4", 2, {"parallel.pp": 2, "model.n_embd": 256, "batch.micro_batch_size": 6,
                                   "batch.gradient_accumulation_steps": 4}),
]


def wait_for_idle(limit_s: float = 900.0) -> float:
    """Wait (up to ``limit_s``) until under 10% of the cores are busy: other work on the machine would
    slow the measured run and not the prediction. Returns the busy fraction when starting."""
    start = time.monotonic()
    busy = busy_fraction()
    while busy > 0.10 and time.monotonic() - start < limit_s:
        time.sleep(5)
        busy = busy_fraction()
    return busy


def run_layout(nproc: int, overrides: dict, steps: int) -> dict:
    """Train one layout (once the machine is idle); return its ``plan_vs_actual.json`` with the busy
    fraction of the cores at the start added under ``"busy_at_start"``."""
    busy = wait_for_idle()
    with tempfile.TemporaryDirectory(prefix="meshtrain-pva-") as tmp:
        out = Path(tmp) / "run"
        args = {"optim.warmup_steps": 5, "train.eval_steps": 2, "train.dtype": "float32", **overrides}
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", str(nproc), "--steps", str(steps), "--out", str(out)]
        cmd += [tok for key, value in args.items() for tok in (f"--{key}", str(value))]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        return {**json.loads((out / "plan_vs_actual.json").read_text()), "busy_at_start": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians are reported")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the machine into the default profile at the start of every round")
    parser.add_argument("--match", default="", help="only the layouts whose name contains this, e.g. pp2")
    args = parser.parse_args()
    LAYOUTS[:] = [layout for layout in LAYOUTS if args.match in layout[0]]
    rounds = []
    for _ in range(args.repeats):
        if args.calibrate:
            wait_for_idle()
            subprocess.run([*meshtrain_command(), "plan", "--calibrate"], check=True, cwd=REPO,
                           stdout=subprocess.DEVNULL)
        rounds.append([run_layout(n, o, args.steps) for _, n, o in LAYOUTS])
    rows, records, time_errors, memory_errors, spreads, predicted_spreads = [], [], [], [], [], []
    for i, (name, nproc, overrides) in enumerate(LAYOUTS):
        runs = [r[i] for r in rounds]
        predicted = runs[0]["predicted"]
        guesses = [r["predicted"]["step_time_s"] for r in runs]
        predicted_step = statistics.median(guesses)
        predicted_peak = statistics.median(r["predicted"]["peak_memory_bytes"] for r in runs)
        predicted_spreads.append(max(guesses) / min(guesses))
        step = statistics.median(r["measured"]["step_time_s"] for r in runs)
        spreads.append([r["measured"]["step_time_s"] for r in runs])
        peak = statistics.median(r["measured"]["peak_memory_bytes"] for r in runs)
        t_err = (predicted_step - step) / step
        m_err = (predicted_peak - peak) / peak
        time_errors.append(t_err)
        memory_errors.append(m_err)
        records.append({"name": name, "nproc": nproc, "overrides": overrides, "runs": runs})
        rows.append([name, predicted.get("threads_per_rank", "?"), f"{predicted_step * 1e3:.1f}",
                     f"{step * 1e3:.1f}", f"{t_err:+.1%}", f"{predicted_peak / 2**20:.0f}",
                     f"{peak / 2**20:.0f}", f"{m_err:+.1%}"])
    summary = {kind: {"median_abs_error": statistics.median(abs(e) for e in errs),
                      "max_abs_error": max(abs(e) for e in errs)}
               for kind, errs in (("step_time_s", time_errors), ("peak_memory_bytes", memory_errors))}
    busy = [r[i]["busy_at_start"] for r in rounds for i in range(len(LAYOUTS))]
    notes = [f"{len(LAYOUTS)} layouts of {CONFIG}, {args.steps} steps each, {args.repeats} round(s)"
             f"{', each after a fresh calibration' if args.calibrate else ''}; predicted and measured = medians over "
             "the rounds; measured step "
             "time = median seconds per optimizer step without the first 3 steps; peak = max over ranks of ru_maxrss.",
             f"step time: median |error| {summary['step_time_s']['median_abs_error']:.1%}, "
             f"max {summary['step_time_s']['max_abs_error']:.1%}",
             f"peak memory: median |error| {summary['peak_memory_bytes']['median_abs_error']:.1%}, "
             f"max {summary['peak_memory_bytes']['max_abs_error']:.1%}",
             f"profile: {rounds[0][0]['predicted']['profile']}; cores busy at the runs' start: "
             f"{min(busy):.0%} to {max(busy):.0%}",
             "spread between rounds (max/min measured step time of a layout): "
             + ", ".join(f"{max(t) / min(t):.2f}" for t in spreads),
             "spread between calibrations (max/min predicted step time of a layout): "
             + ", ".join(f"{s:.2f}" for s in predicted_spreads)]
    path = write_results("plan_vs_actual", "meshtrain plan vs meshtrain train on this machine",
                         ["layout", "threads/rank", "predicted ms/step", "measured ms/step", "error",
                          "predicted MiB/rank", "measured MiB/rank", "error"], rows, notes,
                         {"layouts": records, "summary": summary})
    print(path.read_text())


if __name__ == "__main__":
    main()
