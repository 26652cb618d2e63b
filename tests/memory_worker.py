"""Peak activation bytes of one training step of the trainer, tensor by tensor, beside the planner's:
``torchrun --nproc-per-node N tests/memory_worker.py OUT.json SEQ SP SP_MODE RECOMPUTE FFN_HIDDEN`` (or
:func:`measure` in one process).

The step's tensors are tracked with torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``): every tensor
allocated while the step runs, by its storage, so the peak is exact and deterministic (no allocator, no RSS). The
model's parameters and the optimizer are tracked as external, their bytes subtracted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama_tiny.toml"
VOCAB = 128
"""A small head, so that the layers' backward, not the loss, sets the peak."""


def measure(seq: int, sp: int, sp_mode: str, recompute: str, ffn_hidden: int, out: Path) -> dict:
    """{"measured", "planned"}: peak activation bytes on this rank of one forward + backward of the README's tiny Llama
    with 8 query and 4 kv heads, micro batch 1, fp32, and :func:`meshtrain.planner.memory.activation_bytes` of it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshtrain.config.load import load_config
    from meshtrain.planner.layout import Layout, meshtrain_framework
    from meshtrain.planner.memory import PRECISIONS, activation_bytes
    from meshtrain.planner.model_specs import from_config
    from meshtrain.train.loop import Trainer

    overrides = {"model.n_head": "8", "model.n_kv_head": "4", "model.block_size": str(seq),
                 "model.vocab_size": str(VOCAB), "model.ffn_hidden": str(ffn_hidden), "batch.micro_batch_size": "1",
                 "train.dtype": "float32", "train.recompute": recompute, "train.out_dir": str(out),
                 "train.check_memory": "false", "parallel.sp": str(sp), "parallel.sp_mode": sp_mode}
    if sp_mode == "usp":
        overrides["parallel.sp_ulysses"] = "2"
    cfg = load_config(CONFIG, overrides)
    trainer = Trainer(cfg)
    tracker = MemTracker()
    tracker.track_external(trainer.model, trainer.optimizer)
    with tracker:
        trainer.forward_backward(trainer.sampler.next_step())
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    measured = sum(v for k, v in peak.items() if k != "Total" and "PARAM" not in str(k))
    planned = activation_bytes(from_config(cfg, VOCAB), Layout.from_config(cfg, sp), PRECISIONS["fp32"],
                               meshtrain_framework(cfg, "cpu"), composite_norms=True)
    return {"measured": measured, "planned": planned}


def main() -> None:
    out, seq, sp, mode, recompute, ffn = sys.argv[1], *sys.argv[2:]
    result = measure(int(seq), int(sp), mode, recompute, int(ffn), Path(out).parent / "run")
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
