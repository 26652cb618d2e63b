"""Trainer throughput (tokens/s) of several layouts side by side: dp=1 vs dp=2 DDP vs dp=2 FSDP2, fp32 vs bf16.

Each layout is one real command line,
``meshtrain train configs/shakespeare_char.toml --nproc N --steps S --out TMP --parallel.zero_stage Z
--train.dtype D``, and its numbers come from ``TMP/metrics.jsonl``. Layouts run one at a time, in
interleaved rounds (all layouts, then all again), so slow drift of the machine hits every row alike.

    python bench/bench_train.py [--steps 60] [--repeats 3]      # ~4 minutes on 2 CPU cores

Writes ``bench/results/train.md`` and ``train.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
SKIP_STEPS = 5  # first steps of each run left out of the medians (allocator, thread pools, autograd warm-up)


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    zero_stage: int
    dtype: str


LAYOUTS = [
    Layout("dp=1, fp32", 1, 0, "float32"),
    Layout("dp=2 DDP, fp32", 2, 0, "float32"),
    Layout("dp=2 FSDP2 (zero 3), fp32", 2, 3, "float32"),
    Layout("dp=1, bf16", 1, 0, "bfloat16"),
    Layout("dp=2 DDP, bf16", 2, 0, "bfloat16"),
    Layout("dp=2 FSDP2 (zero 3), bf16", 2, 3, "bfloat16"),
]


def threads_per_rank(nproc: int) -> int:
    """Every layout uses all cores: one rank with all of them, or the cores split across ranks."""
    return max(1, (os.cpu_count() or 1) // nproc)


def global_batch_size(nproc: int) -> int:
    """Samples per step of the config on ``nproc`` ranks (dp fills the ranks)."""
    from meshtrain.batch_math import plan_batch
    from meshtrain.config.load import load_config

    b = load_config(REPO / CONFIG).batch
    return plan_batch(nproc, b.micro_batch_size, b.gradient_accumulation_steps).global_batch_size


def run_layout(layout: Layout, steps: int, out: Path) -> dict:
    """Train ``layout`` for ``steps`` steps into ``out``; return its metrics records, or an error line."""
    argv = [*meshtrain_command(), "train", CONFIG, "--nproc", str(layout.nproc), "--steps", str(steps),
            "--out", str(out), "--parallel.zero_stage", str(layout.zero_stage), "--train.dtype", layout.dtype,
            "--train.log_interval", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_rank(layout.nproc))}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()] or ["(no output)"]
        raised = [line for line in lines if "Error: " in line and not line.startswith("meshtrain")]
        return {"error": f"exit {proc.returncode}: {(raised or lines)[-1]}", "stderr_tail": lines[-40:],
                "wall_s": wall}
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"train": [r for r in records if "tokens_per_s" in r], "eval": [r for r in records if "val_loss" in r],
            "wall_s": wall}


def summarize(layout: Layout, runs: list[dict], steps: int) -> dict:
    """Median tokens/s of each round's timed steps, the best round, and the loss each round ended at."""
    ok = [r for r in runs if "error" not in r]
    summary = {"layout": layout.name, "nproc": layout.nproc, "zero_stage": layout.zero_stage,
               "dtype": layout.dtype, "threads_per_rank": threads_per_rank(layout.nproc),
               "global_batch_size": global_batch_size(layout.nproc),
               "errors": [r["error"] for r in runs if "error" in r], "wall_s": [r["wall_s"] for r in runs],
               "failed_stderr_tails": [r["stderr_tail"] for r in runs if "error" in r]}
    if not ok:
        return summary
    timed = [[rec for rec in r["train"] if rec["step"] > SKIP_STEPS] for r in ok]
    summary["tokens_per_s_by_round"] = [statistics.median(rec["tokens_per_s"] for rec in run) for run in timed]
    best = max(range(len(timed)), key=lambda i: summary["tokens_per_s_by_round"][i])
    summary["tokens_per_s"] = summary["tokens_per_s_by_round"][best]  # other work only ever slows a round down
    summary["step_time_s"] = statistics.median(rec["step_time_s"] for rec in timed[best])
    last = [next(rec for rec in r["train"] if rec["step"] == steps) for r in ok]
    summary["final_loss"] = last[0]["loss"]
    summary["final_loss_spread"] = max(rec["loss"] for rec in last) - min(rec["loss"] for rec in last)
    summary["val_loss"] = ok[0]["eval"][-1]["val_loss"] if ok[0]["eval"] else None
    return summary


