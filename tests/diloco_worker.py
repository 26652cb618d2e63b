"""Train DiLoCo runs in one process group and record every worker's loss of every inner step:
``torchrun --nproc-per-node N tests/diloco_worker.py SPEC.json`` (``SPEC.json`` as :mod:`layout_worker`'s).

``meshtrain train`` logs the first worker's loss; this records each worker's (the mean over its dp x sp ranks,
as the trainer computes it) into ``OUT/worker_losses.json``: ``{worker: [loss of step 1, step 2, ...]}``,
written by the first rank of each worker. The run itself is :class:`meshtrain.train.loop.Trainer`'s, unchanged.

A run whose folder is named :data:`DIVERGES` has its last worker's weights set to NaN once the trainer is built (the
outer weights taken), so that worker alone goes non-finite; each rank's ending (the step it stopped after, the
one-line message, whether its weights are finite) goes to ``OUT/stopped.json``.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.config.load import load_config
from meshtrain.parallel.reduce import batch_mean
from meshtrain.train.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
LOSSES_FILE = "worker_losses.json"
DIVERGES = "last-worker-diverges"
STOPPED_FILE = "stopped.json"


class RecordingTrainer(Trainer):
    """The trainer, keeping this worker's mean loss of every step."""

    def forward_backward(self, micro_batches):
        local = super().forward_backward(micro_batches)
        self.losses.append(batch_mean(local, self.dims))  # a collective of this worker's ranks, as the loop's
        return local


def run(entry: dict) -> None:
    out = Path(entry["out"])
    cfg = load_config(Path(entry.get("config", CONFIG)), {**entry["overrides"], "train.out_dir": str(out)})
    trainer = RecordingTrainer(cfg)
    trainer.losses = []
    if out.name == DIVERGES:
        return diverge(trainer, out)
    trainer.run()
    worker, first = trainer.dims.worker_of(trainer.rank), trainer.rank % trainer.dims.worker_size == 0
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, (worker, trainer.losses) if first else None)
    if trainer.rank == 0:
        (out / LOSSES_FILE).write_text(json.dumps({w: losses for w, losses in filter(None, records)}))


def diverge(trainer: Trainer, out: Path) -> None:
    """Run ``trainer`` with its last worker's weights NaN; record how each rank stopped (:data:`STOPPED_FILE`)."""
    from meshtrain.train.loop import TrainingDiverged

    if trainer.dims.worker_of(trainer.rank) == trainer.dims.workers - 1:
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.fill_(float("nan"))
    try:
        trainer.run()
        ending = {"step": None, "message": "", "finite": True}
    except TrainingDiverged as e:
        ending = {"step": len(trainer.losses), "message": str(e),
                  "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())}
    endings = [None] * dist.get_world_size()
    dist.all_gather_object(endings, ending)
    if trainer.rank == 0:
        (out / STOPPED_FILE).write_text(json.dumps(dict(enumerate(endings))))


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        for entry in spec:
            run(entry)
            gc.collect()  # the trainer's DDP/FSDP reference cycles hold gloo's groups: free them while every rank is here
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        gc.collect()  # else gloo's threads can be torn down at exit: "terminate called without an active exception"
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
