"""Learning-rate scaling with the global batch: val loss after the same number of samples.

    python bench/bench_lr_scaling.py [--samples 24000]      # ~8 min on 2 CPU cores

The main job's GPT, one process, global batch 12, 48 and 192 (micro-batch 12, gradient accumulation
1, 4, 16: the same per-sample arithmetic, so only the batch changes), base learning rate 1e-3 tuned
at the reference batch of 12, with ``optim.lr_scaling`` "none", "linear" (Goyal et al. 2017) and
"sqrt" (Krizhevsky 2014; Malladi et al. 2022 for Adam). Every run sees ``--samples`` training samples,
warms up over the first 1,200 of them and ends its cosine decay at the end; val loss every 2,400
samples. Writes ``bench/results/lr_scaling.md``/``.json`` and ``docs/lr_scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

from meshtrain.batch_math import scaled_lr  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
MBS, REFERENCE, LR = 12, 12, 1e-3
WARMUP_SAMPLES, EVAL_SAMPLES = 1200, 2400


def train(batch: int, rule: str, samples: int) -> dict:
    steps = samples // batch
    args = {"batch.micro_batch_size": MBS, "batch.gradient_accumulation_steps": batch // MBS, "optim.lr": LR,
            "optim.min_lr": LR / 10, "optim.lr_scaling": rule, "optim.reference_batch_size": REFERENCE,
            "train.steps": steps, "optim.warmup_steps": WARMUP_SAMPLES // batch,
            "train.eval_interval": EVAL_SAMPLES // batch, "train.log_interval": max(1, steps // 50),
            "checkpoint.interval": 0, "checkpoint.keep": 1}
    with tempfile.TemporaryDirectory(prefix="meshtrain-lr-") as tmp:
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", "1", "--out", f"{tmp}/run"]
        cmd += [tok for key, value in args.items() for tok in (f"--{key}", str(value))]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"batch {batch} {rule} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"] * batch, r["val_loss"]) for r in records if "val_loss" in r]
    return {"batch": batch, "rule": rule, "lr": scaled_lr(LR, batch, REFERENCE, rule), "evals": evals}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"none": "-", "linear": "--", "sqrt": ":"}
    colors = {12: "#4c72b0", 48: "#dd8452", 192: "#55a868"}
    for r in results:
        ax.plot(*zip(*r["evals"]), styles[r["rule"]], color=colors[r["batch"]], marker="o", markersize=3,
                label=f"batch {r['batch']}, {r['rule']} (lr {r['lr']:.2g})")
    ax.set_xlabel("training samples seen")
    ax.set_ylabel("val loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Learning-rate scaling with the global batch (reference batch 12, lr 1e-3)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=24000)
    args = parser.parse_args()
    results = [train(12, "none", args.samples)]
    for batch in (48, 192):
        for rule in ("none", "linear", "sqrt"):
            results.append(train(batch, rule, args.samples))
            print(batch, rule, results[-1]["evals"][-1], flush=True)
    rows = [[r["batch"], r["rule"], f"{r['lr']:.3g}", f"{r['evals'][-1][1]:.4f}", args.samples // r["batch"]]
            for r in results]
    plot(results, REPO / "docs" / "lr_scaling.png")
    notes = [f"Every run saw {args.samples:,} samples of 64 characters in one process (micro-batch 12).",
             "Plot: docs/lr_scaling.png.",
             f"Command: python bench/bench_lr_scaling.py --samples {args.samples}"]
    path = write_results("lr_scaling", "Learning-rate scaling: val loss after the same samples",
                         ["global batch", "lr_scaling", "peak lr", "final val loss", "steps"], rows, notes,
                         {"runs": results})
    print(path.read_text())


if __name__ == "__main__":
    main()
