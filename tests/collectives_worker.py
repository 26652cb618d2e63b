"""Count the collectives of one training step in a ``torch.profiler`` trace, for several layouts.

``torchrun --nproc-per-node 2 tests/collectives_worker.py SPEC.json OUT.json``: SPEC is ``[{"name",
"overrides"}]``; for each layout every rank trains two steps (warm-up; DDP rebuilds its buckets
after the first), then profiles the next one (forward/backward of every micro-batch, gradient
clipping, the optimizer step) with DDP's gradient all-reduce switched off (``no_sync``): data
parallelism is the planner's ``dp_time``, checked against measurements by plan-vs-actual, and it
would hide the per-layer calls in one bucket whose size changes with the depth. Rank 0 writes
``{name: {"gloo:<op> <numel>": count}}``: gloo's record-function events, by the element count of
their input.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from meshtrain.config.load import load_config
from meshtrain.parallel.reduce import clip_grad_norm_
from meshtrain.parallel.rng import seed_step
from meshtrain.train.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"


def _step(trainer: Trainer, step: int) -> None:
    seed_step(trainer.model, 1, step, trainer.rank, trainer.dims.tp)
    trainer.forward_backward(trainer.sampler.next_step())
    clip_grad_norm_(trainer.model.parameters(), 1.0)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def count(overrides: dict[str, str]) -> dict[str, int]:
    trainer = Trainer(load_config(CONFIG, overrides))
    _step(trainer, 1)
    _step(trainer, 2)
    no_dp_sync = trainer.model.no_sync() if isinstance(trainer.model, DDP) else contextlib.nullcontext()
    with no_dp_sync, profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _step(trainer, 3)
    counts = Counter(f"{e.name} {math.prod(e.input_shapes[0])}" for e in prof.events()
                     if e.name.startswith("gloo:") and e.input_shapes and e.input_shapes[0])
    del trainer
    gc.collect()
    return dict(counts)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = {entry["name"]: count(entry["overrides"]) for entry in spec}
    if dist.get_rank() == 0:
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
