"""meshtrain against what a user would pick instead, side by side on this machine.

Contenders train the main job's GPT (``configs/shakespeare_char.toml``) on the same data, global batch,
optimizer, schedule and step count (``bench/contenders.py`` holds the hand-written loops):

1. a plain single-process PyTorch loop (the reference for overhead), fp32;
2. hand-written DDP started with torchrun;
3. Hugging Face Accelerate (``accelerate launch``, 2 CPU processes);
4. Lightning Fabric (DDP strategy, 2 CPU processes);
5. meshtrain at dp=1 and dp=2, fp32, and with its default settings (``meshtrain train CONFIG --nproc 2``).

bf16 rows only where this CPU has bf16 matmul instructions (AVX512-BF16/AMX, where meshtrain's
``train.dtype = "auto"`` picks bf16): the hand-written loops again with bf16 autocast (plain and DDP
also with fused AdamW, the settings meshtrain's defaults resolve to), and meshtrain's defaults at dp=1.
On a CPU without them (AVX2 only, like the EPYC these numbers were first taken on) torch's bf16 GEMMs of
this model's shapes run 30-180x slower than fp32, and the defaults train in fp32.

The contenders run one at a time in interleaved rounds (A B C ... A B C ...), so drift of the machine
hits all of them alike. Per run: the median step time over the steps after ``SKIP_STEPS``; per
contender: the median over rounds (spread = min..max over rounds). tokens/s = global batch * block_size
/ step time. MFU = model FLOPs per step (Korthikanti et al. 2022, Eq. 7, ``planner.cost.model_flops``)
/ step time / this machine's matmul peak for the dtype, measured in this run (a 1024^3 GEMM on every
core, best of 20). Val loss: every contender's final weights on the same 96 val windows.

    python bench/bench_contenders.py [--steps 200] [--rounds 3]     # ~25 min on 2 CPU cores with bf16 rows
    python bench/bench_contenders.py --rounds 6 --name contenders_fp32 \
        --only 'plain PyTorch loop, fp32|torchrun + DDP, fp32|Accelerate, fp32|Fabric DDP, fp32|meshtrain dp=1, fp32|meshtrain dp=2 DDP, fp32'

Writes ``bench/results/contenders.{md,json}``, ``docs/benchmarks.md`` and ``docs/contenders.png`` (``--name``:
NAME instead of contenders). The notes give same-round ratios for the pairs of :data:`PAIRS`.
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
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, meshtrain_command, update_benchmarks_doc, write_results  # noqa: E402

from meshtrain.runtime.device import compute_dtype  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"
CONTENDERS = REPO / "bench" / "contenders.py"
SKIP_STEPS = 10  # first steps of a run left out (allocator, thread pools, autograd warm-up)
GLOBAL_BATCH = 24  # what `meshtrain train CONFIG --nproc 2` (micro-batch 12 per rank) trains with


@dataclass
class Contender:
    name: str
    ranks: int
    dtype: str
    kind: str  # "hand" (bench/contenders.py) or "meshtrain"
    argv: list[str] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)


LARGE = {"model.n_layer": "6", "model.n_head": "6", "model.n_embd": "384", "model.block_size": "256"}
"""``--large``: the issue's larger model (6 layers, 384 wide, 256 tokens: 10.7 M parameters)."""
FP32 = ["--train.dtype", "float32"]
AUTO_DTYPE = compute_dtype("auto", "cpu")
"""What meshtrain's default ``train.dtype = "auto"`` trains in on this CPU: bfloat16 with AVX512-BF16/AMX."""


