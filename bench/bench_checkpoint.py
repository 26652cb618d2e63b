"""Blocking vs asynchronous checkpoints (``checkpoint.async_save``): how long training stalls per save.

    python bench/bench_checkpoint.py [--steps 24] [--interval 6] [--repeats 2]   # ~6 min on 2 CPU cores

A GPT big enough that a save costs something (``configs/shakespeare_char.toml`` widened to 8 layers of
512, ~25M parameters: ~300 MB of fp32 weights and AdamW moments per checkpoint) trains one thread per
rank on 1 rank (a core left free for the background writer, as a GPU run leaves its CPU) and on 2 ranks
(DDP; every core trains), three ways each, one real command line each, in interleaved rounds:

- no saves (``checkpoint.interval = 0``: only the final save, after the last timed step);
- blocking saves every ``--interval`` steps;
- asynchronous saves every ``--interval`` steps (``checkpoint.async_save = true``).

Every step is logged (``train.log_interval = 1``), and the gap between two records' ``elapsed_s`` is the
wall time from one step's end to the next, saves included. The stall of a save at step s is the gap after
step s minus the run's median gap over steps with no save before them; the cost per save is the run's
wall time to its last step minus the no-save run's, fastest rounds of each, over its saves (it also
counts the background write slowing the steps it overlaps). Writes ``bench/results/checkpoint.md``/``.json`` and
the section in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, update_benchmarks_doc, write_results  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
MODEL = {"model.n_layer": "8", "model.n_head": "8", "model.n_embd": "512", "model.block_size": "64",
         "batch.micro_batch_size": "2", "train.dtype": "float32", "train.eval_interval": "0", "train.eval_steps": "1",
         "train.log_interval": "1", "checkpoint.keep": "2"}
SKIP_STEPS = 2  # first gaps left out of the normal step (allocator and thread-pool warm-up)
LAYOUTS = (1, 2)  # ranks
MODES = {"no saves": {"checkpoint.interval": "0"}, "blocking": {}, "async": {"checkpoint.async_save": "true"}}


def run(nproc: int, mode: str, steps: int, interval: int, out: Path) -> dict:
    """Train one mode on ``nproc`` ranks into ``out``; return its step gaps (s), wall to the last step (s),
    saves and checkpoint bytes."""
    args = {**MODEL, "train.steps": str(steps), "checkpoint.interval": str(interval), **MODES[mode]}
    argv = [*meshtrain_command(), "train", CONFIG, "--nproc", str(nproc), "--out", str(out),
            *(tok for key, value in args.items() for tok in (f"--{key}", value))]
    proc = subprocess.run(argv, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = {r["step"]: r["elapsed_s"] for r in records if "loss" in r}
    gaps = {k: elapsed[k] - elapsed[k - 1] for k in range(2, steps + 1)}
    saved = [s for s in range(1, steps) if interval and s % interval == 0 and mode != "no saves"]
    final = max((out / "checkpoints").iterdir())
    return {"gaps": gaps, "to_last_step_s": elapsed[steps], "saves": saved,
            "checkpoint_bytes": sum(f.stat().st_size for f in final.iterdir())}


def stalls(result: dict) -> tuple[float, list[float]]:
    """The run's normal gap (median over gaps with no save before them) and each save's stall (s)."""
    after_save = {s + 1 for s in result["saves"]}
    normal = statistics.median(g for k, g in result["gaps"].items() if k > SKIP_STEPS and k not in after_save)
    return normal, [result["gaps"][s + 1] - normal for s in result["saves"]]


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode: the normal step and the stall per save, medians over every round (s); the cost per save
    from each mode's fastest round (other work on the machine only ever slows a round down)."""
    out = {}
    best_plain = min(r["to_last_step_s"] for r in runs["no saves"])
    for mode, results in runs.items():
        normals, per_save = zip(*(stalls(result) for result in results))
        flat = [s for round_ in per_save for s in round_]
        saves = len(results[0]["saves"])
        best = min(r["to_last_step_s"] for r in results)
        out[mode] = {"normal_step_s": statistics.median(normals), "stall_s": statistics.median(flat) if flat else None,
                     "stalls_by_round_s": list(per_save), "cost_per_save_s": (best - best_plain) / saves if saves else None,
                     "to_last_step_by_round_s": [r["to_last_step_s"] for r in results],
                     "checkpoint_bytes": results[0]["checkpoint_bytes"]}
    return out


