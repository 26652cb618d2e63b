"""Train several layouts in one process group: ``torchrun --nproc-per-node N tests/layout_worker.py SPEC.json``.

A torchrun start costs seconds per launch on this machine (DESIGN.md), so the equality tests group
every layout of one world size into one launch. ``SPEC.json`` is ``[{"out": DIR, "overrides":
{"section.key": "value"}}, ...]``; for each entry every rank:

1. builds the trainer, runs the forward/backward of step 1 and saves the full gradients by
   parameter name (rank 0, ``DIR/grads_step1.pt``) -- the gradients the optimizer would see, after
   every reduction of the layout (DDP/FSDP over dp x sp, tp sums of sequence-parallel norms);
2. builds a fresh trainer from the same seed and trains the whole run (``DIR/metrics.jsonl`` and
   the final checkpoint), exactly as ``meshtrain train`` would.

:func:`run_in_process` runs them in the test process itself on one rank, for the reference.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.config import load_config
from meshtrain.parallel.data import unwrap
from meshtrain.parallel.reduce import reduce_partial_grads
from meshtrain.parallel.rng import seed_step
from meshtrain.train import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
GRADS_FILE = "grads_step1.pt"


def full_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (tp/FSDP shards gathered), keyed by the model's own names."""
    model = trainer.model
    reduce_partial_grads(model.parameters())
    out = {}
    for name, p in unwrap(model).named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone().cpu()
    return out


def run_layout(overrides: dict[str, str], out: Path) -> None:
    cfg = load_config(CONFIG, {**overrides, "train.out_dir": str(out)})
    trainer = Trainer(cfg)
    seed_step(trainer.model, cfg.train.seed, 1, trainer.rank, trainer.dims.tp)
    trainer.forward_backward(trainer.sampler.next_step())
    grads = full_gradients(trainer)
    if trainer.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(grads, out / GRADS_FILE)
    del trainer
    gc.collect()
    Trainer(cfg).run()
    gc.collect()


def run_layouts(spec: list[dict]) -> None:
    """Run every layout of ``spec`` in order on this rank (joins torchrun's group, or a 1-rank one)."""
    for entry in spec:
        run_layout(entry["overrides"], Path(entry["out"]))
        dist.barrier()


def run_in_process(spec: list[dict]) -> None:
    """:func:`run_layouts` in this process on one rank, then leave no process group behind."""
    try:
        run_layouts(spec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run_layouts(spec)
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
