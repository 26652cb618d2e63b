"""The same tiny Llama trained by meshtrain and by ``transformers.LlamaForCausalLM``, side by side.

``configs/llama_tiny.toml`` (4 layers, 128 wide, 4 query and 2 kv heads, SwiGLU 352, 128 tokens, 0.76 M
parameters): meshtrain's Llama against ``transformers``' ``LlamaForCausalLM`` holding the same initial
weights, in a plain single-process loop and under Accelerate on 2 CPU processes (``bench/contenders.py
--hf``), same global batch (24 samples), optimizer, schedule and step count; fp32, and bf16 where this CPU
has bf16 matmul. Rounds interleave the contenders (A B C ... A B C ...); per contender the median over
rounds of each run's median step time after the first steps; val loss on the same val windows.

    python bench/bench_llama.py [--steps 150] [--rounds 2]      # ~10 min on 2 CPU cores (fp32 rows only)

Writes ``bench/results/llama_contenders.{md,json}`` and a section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_contenders import AUTO_DTYPE, CONTENDERS, GLOBAL_BATCH, Contender, run_one, summarize  # noqa: E402
from common import REPO, meshtrain_command, update_benchmarks_doc, write_results  # noqa: E402

CONFIG = REPO / "configs" / "llama_tiny.toml"
PAIRS = (("meshtrain dp=1, fp32", "transformers, plain loop, fp32"),
         ("meshtrain dp=2 DDP, fp32", "transformers + Accelerate, fp32"),
         ("meshtrain dp=1, bf16", "transformers, plain loop, bf16"),
         ("meshtrain dp=2 DDP, bf16", "transformers + Accelerate, bf16"))
"""(meshtrain, contender) at the same settings: the ratio of their tokens/s is the goal's (>= 1.2x)."""


def contenders(steps: int) -> list[Contender]:
    py = sys.executable
    common = ["--steps", str(steps), "--batch", str(GLOBAL_BATCH), "--config", str(CONFIG), "--hf"]
    accelerate = str(Path(py).with_name("accelerate"))
    launch = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--dynamo_backend", "no"]
    dtypes = ["float32"] + (["bfloat16"] if AUTO_DTYPE == "bfloat16" else [])
    out = []
    for dtype in dtypes:
        short = "fp32" if dtype == "float32" else "bf16"
        out += [
            Contender(f"transformers, plain loop, {short}", 1, dtype, "hand",  # fused AdamW, as meshtrain's default
                      [py, str(CONTENDERS), "plain", "{out}", *common, "--dtype", dtype, "--fused"]),
            Contender(f"transformers + Accelerate, {short}", 2, dtype, "hand",
                      [*launch, "--mixed_precision", "no" if dtype == "float32" else "bf16", str(CONTENDERS),
                       "accelerate", "{out}", *common, "--dtype", dtype]),
            Contender(f"meshtrain dp=1, {short}", 1, dtype, "meshtrain",
                      ["--nproc", "1", "--batch.micro_batch_size", str(GLOBAL_BATCH), "--train.dtype", dtype]),
            Contender(f"meshtrain dp=2 DDP, {short}", 2, dtype, "meshtrain",
                      ["--nproc", "2", "--batch.micro_batch_size", str(GLOBAL_BATCH // 2), "--train.dtype", dtype]),
        ]
    for c in out:
        if c.kind == "meshtrain":
            c.argv = [*meshtrain_command(), "train", str(CONFIG), *c.argv, "--steps", str(steps), "--out", "{out}",
                      "--train.log_interval", "1", "--train.eval_interval", "0", "--checkpoint.interval", "0"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from meshtrain.config.load import load_config

    block = load_config(CONFIG).model.block_size
    runs = contenders(args.steps)
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-llama-") as work:
        for r in range(args.rounds):
            for c in runs:
                print(f"round {r + 1}/{args.rounds}: {c.name}", file=sys.stderr, flush=True)
                c.rounds.append(run_one(c, args.steps, Path(work), {}))
    stats = {c.name: summarize(c, block) for c in runs}
    columns = ["contender", "ranks", "dtype", "tokens/s", "step (ms)", "val loss", "peak RSS/rank (MiB)"]
    rows = [[c.name, c.ranks, c.dtype, f"{stats[c.name]['tokens_per_s']:,.0f}", f"{1000 * stats[c.name]['step_s']:.1f}",
             f"{stats[c.name]['val_loss']:.4f}", f"{stats[c.name]['peak_rss_mib']:.0f}"] for c in runs]
    notes = [f"{args.steps} steps, global batch {GLOBAL_BATCH} x {block} tokens, {args.rounds} rounds; tokens/s from "
             f"the median step time after the first steps, median over rounds."]
    for mine, theirs in PAIRS:
        if mine in stats and theirs in stats:
            per_round = [a / b for a, b in zip(stats[mine]["tokens_per_s_rounds"], stats[theirs]["tokens_per_s_rounds"])]
            notes.append(f"{mine} / {theirs}: {statistics.median(per_round):.2f}x tokens/s (rounds: "
                         f"{', '.join(f'{x:.2f}' for x in per_round)}); val loss {stats[mine]['val_loss']:.4f} vs "
                         f"{stats[theirs]['val_loss']:.4f}")
    path = write_results("llama_contenders", "meshtrain's Llama against transformers' LlamaForCausalLM", columns, rows,
                         notes, {"stats": stats})
    update_benchmarks_doc("llama_contenders")
    print(path.read_text())


if __name__ == "__main__":
    main()
