"""The longest sequence a tiny Llama trains within a fixed memory budget per rank, at sp = 1, 2, 4 for Ulysses, ring
and USP, with and without full recomputation and the chunked loss; measured peak per rank beside the planner's.

    python bench/bench_long_context.py [--budget-mib 1024]   # bench/results/long_context.{md,json}, docs/long_context.png

For each layout the planner names its longest sequence within the budget (a multiple of 256 x sp tokens); the bench
trains 2 steps there (``meshtrain train``, micro batch 1, fp32) and steps up (it fits) or down (it does not) by about
5% until one measured length fits and the next does not. Measured peak: the largest ``ru_maxrss`` over the ranks
(``summary.json``), everything the process holds. Every probe is a point of the picture (peak vs sequence length,
measured and predicted). sp = 4 runs 4 ranks on this machine's cores: its memory is right, its speed is not measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import cpu_flags  # noqa: E402
from common import REPO, meshtrain_command, write_results  # noqa: E402

CONFIG = "configs/llama_tiny.toml"
MODEL = {"model.n_head": "8", "model.n_kv_head": "4", "model.vocab_size": "8192", "batch.micro_batch_size": "1",
         "batch.gradient_accumulation_steps": "1", "train.dtype": "float32", "train.steps": "2",
         "train.eval_interval": "0", "train.eval_steps": "1", "checkpoint.interval": "0", "train.check_memory": "false"}
"""The README's tiny Llama (4 layers, 128 wide, SwiGLU 352) with 8 query and 4 kv heads (Ulysses to sp4), on the
bundled characters with an 8,192-token output head (a BPE-sized vocabulary, so that the loss's memory shows)."""
VARIANTS = [  # name, sp, sp_mode, sp_ulysses, recompute, loss_chunk_mb
    ("sp1", 1, "ulysses", 0, "none", "64"),
    ("sp1, plain loss", 1, "ulysses", 0, "none", "0"),
    ("sp1, full recompute", 1, "ulysses", 0, "full", "64"),
    ("sp2 Ulysses", 2, "ulysses", 0, "none", "64"),
    ("sp2 ring", 2, "ring", 0, "none", "64"),
    ("sp4 Ulysses", 4, "ulysses", 0, "none", "64"),
    ("sp4 ring", 4, "ring", 0, "none", "64"),
    ("sp4 USP 2x2", 4, "usp", 2, "none", "64"),
    ("sp4 USP 2x2, full recompute", 4, "usp", 2, "full", "64"),
]
MIB = 2**20
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
"""glibc's mmap threshold fixed at 64 KiB (as ``bench/plan_vs_actual.py``'s recompute rows): every activation is its own
mapping, returned to the system when freed, so the peak RSS is the peak of live tensors plus the runtime. With the
default dynamic threshold glibc keeps freed activations in its heap and the RSS stays near the largest earlier
peak (recomputation's savings then hardly show)."""


def overrides(sp: int, mode: str, ulysses: int, recompute: str, chunk: str, seq: int) -> dict[str, str]:
    o = {**MODEL, "model.block_size": str(seq), "parallel.sp": str(sp), "parallel.sp_mode": mode,
         "train.recompute": recompute, "train.loss_chunk_mb": chunk}
    if mode == "usp":
        o["parallel.sp_ulysses"] = str(ulysses)
    return o


def predicted(o: dict[str, str], sp: int) -> dict:
    """The planner's prediction for the run ``o`` on ``sp`` ranks (as ``meshtrain train`` compares it)."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.actual import predict_for_run

    return predict_for_run(load_config(REPO / CONFIG, o), sp, 8192, "cpu", threads=1)


def planner_longest(variant: tuple, budget: float) -> tuple[int, int]:
    """(the longest multiple of the layout's unit the planner predicts within ``budget`` bytes, the unit)."""
    _, sp, mode, ulysses, recompute, chunk = variant
    unit = 256 * sp
    k = 1
    while predicted(overrides(sp, mode, ulysses, recompute, chunk, (k + 1) * unit), sp)["peak_memory_bytes"] <= budget:
        k += 1
    return k * unit, unit


def measure(variant: tuple, seq: int) -> dict:
    """Train 2 steps of ``variant`` at ``seq`` tokens; its measured and predicted peaks per rank."""
    _, sp, mode, ulysses, recompute, chunk = variant
    o = overrides(sp, mode, ulysses, recompute, chunk, seq)
    with tempfile.TemporaryDirectory(prefix="meshtrain-long-") as tmp:
        out = Path(tmp) / "run"
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", str(sp), "--out", str(out)]
        cmd += [tok for key, value in o.items() for tok in (f"--{key}", value)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=ENV)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
    plan = predicted(o, sp)
    return {"seq": seq, "measured": summary["peak_memory_bytes"], "predicted": plan["peak_memory_bytes"],
            "predicted_breakdown": plan["memory_breakdown_bytes"], "wall_s": time.perf_counter() - start}


def longest(variant: tuple, budget: float, max_probes: int) -> dict:
    """Probe from the planner's longest sequence until one measured length fits and the next does not."""
    start, unit = planner_longest(variant, budget)
    step = unit * max(1, math.ceil(0.05 * start / unit))
    probes = [measure(variant, start)]
    direction = 1 if probes[0]["measured"] <= budget else -1
    while len(probes) < max_probes:
        seq = probes[-1]["seq"] + direction * step
        if seq < unit:
            break
        probes.append(measure(variant, seq))
        if (probes[-1]["measured"] <= budget) != (direction == 1):
            break
    fits = [p["seq"] for p in probes if p["measured"] <= budget]
    return {"name": variant[0], "sp": variant[1], "planner_longest": start, "step": step,
            "measured_longest": max(fits) if fits else None,
            "bracketed": any(p["measured"] > budget for p in probes) and bool(fits), "probes": probes}


def plot(records: list[dict], budget: float, path: Path) -> None:
    """Peak per rank vs sequence length: the planner's curve of each layout from 512 tokens to past its longest
    (lines), the measured probes (points), the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = {v[0]: v for v in VARIANTS}
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, record in enumerate(records):
        color, style = f"C{i % 10}", "-" if i < 10 else "--"
        _, sp, mode, ulysses, recompute, chunk = variants[record["name"]]
        top = max(p["seq"] for p in record["probes"])
        xs = [n * 256 * sp for n in range(max(1, 512 // (256 * sp)), top // (256 * sp) + 2)]
        xs = xs[::max(1, len(xs) // 40)]
        curve = [predicted(overrides(sp, mode, ulysses, recompute, chunk, x), sp)["peak_memory_bytes"] / MIB for x in xs]
        ax.plot(xs, curve, style, color=color, lw=1, alpha=0.8)
        probes = sorted(record["probes"], key=lambda p: p["seq"])
        ax.plot([p["seq"] for p in probes], [p["measured"] / MIB for p in probes], "o", color=color,
                label=f"{record['name']}: {record['measured_longest'] or 0:,}")
    ax.axhline(budget / MIB, color="black", lw=1, ls=":")
    ax.text(0.99, budget / MIB - 5, f"budget {budget / MIB:.0f} MiB", va="top", ha="right",
            transform=ax.get_yaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title("Tiny Llama, fp32, 1 sample: the planner's peak per rank (lines), measured (points)")
    ax.legend(fontsize=7, title="layout: longest measured within budget", title_fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="memory budget per rank, MiB (default 1024)")
    parser.add_argument("--max-probes", type=int, default=4, help="trainings per layout at most (default 4)")
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    parser.add_argument("--replot", action="store_true", help="only redraw the picture from the results' json")
    args = parser.parse_args()
    budget = args.budget_mib * MIB
    if args.replot:
        data = json.loads((REPO / "bench" / "results" / "long_context.json").read_text())
        plot(data["layouts"], data["budget_bytes"], REPO / "docs" / "long_context.png")
        return
    variants = [v for v in VARIANTS if not args.only or v[0] in args.only]
    records = []
    for variant in variants:
        records.append(longest(variant, budget, args.max_probes))
        print(json.dumps({k: v for k, v in records[-1].items() if k != "probes"}), flush=True)
    base = next((r["measured_longest"] for r in records if r["name"] == "sp1"), None)
    rows = []
    for r in records:
        errors = [(p["predicted"] - p["measured"]) / p["measured"] for p in r["probes"]]
        worst = max(errors, key=abs)
        got = r["measured_longest"]
        rows.append([r["name"], r["sp"], f"{got:,}" if got else "none" + ("" if r["bracketed"] else " (not bracketed)"),
                     f"{r['planner_longest']:,}", f"{got / base:.2f}" if got and base else "",
                     ", ".join(f"{p['seq']:,}: {p['measured'] / MIB:.0f} / {p['predicted'] / MIB:.0f}"
                               for p in sorted(r["probes"], key=lambda p: p["seq"])),
                     f"{worst:+.1%}"])
    picture = REPO / "docs" / "long_context.png"
    plot(records, budget, picture)
    notes = [f"{CONFIG} with {', '.join(f'{k} = {v}' for k, v in MODEL.items() if k.startswith('model.'))}; "
             "fp32, micro batch 1, 2 steps, 1 thread per rank, glibc's mmap threshold at 64 KiB (freed tensors leave "
             "the RSS); peak = the largest ru_maxrss over the ranks (summary.json), predicted = the planner's peak per rank for the same run (planner.actual.predict_for_run).",
             f"Budget {args.budget_mib:.0f} MiB per rank. Longest measured: the longest probed length whose peak fits; "
             "the next probe (about 5% longer, or the planner's) did not fit, unless marked not bracketed.",
             f"CPU flags: {cpu_flags()}. sp = 4 runs 4 processes on this machine's cores: memory only.",
             f"Picture: docs/{picture.name}."]
    path = write_results("long_context", f"Longest sequence within {args.budget_mib:.0f} MiB per rank: sp = 1, 2, 4",
                         ["layout", "sp", "longest measured (tokens)", "planner's longest", "measured / sp1",
                          "probes: tokens: measured / predicted MiB", "worst planner error"],
                         rows, notes, {"budget_bytes": budget, "layouts": records})
    print(path.read_text())


if __name__ == "__main__":
    main()
