"""What a user would write instead of meshtrain: the same GPT trained by hand-written loops.

    python bench/contenders.py plain OUT.json [--steps S] [--batch B] [--dtype float32|bfloat16]
    torchrun --nproc-per-node 2 bench/contenders.py ddp OUT.json ...
    accelerate launch --cpu --num_processes 2 bench/contenders.py accelerate OUT.json ...
    python bench/contenders.py fabric OUT.json --devices 2 ...     (Fabric starts its own processes)
    python bench/contenders.py plain OUT.json --device cuda --dtype bfloat16 --fused --set model.n_layer=24 ...
    python bench/contenders.py plain OUT.json --config configs/llama_tiny.toml --hf     (transformers' model)
    python bench/contenders.py plain OUT.json --steps 2000 --batch 12 --seed 1 --data-seed 1 --eval-interval 250 \
        [--windows meshtrain]     (bench/bench_seeds.py: a val curve; meshtrain's batches of `--seed 1`)

Every contender trains meshtrain's GPT of ``configs/shakespeare_char.toml`` (``meshtrain.models.GPT``:
the model is the same object, so only the loop around it differs), or the model of ``--config``; with
``--hf`` the model is ``transformers``' model of the config's family (``LlamaForCausalLM``, ``MixtralForCausalLM``,
...) holding the same initial weights, on the bundled Tiny Shakespeare,
global batch ``--batch`` samples of block_size tokens split over the ranks, AdamW with the config's
hyperparameters, weight decay on matrices only, linear warmup then cosine (meshtrain's ``lr_at``),
global-norm clipping at 1.0, ``--steps`` steps. Batches are random windows drawn from a generator
seeded per rank (the way nanoGPT's ``get_batch`` does), the val loss is the mean over the same
fixed val windows for everyone. Rank 0 writes OUT.json: per-step seconds, peak RSS per rank, val loss.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "shakespeare_char.toml"
VAL_WINDOWS = 96
"""Val loss: the mean over these many fixed windows of the val split (the same for every contender)."""


def setup(args):
    """(config, corpus, model) of the main job with ``args.set`` overrides (``model.n_layer=24``, ...), the
    model's weights drawn from ``args.seed``, on ``args.device``."""
    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import load_corpus
    from meshtrain.models.build import build_model

    overrides = dict(kv.split("=", 1) for kv in args.set)
    cfg = load_config(args.config, {"train.steps": str(args.steps), **overrides})
    corpus = load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)
    torch.manual_seed(args.seed)
    model = build_model(cfg.model, cfg.model.vocab_size or corpus.tokenizer.vocab_size)
    if args.hf:
        model = HFLogits(model)
    return cfg, corpus, model.to(args.device)


class HFLogits(torch.nn.Module):
    """The ``transformers`` model of ``ours``'s family (``LlamaForCausalLM``, ``MixtralForCausalLM``, ...) holding
    ``ours``'s weights (the same initial point: meshtrain's Hugging Face export, loaded by ``from_pretrained``),
    called as meshtrain's models are: token ids (B, T) -> logits (B, T, V). ``transformers`` picks its own
    kernels (for experts: ``torch._grouped_mm`` where it can)."""

    def __init__(self, ours) -> None:
        import tempfile

        from transformers import AutoModelForCausalLM

        from meshtrain.models.hf import write_hf_folder

        super().__init__()
        with tempfile.TemporaryDirectory(prefix="meshtrain-hf-") as tmp:
            folder = Path(tmp) / "model"
            write_hf_folder(folder, ours.state_dict(), ours.cfg, ours.vocab_size, None, max_shard_bytes=2**40)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.train()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def optimizer_for(model: torch.nn.Module, cfg, fused: bool = False):
    """AdamW (decay on matrices only) and meshtrain's warmup + cosine schedule."""
    from meshtrain.optim.schedule import lr_at

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                  **({"fused": True} if fused else {}))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg.optim, cfg.train.steps) / cfg.optim.lr)
    return optimizer, scheduler


