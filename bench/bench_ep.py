"""Expert parallelism's cost on this CPU: a tiny Mixtral on 2 gloo ranks at ep = 1 (experts replicated, DDP over dp = 2)
and ep = 2 (each rank holds 4 of the 8 experts; tokens dispatched and combined by all-to-all), side by side in one run
(docs/moe.md, "Expert parallelism").

Each run is ``meshtrain train configs/llama_tiny.toml --model.type mixtral --nproc 2`` for ``--steps`` steps in fp32;
the layouts alternate over ``--rounds`` rounds. Reports the median tokens/s of the logged steps past the 10th, the
ratio to ep = 1, the final val loss (the two layouts train the same model to fp32 rounding), and each rank's expert
parameters. Writes ``bench/results/ep.md`` and ``.json``, and copies the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_moe import DENSE_F, EXPERTS, LLAMA, TOP_K, cpu_flags
from common import meshtrain_command, update_benchmarks_doc, write_results

LAYOUTS = {"ep = 1 (dp = 2, DDP, experts replicated)": ["--ep", "1"],
           "ep = 2 (dp = 2, 4 experts per rank, all-to-all)": ["--ep", "2"]}


def train(out: Path, steps: int, extra: list[str]) -> dict:
    """One 2-rank run; (median tokens/s past step 10, final val loss)."""
    cmd = [*meshtrain_command(), "train", str(LLAMA), "--nproc", "2", "--steps", str(steps), "--out", str(out),
           "--train.dtype", "float32", "--train.eval_interval", "0", "--train.log_interval", "5",
           "--model.type", "mixtral", "--model.ffn_hidden", str(DENSE_F // 2), "--model.num_experts", str(EXPERTS),
           "--model.num_experts_per_tok", str(TOP_K), "--batch.micro_batch_size", "6", *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 10)
    return {"tokens_per_s": tps, "val_loss": json.loads((out / "summary.json").read_text())["val_loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for i, (name, extra) in enumerate(LAYOUTS.items()):
                runs[name].append(train(Path(work) / f"r{r}-{i}", args.steps, extra))
    medians = {name: statistics.median(x["tokens_per_s"] for x in got) for name, got in runs.items()}
    base = next(iter(medians.values()))
    per_rank = {name: EXPERTS // int(extra[1]) for name, extra in LAYOUTS.items()}
    rows = [[name, f"{medians[name]:,.0f}", f"{medians[name] / base:.2f}x", f"{runs[name][-1]['val_loss']:.4f}",
             str(per_rank[name]), " / ".join(f"{x['tokens_per_s']:,.0f}" for x in runs[name])] for name in LAYOUTS]
    notes = [f"CPU flags: {cpu_flags()}; 2 gloo ranks on this machine's cores; fp32.",
             f"Model: configs/llama_tiny.toml as a Mixtral (4 layers, C = 128, block 128), {EXPERTS} experts of "
             f"F = {DENSE_F // 2}, top-{TOP_K}; global batch 12 (micro-batch 6 per rank), {args.steps} steps per run, "
             f"{args.rounds} rounds alternating the layouts; tokens/s the median over logged steps past the 10th of "
             "each run, then over runs.",
             "On one machine the all-to-all is a copy through gloo's loopback: this is ep's overhead in software "
             "(dispatch bookkeeping, two extra collectives per MoE layer forward and two backward), not a network's; "
             "its saving, experts' states 1/ep per rank, is in the last column."]
    md = write_results("ep", "Expert parallelism: ep = 2 vs ep = 1 on 2 ranks",
                       ["layout", "tokens/s", "vs ep = 1", f"val loss after {args.steps} steps",
                        "experts per rank", "per round"], rows, notes,
                       {"runs": runs, "steps": args.steps, "rounds": args.rounds, "cpu_flags": cpu_flags(),
                        "torch_threads": torch.get_num_threads()})
    update_benchmarks_doc("ep")
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
