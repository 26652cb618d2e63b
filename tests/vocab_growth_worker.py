"""``torchrun --nproc-per-node N tests/vocab_growth_worker.py SPEC.json``: for each layout of ``SPEC.json`` (as
:mod:`layout_worker` reads it), the embedding and head a trainer starts with (whole: tp and FSDP2 shards gathered,
pipeline stages merged) into ``DIR/start_rows.pt`` on rank 0; then :func:`layout_worker.run_layouts` (losses,
step-1 gradients, the final checkpoint). :func:`start_rows_here` does the same in the test process, on one rank.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import layout_worker
from meshtrain.config.load import load_config
from meshtrain.models.resize import GROWN
from meshtrain.train.loop import Trainer

ROWS_FILE = "start_rows.pt"


def save_start_rows(spec: list[dict]) -> None:
    """Build each layout's trainer and save its starting ``tok_emb.weight`` and ``lm_head.weight`` (rank 0)."""
    for entry in spec:
        out = Path(entry["out"])
        cfg = load_config(Path(entry["config"]), {**entry["overrides"], "train.out_dir": str(out)})
        trainer = Trainer(cfg)
        mine = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in trainer.setup.model.named_parameters() if name in GROWN}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({k: v for part in gathered for k, v in part.items()}, out / ROWS_FILE)
        del trainer
        gc.collect()
        dist.barrier()


def start_rows_here(spec: list[dict]) -> None:
    """:func:`save_start_rows` then :func:`layout_worker.run_layouts` in this process, leaving no group behind."""
    try:
        save_start_rows(spec)
        layout_worker.run_layouts(spec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    save_start_rows(spec)
    layout_worker.main()


if __name__ == "__main__":
    main()