def get_batch(data: torch.Tensor, batch: int, block: int, generator: torch.Generator):
    """``batch`` random windows of ``data``: x (batch, block), y the next tokens."""
    start = torch.randint(len(data) - block - 1, (batch,), generator=generator)
    x = torch.stack([data[i:i + block] for i in start.tolist()])
    y = torch.stack([data[i + 1:i + 1 + block] for i in start.tolist()])
    return x, y


@torch.no_grad()
def val_loss(model: torch.nn.Module, corpus, block: int, chunk: int = VAL_WINDOWS, windows: int = VAL_WINDOWS) -> float:
    """Mean loss over ``windows`` evenly spaced windows of the val split (fp32, ``chunk`` windows at a time);
    ``windows = 0``: every non-overlapping window of the split (all of it but a tail shorter than a window,
    ~1,740 windows of 64 tokens for the main job: the val loss without the sampling noise of a few windows)."""
    model.eval()
    data, device = corpus.val, next(model.parameters()).device
    if windows:
        starts = torch.linspace(0, len(data) - block - 2, windows).long().tolist()
    else:
        starts = list(range(0, len(data) - block - 1, block))
    total = 0.0
    for i in range(0, len(starts), chunk):
        x = torch.stack([data[j:j + block] for j in starts[i:i + chunk]]).to(device)
        y = torch.stack([data[j + 1:j + 1 + block] for j in starts[i:i + chunk]]).to(device)
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
    model.train()
    return total / (len(starts) * block)


def peak_rss() -> int:
    """Peak resident set size of this process, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_loop(model, optimizer, scheduler, corpus, cfg, steps: int, batch: int, rank: int, dtype: str,
               backward=lambda loss: loss.backward(), clip=None, data_seed: int = 1000,
               on_step=None, batches=None) -> list[float]:
    """The loop everyone writes: get a batch, forward, loss, backward, clip, step. Returns seconds per step.
    Rank r draws its batches from a generator seeded ``data_seed + r`` (or calls ``batches()`` for each step's
    (x, y)); ``on_step(step)`` (1-based, e.g. an evaluation) runs after each step, outside its time."""
    generator = torch.Generator().manual_seed(data_seed + rank)
    batches = batches or (lambda: get_batch(corpus.train, batch, cfg.model.block_size, generator))
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    clip = clip or (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = batches()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        backward(loss)
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the step's kernels are done: its time is real
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(len(times))
    return times


def report(out: str, times: list[float], model, corpus, cfg, world: int, gather=None, extra: dict | None = None) -> None:
    """Rank 0 writes the result (with ``extra`` fields); ``gather`` collects every rank's peak RSS (default: this
    process's only)."""
    rss = gather(peak_rss()) if gather else [peak_rss()]
    result = {**(extra or {}), "step_times_s": times, "peak_rss_bytes": rss, "world_size": world, "threads": torch.get_num_threads(),
              "val_loss": val_loss(model, corpus, cfg.model.block_size, chunk=8 if torch.cuda.is_available() else 96)}
    if torch.cuda.is_available():
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    Path(out).write_text(json.dumps(result))


def run_plain(args) -> None:
    cfg, corpus, model = setup(args)
    optimizer, scheduler = optimizer_for(model, cfg, fused=args.fused)
    if args.compile:
        model.compile()
    curve = []  # --eval-interval: [step, val loss on the whole val split, on the VAL_WINDOWS windows]

    def evaluate(step: int) -> None:
        if args.eval_interval and (step % args.eval_interval == 0 or step == args.steps):
            block = cfg.model.block_size
            curve.append([step, val_loss(model, corpus, block, windows=0), val_loss(model, corpus, block)])

    from meshtrain.data.sampler import ShardedSampler

    # --windows meshtrain: meshtrain's sampler at seed DATA_SEED, the batches of `meshtrain train --seed DATA_SEED`
    sampler = ShardedSampler(corpus.train, cfg.model.block_size, args.batch, 1, 1, 0, args.data_seed)

    def sampler_batch():
        return sampler.next_step()[0]  # the step's one micro-batch (x, y)

    times = train_loop(model, optimizer, scheduler, corpus, cfg, args.steps, args.batch, 0, args.dtype,
                       data_seed=args.data_seed, on_step=evaluate,
                       batches=sampler_batch if args.windows == "meshtrain" else None)
    report(args.out, times, model, corpus, cfg, 1, extra={"val_curve": curve} if curve else None)