def table(by_layout: dict[int, dict[str, dict]]) -> tuple[list[str], list[list]]:
    columns = ["ranks", "saves", "normal step ms", "stall per save ms (median)", "stall vs blocking", "stalls per round ms",
               "cost per save ms (wall)", "cost vs blocking", "checkpoint MB"]
    rows = []
    for nproc, summary in by_layout.items():
        rows += [[nproc, *row] for row in _rows(summary)]
    return columns, rows


def _rows(summary: dict[str, dict]) -> list[list]:
    block = summary["blocking"]
    rows = []
    for mode, s in summary.items():
        row = [mode, f"{1000 * s['normal_step_s']:.0f}"]
        if s["stall_s"] is None:
            rows.append(row + ["-", "-", "-", "-", "-", f"{s['checkpoint_bytes'] / 1e6:.0f} (final save only)"])
            continue
        rounds = " / ".join(", ".join(f"{1000 * x:.0f}" for x in r) for r in s["stalls_by_round_s"])
        row += [f"{1000 * s['stall_s']:.0f}", f"{s['stall_s'] / block['stall_s']:.2f}x", rounds,
                f"{1000 * s['cost_per_save_s']:.0f}", f"{s['cost_per_save_s'] / block['cost_per_save_s']:.2f}x",
                f"{s['checkpoint_bytes'] / 1e6:.0f}"]
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run (default 24)")
    parser.add_argument("--interval", type=int, default=6, help="steps between saves (default 6)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the three modes (default 2)")
    args = parser.parse_args()
    if args.steps <= args.interval + SKIP_STEPS:
        parser.error("--steps must leave at least one save before the last step")
    load_before = os.getloadavg()[0]
    runs: dict[int, dict[str, list[dict]]] = {nproc: {mode: [] for mode in MODES} for nproc in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-ckpt-") as tmp:
        for round_ in range(args.repeats):
            for nproc in LAYOUTS:
                for mode in MODES:
                    out = Path(tmp) / f"r{round_}-{nproc}-{mode.replace(' ', '-')}"
                    runs[nproc][mode].append(run(nproc, mode, args.steps, args.interval, out))
                    print(f"round {round_ + 1}/{args.repeats}  {nproc} rank(s)  {mode:<9} "
                          f"{runs[nproc][mode][-1]['to_last_step_s']:.1f} s to the last step", flush=True)
    summary = {nproc: summarize(by_mode) for nproc, by_mode in runs.items()}
    columns, rows = table(summary)
    notes = [
        f"`meshtrain train {CONFIG} --nproc N` with {', '.join(f'{k} = {v}' for k, v in MODEL.items())}, "
        f"{args.steps} steps, a save every {args.interval} steps (blocking, async) or none, {args.repeats} "
        "interleaved rounds; ~25M parameters, one thread per rank (OMP_NUM_THREADS=1): 1 rank leaves a core "
        "free for the background writer, 2 ranks (DDP) keep both cores training, so there the writer competes "
        "with training for the CPU.",
        "normal step: median gap between two step records with no save between them. Stall per save: the gap "
        "after a saving step minus that normal step, the median over every save of every round (per-round values "
        "beside it). Cost per save: (wall to the last step - the no-save run's) / saves, each from its fastest "
        "round (other work only slows a round down), which also counts the steps an asynchronous write slows "
        "while it runs.",
        "Blocking, a save waits for DCP to write every shard, then rank 0 hashes every file (the SHA-256 "
        "manifest) and commits. Async, it waits only for the copy of the state to CPU memory; the write and "
        "the hashing run in a background thread, and the commit (meta.json, rename) happens at the first step "
        "boundary where every rank's write has finished.",
        f"1-minute load average before the run: {load_before:.2f} on {os.cpu_count()} CPUs; other work on the "
        "machine shows up as spread between rounds and saves. Ratios hold for this machine and this run only.",
    ]
    md = write_results("checkpoint", "Checkpoint stall: blocking vs asynchronous saves", columns, rows, notes,
                       {"steps": args.steps, "interval": args.interval, "repeats": args.repeats,
                        "load_before": load_before, "summary": summary,
                        "runs": {n: {m: [{**r, "gaps": {str(k): g for k, g in r["gaps"].items()}} for r in rs]
                                     for m, rs in by_mode.items()} for n, by_mode in runs.items()}})
    update_benchmarks_doc("checkpoint")
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
