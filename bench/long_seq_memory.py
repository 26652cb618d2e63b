"""Peak memory per rank of ``configs/shakespeare_long.toml`` (block 2048) for sp = 1, 2, 4 in both modes,
at the same global batch (4 samples), next to the planner's prediction.

    python bench/long_seq_memory.py [--steps 2]     # writes bench/results/long_seq_memory.md and .json (~6 min)

Each layout runs twice through ``meshtrain train``, at micro batch 4 and at micro batch 1. Everything
but the activations (weights, gradients, AdamW states, the runtime) is the same in both, and the
activations are linear in the micro batch, so ``(peak(4) - peak(1)) * 4/3`` is the measured activation
memory of micro batch 4; the planner's ``activations`` term stands beside it. sp = 4 runs 4 ranks on
this 2-core machine: its memory is right, its speed is not measured here.
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

CONFIG = "configs/shakespeare_long.toml"
LAYOUTS = [("sp1", 1, "ulysses"), ("sp2 ulysses", 2, "ulysses"), ("sp2 ring", 2, "ring"),
           ("sp4 ulysses", 4, "ulysses"), ("sp4 ring", 4, "ring")]
MIB = 2**20


def run(sp: int, mode: str, mbs: int, steps: int) -> dict:
    """Train a few steps; return the run's summary.json and the planner's prediction for it."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.actual import predict_for_run

    with tempfile.TemporaryDirectory(prefix="meshtrain-mem-") as tmp:
        out = Path(tmp) / "run"
        overrides = {"parallel.sp": str(sp), "parallel.sp_mode": mode, "batch.micro_batch_size": str(mbs),
                     "train.steps": str(steps), "train.eval_interval": "0", "train.eval_steps": "1",
                     "checkpoint.interval": "0", "train.out_dir": str(out)}
        cmd = [*meshtrain_command(), "train", CONFIG, "--nproc", str(sp)]
        cmd += [tok for key, value in overrides.items() for tok in (f"--{key}", value)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
        predicted = predict_for_run(load_config(REPO / CONFIG, overrides), sp, summary["vocab_size"], "cpu", threads=1)
    return {"summary": summary, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows, records, base = [], [], None
    for name, sp, mode in LAYOUTS:
        big, small = run(sp, mode, 4, args.steps), run(sp, mode, 1, args.steps)
        peak, peak1 = big["summary"]["peak_memory_bytes"], small["summary"]["peak_memory_bytes"]
        activations = (peak - peak1) * 4 / 3
        predicted_act = big["predicted"]["memory_breakdown_bytes"]["activations"]
        predicted_peak = big["predicted"]["peak_memory_bytes"]
        base = base or (activations, predicted_act)
        records.append({"name": name, "sp": sp, "sp_mode": mode, "mbs4": big, "mbs1": small,
                        "measured_activation_bytes": activations})
        rows.append([name, sp, f"{peak / MIB:.0f}", f"{predicted_peak / MIB:.0f}",
                     f"{(predicted_peak - peak) / peak:+.1%}", f"{activations / MIB:.0f}", f"{predicted_act / MIB:.0f}",
                     f"{activations / base[0]:.2f}", f"{1 / sp:.2f}"])
    notes = [f"{CONFIG}: 4 layers, 8 heads, 128 wide, block 2048; global batch 4 samples (8,192 tokens), "
             f"fp32, {args.steps} steps, 1 thread per rank; peak = max over ranks of ru_maxrss.",
             "measured activations = (peak at micro batch 4 - peak at micro batch 1) * 4/3; "
             "predicted = the planner's activation term (memory_breakdown_bytes.activations)."]
    path = write_results("long_seq_memory", "Peak memory per rank at block 2048: sp = 1, 2, 4",
                         ["layout", "ranks", "measured peak MiB/rank", "predicted peak MiB/rank", "error",
                          "measured activations MiB", "predicted activations MiB", "activations / sp1", "1/sp"],
                         rows, notes, {"layouts": records})
    print(path.read_text())


if __name__ == "__main__":
    main()
