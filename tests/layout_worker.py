"""Train several layouts in one process group: ``torchrun --nproc-per-node N tests/layout_worker.py SPEC.json``.

A torchrun start costs seconds per launch on this machine (docs/architecture.md), so the equality tests group
every layout of one world size into one launch. ``SPEC.json`` is ``[{"out": DIR, "overrides":
{"section.key": "value"}, "config": TOML (default: the main job's)}, ...]``; for each entry every rank:

1. builds the trainer, runs the forward/backward of step 1 and saves the full gradients by
   parameter name (rank 0, ``DIR/grads_step1.pt``) -- the gradients the optimizer would see, after
   every reduction of the layout (DDP/FSDP over dp x sp, tp sums of sequence-parallel norms);
2. builds a fresh trainer from the same seed and trains the whole run (``DIR/metrics.jsonl`` and
   the final checkpoint), exactly as ``meshtrain train`` would.

:func:`run_in_process` runs them in the test process itself on one rank, for the reference.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.config.load import load_config
from meshtrain.parallel.model import ReplicatedModel
from meshtrain.parallel.reduce import reduce_partial_grads
from meshtrain.parallel.rng import seed_step
from meshtrain.train.loop import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
GRADS_FILE = "grads_step1.pt"


def full_gradients(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """Every parameter's whole gradient (tp/FSDP shards gathered, pipeline stages merged on rank 0),
    keyed by the model's own names; None on ranks other than 0. A pipeline's second copy of the tied
    embedding (``lm_head.weight`` off the first stage) is left out, as one process lists the tied
    weight once."""
    model = trainer.setup.model  # the module DDP wraps; FSDP2 and tp shard it in place, a pipeline prunes it
    reduce_partial_grads(model.parameters())
    out = {}
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and not model.share_embedding:
            continue
        g = p.grad
        if g is None:  # frozen (a LoRA run's base)
            continue
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone().cpu()
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(out, gathered, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if gathered else None


def _per_micro_batch_mean(model, *micro_batch):
    """Sabotage (the bug of transformers' gradient accumulation until 4.46): each micro-batch's own mean loss."""
    main, mtp, count = _LM_LOSS(model, *micro_batch)
    return main / count.clamp(min=1), mtp, count


_LM_LOSS = ReplicatedModel.lm_loss
SABOTAGES = {"per-micro-batch-mean": {"lm_loss": _per_micro_batch_mean, "step_scale": lambda model, micro_batches: 1.0}}
"""Wrong reductions a test may ask for (``"sabotage"`` in a layout's overrides), to show its comparison fails them."""


@contextlib.contextmanager
def sabotaged(name: str | None):
    """Within it, :class:`ReplicatedModel` computes the loss the sabotage ``name`` says (nothing when None)."""
    saved = {attr: getattr(ReplicatedModel, attr) for attr in SABOTAGES.get(name, {})}
    for attr, value in SABOTAGES.get(name, {}).items():
        setattr(ReplicatedModel, attr, value)
    try:
        yield
    finally:
        for attr, value in saved.items():
            setattr(ReplicatedModel, attr, value)


def run_layout(overrides: dict[str, str], out: Path, config: Path = CONFIG) -> None:
    overrides = dict(overrides)
    with sabotaged(overrides.pop("sabotage", None)):
        _run_layout(overrides, out, config)


def _run_layout(overrides: dict[str, str], out: Path, config: Path = CONFIG) -> None:
    cfg = load_config(config, {**overrides, "train.out_dir": str(out)})
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
        run_layout(entry["overrides"], Path(entry["out"]), Path(entry.get("config", CONFIG)))
        dist.barrier()


def run_in_process(spec: list[dict]) -> None:
    """:func:`run_layouts` in this process on one rank, then leave no process group behind."""
    try:
        run_layouts(spec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def load_result(out: Path) -> tuple[dict, dict, dict]:
    """(losses by step, step-1 gradients, final parameters) of a layout trained into ``out``."""
    from conftest import final_params, losses, read_records

    return losses(read_records(out)), torch.load(out / GRADS_FILE), final_params(out)


def reference_run(out: Path, overrides: dict[str, str], config: Path = CONFIG) -> tuple[dict, dict, dict]:
    """Train ``overrides`` of ``config`` in this process on one rank into ``out``; return :func:`load_result`."""
    run_in_process([{"out": str(out), "overrides": overrides, "config": str(config)}])
    return load_result(Path(out))


def launch_layouts(world: int, root: Path, layouts: dict[str, dict[str, str]],
                   config: Path = CONFIG, worker: Path = Path(__file__), results: bool = True) -> dict[str, tuple]:
    """Train every layout (name -> overrides of ``config``) on ``world`` gloo ranks in one torchrun launch into
    ``root/NAME``; return {name: :func:`load_result`} (``results=False``: {}, for a worker that writes other
    files). ``worker``: the script torchrun runs (this one, or one that wraps its :func:`main`)."""
    spec = [{"out": str(root / name), "overrides": overrides, "config": str(config)}
            for name, overrides in layouts.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                           str(worker), str(root / "spec.json")], capture_output=True, text=True, timeout=1200, env=env,
                          cwd=CONFIG.parents[1])
    first = proc.stderr.find("Traceback")  # the failing rank's own error, before its peers' follow-ups
    assert proc.returncode == 0, proc.stderr[max(first, 0):][:6000] + "\n...\n" + proc.stderr[-3000:]
    return {name: load_result(root / name) for name in layouts} if results else {}


def layout_launcher(tmp_path_factory, model: dict[str, str], layouts: dict[str, tuple[int, dict[str, str]]],
                    prefix: str, worker: Path = Path(__file__)):
    """``get(world)``: {name: :func:`load_result`} of every layout of ``layouts`` (name -> (world size,
    overrides on top of ``model``)) of that world size, launched once per world size (by ``worker``) and cached."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict[str, tuple]:
        if world not in cache:
            cache[world] = launch_layouts(world, tmp_path_factory.mktemp(f"{prefix}{world}"),
                                          {n: {**model, **o} for n, (w, o) in layouts.items() if w == world},
                                          worker=worker)
        return cache[world]
    return get


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run_layouts(spec)
    except BaseException:
        traceback.print_exc()  # now: the peers may hang in the barrier below until torchrun's timeout
        raise
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
