"""Synchronous vs asynchronous data parallelism on Tiny Shakespeare: val loss against samples and wall time.

    python bench/bench_sync_modes.py [--samples 28800] [--nproc 4]      # ~15 min on 2 CPU cores

The main job's GPT (``configs/shakespeare_char.toml``), micro-batch 12, on ``--nproc`` ranks, each run
seeing the same number of training samples:

- sync: DDP over all ranks (global batch 12 * nproc per step);
- local-sgd H = 4 and 16: every rank steps alone, parameters averaged every H steps;
- async: 1 parameter server + nproc-1 workers, each gradient one worker's 12 samples; bounded
  staleness s = 0, 2, 8 by waiting (``stale_policy = "wait"``), and s = 2 by dropping.

The learning rate follows the batch of one update by the square-root rule from the main job's
(1e-3 at 24 samples, ``optim.lr_scaling = "sqrt"``), and the warmup covers the same 4,800 samples
in every run. Val loss every 2,400 samples. Writes ``bench/results/sync_modes.md``/``.json`` and
``docs/sync_modes.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
MBS = 12
WARMUP_SAMPLES, EVAL_SAMPLES = 4800, 2400


def runs(nproc: int) -> dict[str, dict[str, str]]:
    async_ = {"parallel.sync_mode": "async"}
    return {
        "sync (DDP)": {},
        "local-sgd H=4": {"parallel.sync_mode": "local-sgd", "local_sgd.steps": "4"},
        "local-sgd H=16": {"parallel.sync_mode": "local-sgd", "local_sgd.steps": "16"},
        "async wait s=0": {**async_, "parameter_server.stale_policy": "wait", "parameter_server.max_staleness": "0"},
        "async wait s=2": {**async_, "parameter_server.stale_policy": "wait", "parameter_server.max_staleness": "2"},
        "async wait s=8": {**async_, "parameter_server.stale_policy": "wait", "parameter_server.max_staleness": "8"},
        "async drop s=2": {**async_, "parameter_server.stale_policy": "drop", "parameter_server.max_staleness": "2"},
    }


def train(name: str, overrides: dict[str, str], nproc: int, samples: int) -> dict:
    per_update = MBS * (1 if "async" in name else nproc)
    args = {**overrides, "batch.micro_batch_size": str(MBS), "optim.lr_scaling": "sqrt",
            "optim.reference_batch_size": "24", "train.steps": str(samples // per_update),
            "optim.warmup_steps": str(WARMUP_SAMPLES // per_update),
            "train.eval_interval": str(EVAL_SAMPLES // per_update), "train.log_interval": "10",
            "checkpoint.interval": "0", "checkpoint.keep": "1"}
    with tempfile.TemporaryDirectory(prefix="meshtrain-sync-") as tmp:
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", str(nproc), "--out", f"{tmp}/run"]
        cmd += [tok for key, value in args.items() for tok in (f"--{key}", value)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
        summary = json.loads(Path(tmp, "run", "summary.json").read_text())
    evals = [{"samples": r["step"] * per_update, "val_loss": r["val_loss"], "elapsed_s": r["elapsed_s"]}
             for r in records if "val_loss" in r]
    speed = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return {"name": name, "per_update": per_update, "evals": evals, "tokens_per_s": statistics.median(speed),
            "async": summary.get("async")}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in results:
        style = "-" if r["name"].startswith("sync") else "--" if "local" in r["name"] else ":"
        for ax, key in zip(axes, ("samples", "elapsed_s")):
            ax.plot([e[key] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], style, marker="o",
                    markersize=3, label=r["name"])
    axes[0].set_xlabel("training samples seen")
    axes[1].set_xlabel("wall time (s, evaluations included)")
    axes[0].set_ylabel("val loss (nats/char)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Sync, local SGD and async parameter server on Tiny Shakespeare (same samples)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=28800)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    results = []
    for name, overrides in runs(args.nproc).items():
        results.append(train(name, overrides, args.nproc, args.samples))
        print(name, results[-1]["evals"][-1], flush=True)
    rows = []
    for r in results:
        last = r["evals"][-1]
        a = r["async"] or {}
        stale = f"{a['staleness_mean']:.2f} / {a['staleness_max']}" if a else "-"
        rows.append([r["name"], r["per_update"], f"{last['val_loss']:.4f}", f"{last['elapsed_s']:.0f}",
                     f"{r['tokens_per_s']:,.0f}", stale, a.get("dropped", "-") if a else "-"])
    plot(results, REPO / "docs" / "sync_modes.png")
    notes = [f"{args.nproc} ranks on this machine's cores; every run saw {args.samples:,} training samples of 64 "
             f"characters. Async: 1 server + {args.nproc - 1} workers (the server computes no gradients).",
             "tokens/s: median over the logged intervals (async: tokens of the gradients the server received).",
             "Plot: docs/sync_modes.png.",
             f"Command: python bench/bench_sync_modes.py --samples {args.samples} --nproc {args.nproc}"]
    path = write_results("sync_modes", "Sync vs local SGD vs async parameter server",
                         ["run", "samples / update", "final val loss", "wall s", "tokens/s",
                          "staleness mean / max", "dropped"], rows, notes, {"runs": results})
    print(path.read_text())


if __name__ == "__main__":
    main()
