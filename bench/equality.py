"""Equality with one process, measured: for every layout of ``tests/test_train_parallel.py``, the worst
relative loss error over its steps and the worst step-1 gradient error relative to the gradient norm.

    python bench/equality.py            # writes bench/results/equality.md and .json (~3 min on 2 cores)

The tests assert these against the contract's bounds (1e-5); this table shows how far inside them
each layout is. Same layouts, same launches (one torchrun launch per world size, gloo, CPU, fp32).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from common import REPO, write_results

sys.path.insert(0, str(REPO / "tests"))
from layout_worker import launch_layouts  # noqa: E402
from test_train_parallel import LAYOUTS, MODEL, run_reference  # noqa: E402


def errors(got: tuple, want: tuple) -> tuple[float, float]:
    """(max over steps of |loss - ref| / |ref|, max over elements of |grad - ref grad| / ||ref grad||)."""
    loss = max(abs(got[0][s] - want[0][s]) / abs(want[0][s]) for s in want[0])
    norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in want[1].values())))
    grad = max(float((got[1][n] - want[1][n]).abs().max()) for n in want[1]) / norm
    return loss, grad


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ref = run_reference(root / "ref")
        results = {}
        for world in sorted({w for w, _ in LAYOUTS.values()}):
            (root / f"w{world}").mkdir()
            results.update(launch_layouts(world, root / f"w{world}", {name: {**MODEL, **overrides} for name, (w, overrides)
                                                                       in LAYOUTS.items() if w == world}))
    rows, data = [], {}
    for name, (world, overrides) in LAYOUTS.items():
        loss, grad = errors(results[name], ref)
        data[name] = {"world_size": world, "overrides": overrides, "max_rel_loss_error": loss,
                      "max_grad_error_over_norm": grad}
        rows.append([name, world, f"{loss:.1e}", f"{grad:.1e}"])
    steps = MODEL["train.steps"]
    write_results("equality", "Every layout against one process (fp32, gloo, CPU)",
                  ["layout", "world_size", f"worst relative loss error ({steps} steps)",
                   "worst step-1 gradient error / gradient norm"], rows,
                  [f"Model: 2 layers, 4 heads, 32 wide, block 32; global batch 8; {steps} steps at lr 3e-3.",
                   "Contract (docs/architecture.md): both below 1e-5; tests/test_train_parallel.py asserts it."],
                  {"layouts": data})


if __name__ == "__main__":
    main()