def contenders(steps: int, model: dict[str, str]) -> list[Contender]:
    py = sys.executable
    common = ["--steps", str(steps), "--batch", str(GLOBAL_BATCH), *[a for k, v in model.items() for a in ("--set", f"{k}={v}")]]
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(CONTENDERS), "ddp", "{out}"]
    launch = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--dynamo_backend", "no"]
    bf16 = ["--dtype", "bfloat16"]
    hand = [
        Contender("plain PyTorch loop, fp32", 1, "float32", "hand", [py, str(CONTENDERS), "plain", "{out}", *common]),
        Contender("torchrun + DDP, fp32", 2, "float32", "hand", [*torchrun, *common]),
        Contender("Accelerate, fp32", 2, "float32", "hand",
                  [*launch, "--mixed_precision", "no", str(CONTENDERS), "accelerate", "{out}", *common]),
        Contender("Lightning Fabric DDP, fp32", 2, "float32", "hand",
                  [py, str(CONTENDERS), "fabric", "{out}", *common, "--devices", "2"]),
    ]
    if AUTO_DTYPE == "bfloat16":
        hand += [
            Contender("plain PyTorch loop, bf16 + fused AdamW", 1, "bfloat16", "hand",
                      [py, str(CONTENDERS), "plain", "{out}", *common, *bf16, "--fused"]),
            Contender("torchrun + DDP, bf16 + fused AdamW", 2, "bfloat16", "hand", [*torchrun, *common, *bf16, "--fused"]),
            Contender("Accelerate, bf16", 2, "bfloat16", "hand",
                      [*launch, "--mixed_precision", "bf16", str(CONTENDERS), "accelerate", "{out}", *common, *bf16]),
            Contender("Lightning Fabric DDP, bf16", 2, "bfloat16", "hand",
                      [py, str(CONTENDERS), "fabric", "{out}", *common, "--devices", "2", *bf16]),
        ]
    half = ["--nproc", "2", "--batch.micro_batch_size", str(GLOBAL_BATCH // 2)]
    whole = ["--nproc", "2", "--batch.micro_batch_size", str(GLOBAL_BATCH)]  # one replica: tp, sp, pp
    mesh = [
        Contender("meshtrain dp=1, fp32", 1, "float32", "meshtrain",
                  ["--nproc", "1", "--batch.micro_batch_size", str(GLOBAL_BATCH), *FP32]),
        Contender("meshtrain dp=2 DDP, fp32", 2, "float32", "meshtrain", [*half, *FP32]),
        Contender("meshtrain dp=2, default settings", 2, AUTO_DTYPE, "meshtrain", ["--nproc", "2"]),
        *([Contender("meshtrain dp=1, default settings", 1, AUTO_DTYPE, "meshtrain",
                     ["--nproc", "1", "--batch.micro_batch_size", str(GLOBAL_BATCH)])] if AUTO_DTYPE == "bfloat16" else []),
        Contender("meshtrain dp=2 FSDP2 (zero 3), fp32", 2, "float32", "meshtrain",
                  [*half, "--parallel.zero_stage", "3", *FP32]),
        Contender("meshtrain dp=2 FSDP2 (zero 3, a unit per block), fp32", 2, "float32", "meshtrain",
                  [*half, "--parallel.zero_stage", "3", "--parallel.fsdp_unit_mb", "0", *FP32]),
        Contender("meshtrain tp=2, fp32", 2, "float32", "meshtrain", [*whole, "--parallel.tp", "2", *FP32]),
        Contender("meshtrain sp=2 (Ulysses), fp32", 2, "float32", "meshtrain", [*whole, "--parallel.sp", "2", *FP32]),
        Contender("meshtrain pp=2 (1F1B, 2 micro-batches), fp32", 2, "float32", "meshtrain",
                  ["--nproc", "2", "--parallel.pp", "2", "--batch.micro_batch_size", str(GLOBAL_BATCH // 2),
                   "--batch.gradient_accumulation_steps", "2", *FP32]),
    ]
    for c in mesh:
        c.argv = [*meshtrain_command(), "train", str(CONFIG), *c.argv, "--steps", str(steps), "--out", "{out}",
                  "--train.log_interval", "1", "--train.eval_interval", "0", "--checkpoint.interval", "0",
                  *[a for k, v in model.items() for a in (f"--{k}", v)]]
    return hand + mesh


def run_one(c: Contender, steps: int, work: Path, model: dict[str, str]) -> dict:
    """Run contender ``c`` once; return its step times, peak RSS per rank and val loss."""
    out = work / f"{len(c.rounds)}-{c.name.replace(' ', '_').replace(',', '').replace('/', '')}"
    target = out if c.kind == "meshtrain" else out.with_suffix(".json")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // c.ranks)), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([a.replace("{out}", str(target)) for a in c.argv], capture_output=True, text=True, env=env,
                          cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{c.name} failed:\n{proc.stderr[-3000:]}")
    if c.kind == "hand":
        result = json.loads(target.read_text())
    else:
        result = meshtrain_result(out, model)
    result["wall_s"] = wall
    return result


def meshtrain_result(out: Path, overrides: dict[str, str] | None = None) -> dict:
    """The same fields as a hand-written contender's JSON, from a meshtrain run folder: step times from
    metrics.jsonl, peak memory from summary.json, val loss of the final checkpoint on the same windows
    (the corpus and block size the run's checkpoint records)."""
    sys.path.insert(0, str(REPO / "bench"))
    from contenders import val_loss

    from meshtrain.cli.export import load_checkpoint_model
    from meshtrain.config.sections import DataConfig
    from meshtrain.data.corpus import load_corpus

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    summary = json.loads((out / "summary.json").read_text())
    model, meta, _ = load_checkpoint_model(out)
    data, block = DataConfig(**meta["config"]["data"]), meta["config"]["model"]["block_size"]
    corpus = load_corpus(data.resolved_path(), data.val_fraction, block)
    return {"step_times_s": times, "peak_rss_bytes": [summary["peak_memory_bytes"]],
            "val_loss": val_loss(model, corpus, block), "world_size": summary["world_size"]}


def matmul_peak(dtype: str, n: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of an n^3 GEMM on every core of this machine (bf16 under CPU autocast), best of ``repeats``."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    if dtype == "bfloat16":
        a, b = a.bfloat16(), b.bfloat16()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def step_flops(overrides: dict[str, str]) -> float:
    """Model FLOPs of one optimizer step of the main job's model (with ``overrides``) at GLOBAL_BATCH samples
    (forward + backward)."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.cost import model_flops
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(CONFIG, overrides)
    return model_flops(from_config(cfg, 65), GLOBAL_BATCH)


def summarize(c: Contender, block: int) -> dict:
    per_round = [statistics.median(r["step_times_s"][SKIP_STEPS:]) for r in c.rounds]
    step = statistics.median(per_round)
    return {"step_s": step, "tokens_per_s": GLOBAL_BATCH * block / step,
            "tokens_per_s_rounds": [GLOBAL_BATCH * block / s for s in per_round],
            "peak_rss_mib": max(max(r["peak_rss_bytes"]) for r in c.rounds) / 2 ** 20,
            "val_loss": statistics.median(r["val_loss"] for r in c.rounds),
            "wall_s": statistics.median(r["wall_s"] for r in c.rounds)}


def plot(names: list[str], stats: dict, path: Path, title: str) -> None:
    """Horizontal bars of median tokens/s per contender, each round's value as a dot (the spread)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    y = list(range(len(names)))[::-1]
    ax.barh(y, [stats[n]["tokens_per_s"] for n in names], color=["#4c72b0" if n.startswith("meshtrain") else "#999999"
                                                                 for n in names])
    for yi, n in zip(y, names):
        ax.plot(stats[n]["tokens_per_s_rounds"], [yi] * len(stats[n]["tokens_per_s_rounds"]), "k.", markersize=4)
    ax.set_yticks(y, names)
    ax.set_xlabel("tokens/s (bar: median over rounds; dots: each round)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAIRS = [("meshtrain dp=1, fp32", "plain PyTorch loop, fp32"), ("meshtrain dp=2 DDP, fp32", "torchrun + DDP, fp32"),
         ("meshtrain dp=2 DDP, fp32", "Accelerate, fp32"), ("meshtrain dp=2 DDP, fp32", "Lightning Fabric DDP, fp32"),
         ("meshtrain dp=1, default settings", "plain PyTorch loop, bf16 + fused AdamW"),
         ("meshtrain dp=2, default settings", "torchrun + DDP, bf16 + fused AdamW"),
         ("meshtrain dp=2, default settings", "Accelerate, bf16"),
         ("meshtrain dp=2, default settings", "Lightning Fabric DDP, bf16")]
"""meshtrain rows and the hand-written rows at the same layout and settings (goals 2 and 3 of the benchmarks)."""


def paired_ratios(stats: dict) -> list[str]:
    """For each of :data:`PAIRS` that ran: meshtrain's tokens/s over the other's in the same round (the
    two ran minutes apart, so a slow stretch of the machine mostly hits both), median and per round."""
    out = []
    for mine, other in PAIRS:
        if mine in stats and other in stats:
            ratios = [a / b for a, b in zip(stats[mine]["tokens_per_s_rounds"], stats[other]["tokens_per_s_rounds"])]
            out.append(f"{mine} / {other}: {statistics.median(ratios):.3f} "
                       f"({' '.join(f'{r:.2f}' for r in ratios)})")
    return out


LARGE_FIELD = ("plain PyTorch loop, fp32", "torchrun + DDP, fp32", "meshtrain dp=1, fp32", "meshtrain dp=2 DDP, fp32",
               "meshtrain dp=2, default settings")
"""``--large`` runs these only: each step of the larger model takes seconds on 2 cores."""


def cuda_row(columns: list[str]) -> list[str]:
    """The CUDA row: where bench/bench_cuda.py's GPU numbers are, or that no GPU took part."""
    kept = REPO / "bench" / "results" / "cuda.json"
    data = json.loads(kept.read_text()) if kept.exists() else {}
    if data.get("device"):
        best = max(data["stats"].items(), key=lambda kv: kv[1]["tokens_per_s"] if kv[0].startswith("meshtrain") else 0)
        where = (f"not on this machine (no GPU): {data['device']}, 355M GPT, {best[0]} "
                 f"{best[1]['tokens_per_s']:,.0f} tokens/s, bench/results/cuda.md")
    else:
        where = "not run: no GPU on this machine or lent to this run"
    return ["meshtrain on CUDA (bf16)", where] + ["-"] * (len(columns) - 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default 200 (--large: 20)")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--large: 2)")
    parser.add_argument("--only", default="",
                        help="run only contenders whose name contains one of these '|'-separated strings (names hold commas), e.g. 'plain|default'")
    parser.add_argument("--name", default="",
                        help="results name: bench/results/NAME.{md,json}, docs/NAME.png and docs/benchmarks.md's NAME "
                             "section (default contenders, or contenders_large); give one to keep a partial run apart")
    parser.add_argument("--large", action="store_true",
                        help="the larger model (6 x 384, 256 tokens) and the data-parallel contenders only; "
                             "writes contenders_large.*")
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.large else 200)
    args.rounds = args.rounds or (2 if args.large else 3)
    from meshtrain.config.load import load_config

    model = LARGE if args.large else {}
    name = args.name or ("contenders_large" if args.large else "contenders")
    block = load_config(CONFIG, model).model.block_size
    field_list = [c for c in contenders(args.steps, model)
                  if any(o in c.name for o in args.only.split("|")) and (not args.large or c.name in LARGE_FIELD)]
    peaks = {d: matmul_peak(d) for d in sorted({"float32", *(c.dtype for c in field_list)})}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as tmp:
        for round_ in range(args.rounds):
            for c in field_list:
                print(f"round {round_ + 1}/{args.rounds}: {c.name}", file=sys.stderr, flush=True)
                c.rounds.append(run_one(c, args.steps, Path(tmp), model))
    flops = step_flops(model)
    stats = {c.name: summarize(c, block) for c in field_list}
    reference = stats.get("plain PyTorch loop, fp32")
    columns = ["contender", "ranks x threads", "dtype", "tokens/s (median)", "per round", "vs plain fp32 loop",
               "ms/step", "MFU (vs measured matmul peak)", "peak RSS/rank (MiB)", f"val loss @ {args.steps}", "wall s"]
    rows = []
    for c in field_list:
        s = stats[c.name]
        peak = peaks.get(c.dtype, peaks["float32"])
        ratio = f"{s['tokens_per_s'] / reference['tokens_per_s']:.2f}x" if reference else "-"
        rows.append([c.name, f"{c.ranks} x {max(1, (os.cpu_count() or 1) // c.ranks)}", c.dtype, f"{s['tokens_per_s']:,.0f}",
                     " / ".join(f"{t:,.0f}" for t in s["tokens_per_s_rounds"]), ratio, f"{1000 * s['step_s']:.1f}",
                     f"{flops / s['step_s'] / peak:.1%}", f"{s['peak_rss_mib']:.0f}", f"{s['val_loss']:.4f}",
                     f"{s['wall_s']:.0f}"])
    rows.append(cuda_row(columns))
    cfg = load_config(CONFIG, model).model
    notes = [f"Model {cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, {block} tokens; global batch "
             f"{GLOBAL_BATCH} samples x {block} tokens, {args.steps} steps, {args.rounds} interleaved rounds; "
             f"medians over steps {SKIP_STEPS + 1}..{args.steps} of a run, then over rounds.",
             "Matmul peak of this machine measured in this run (1024^3 GEMM, all cores): "
             + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in peaks.items())
             + f"; model FLOPs per step {flops / 1e9:.2f} GFLOP (Korthikanti et al. 2022, Eq. 7).",
             "OMP_NUM_THREADS = CPUs / ranks for every contender. Val loss: the final weights on the same 96 val "
             "windows; the hand-written loops draw random windows, meshtrain its sampler's, so val losses agree "
             "only up to data order. tp, sp and pp hold one replica on both ranks (micro-batch 24; pp: 2 of 12)."]
    pairs = paired_ratios(stats)
    if pairs:
        notes.append("Same-round ratios of tokens/s, median (each round): " + "; ".join(pairs) + ".")
    write_results(name, f"meshtrain against the alternatives (configs/shakespeare_char.toml{' --large' if args.large else ''})",
                  columns, rows, notes, {"machine": machine(), "model": model, "peaks_flops": peaks, "step_flops": flops,
                                         "stats": stats, "rounds": {c.name: c.rounds for c in field_list}})
    title = f"GPT {cfg.n_layer}x{cfg.n_embd}, {block} tokens, global batch {GLOBAL_BATCH}, this machine"
    plot([c.name for c in field_list], stats, REPO / "docs" / f"{name}.png", title)
    update_benchmarks_doc(name)
    print("\n".join(["| " + " | ".join(map(str, r)) + " |" for r in rows]))


if __name__ == "__main__":
    main()