def _gather_ints(value: int) -> list[int]:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_ddp(args) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, corpus, model = setup(args)
    ddp = DDP(model)
    optimizer, scheduler = optimizer_for(ddp, cfg, fused=args.fused)
    times = train_loop(ddp, optimizer, scheduler, corpus, cfg, args.steps, args.batch // world, rank, args.dtype)
    rss = _gather_ints(peak_rss())
    if rank == 0:
        report(args.out, times, model, corpus, cfg, world, gather=lambda _: rss)
    dist.barrier()  # no rank tears gloo down while another still talks (it aborts: "terminate called ...")
    dist.destroy_process_group()


def run_accelerate(args) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.dtype == "bfloat16" else "no")
    cfg, corpus, model = setup(args)
    optimizer, scheduler = optimizer_for(model, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    world, rank = accelerator.num_processes, accelerator.process_index
    times = train_loop(model, optimizer, scheduler, corpus, cfg, args.steps, args.batch // world, rank, "float32",
                       backward=accelerator.backward,
                       clip=lambda: accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
    rss = accelerator.gather_for_metrics([peak_rss()]) if world > 1 else [peak_rss()]
    if accelerator.is_main_process:
        report(args.out, times, accelerator.unwrap_model(model), corpus, cfg, world, gather=lambda _: list(rss))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run_fabric(args) -> None:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                      precision="bf16-mixed" if args.dtype == "bfloat16" else "32-true")
    fabric.launch()
    cfg, corpus, model = setup(args)
    optimizer, scheduler = optimizer_for(model, cfg)
    model, optimizer = fabric.setup(model, optimizer)
    world, rank = fabric.world_size, fabric.global_rank
    times = train_loop(model, optimizer, scheduler, corpus, cfg, args.steps, args.batch // world, rank, "float32",
                       backward=fabric.backward,
                       clip=lambda: fabric.clip_gradients(model, optimizer, max_norm=cfg.optim.grad_clip))
    rss = fabric.all_gather(torch.tensor(peak_rss())).reshape(-1).tolist() if world > 1 else [peak_rss()]
    if rank == 0:
        report(args.out, times, model.module if hasattr(model, "module") else model, corpus, cfg, world,
               gather=lambda _: rss)
    fabric.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contender", choices=["plain", "ddp", "accelerate", "fabric"])
    parser.add_argument("out", help="result JSON (written by rank 0)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=24, help="global batch, samples")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=1337, help="initial weights (torch.manual_seed before the build)")
    parser.add_argument("--data-seed", type=int, default=1000,
                        help="batch order: rank r draws its windows from a generator seeded DATA_SEED + r")
    parser.add_argument("--eval-interval", type=int, default=0,
                        help="plain: val loss every N steps and at the last (0 = at the end only), kept as val_curve")
    parser.add_argument("--windows", default="random", choices=["random", "meshtrain"],
                        help="plain: random windows (nanoGPT's get_batch), or meshtrain's sampler seeded DATA_SEED")
    parser.add_argument("--devices", type=int, default=1, help="fabric: processes it starts")
    parser.add_argument("--device", default="cpu", help="plain: cpu or cuda")
    parser.add_argument("--fused", action="store_true", help="plain, ddp: AdamW(fused=True)")
    parser.add_argument("--compile", action="store_true", help="plain: model.compile() (torch.compile)")
    parser.add_argument("--config", default=str(CONFIG), help="the training config whose model and data to use")
    parser.add_argument("--hf", action="store_true", help="train transformers' model of the config's family (LlamaForCausalLM, MixtralForCausalLM, ...)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. model.n_layer=24 (repeatable)")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    {"plain": run_plain, "ddp": run_ddp, "accelerate": run_accelerate, "fabric": run_fabric}[args.contender](args)


if __name__ == "__main__":
    sys.exit(main())