def table(summaries: list[dict], steps: int) -> tuple[list[str], list[list]]:
    base = summaries[0].get("tokens_per_s")
    columns = ["layout", "ranks x threads", "global batch", "tokens/s (best round)", f"vs {summaries[0]['layout']}",
               "tokens/s per round", "ms/step", f"loss @ {steps}", f"val loss @ {steps}", "wall s (with start-up)"]
    rows = []
    for s in summaries:
        walls = " / ".join(f"{w:.0f}" for w in s["wall_s"])
        head = [s["layout"], f"{s['nproc']} x {s['threads_per_rank']}", s["global_batch_size"]]
        if "tokens_per_s" not in s:
            rows.append(head + [f"failed: {s['errors'][0]}", "", "", "", "", "", walls])
            continue
        ratio = f"{s['tokens_per_s'] / base:.2f}x" if base else "n/a"
        rounds = " / ".join(f"{t:,.0f}" for t in s["tokens_per_s_by_round"])
        if s["errors"]:
            rounds += f" ({len(s['errors'])} round(s) failed: {s['errors'][0]})"
        val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
        rows.append(head + [f"{s['tokens_per_s']:,.0f}", ratio, rounds, f"{1000 * s['step_time_s']:.1f}",
                            f"{s['final_loss']:.4f}", val, walls])
    return columns, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over all layouts (default 3)")
    args = parser.parse_args()
    if args.steps <= SKIP_STEPS:
        parser.error(f"--steps must be > {SKIP_STEPS}")
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {layout.name: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        for round_ in range(args.repeats):
            for i, layout in enumerate(LAYOUTS):
                result = run_layout(layout, args.steps, Path(tmp) / f"r{round_}-{i}")
                runs[layout.name].append(result)
                status = result.get("error") or f"{result['wall_s']:.0f} s"
                print(f"round {round_ + 1}/{args.repeats}  {layout.name:<28} {status}", flush=True)
    summaries = [summarize(layout, runs[layout.name], args.steps) for layout in LAYOUTS]
    columns, rows = table(summaries, args.steps)
    notes = [
        f"Each row: `meshtrain train {CONFIG} --nproc N --steps {args.steps} --parallel.zero_stage Z "
        f"--train.dtype D --train.log_interval 1`, {args.repeats} interleaved "
        "rounds. tokens/s is `tokens_per_s` of metrics.jsonl (global tokens of one step / that step's time), "
        f"median over steps {SKIP_STEPS + 1}..{args.steps} of a round; the headline and the ratio use the best "
        "round (as timeit does: other work only slows a round down), ms/step is that round's median. Start-up, "
        "eval and checkpoint time are outside it but inside the wall time.",
        "OMP_NUM_THREADS = CPUs / ranks, so every layout uses all cores: dp=1 runs intra-op threads, "
        "dp=2 runs one process per core.",
        "dp fills the ranks, so dp=2 has twice the global batch of dp=1 (same micro_batch_size per rank); "
        "losses compare only between rows with the same dp. DDP and FSDP2 rows of one dtype run the same "
        "math and should agree closely.",
        f"1-minute load average before the run: {load_before:.2f} on {os.cpu_count()} CPUs; other work on the "
        "machine shows up as spread between rounds. Ratios hold for this machine and this run only; the numbers "
        "are never asserted in tests.",
    ]
    md = write_results("train", f"Trainer throughput by layout ({CONFIG})",
                       columns, rows, notes, {"steps": args.steps, "repeats": args.repeats, "load_before": load_before,
                        "summaries": summaries})
    print(md.read_text())
    return 0 if all(not s["errors"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
