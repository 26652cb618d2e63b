"""The training loop; run on every rank (``torchrun ... -m meshtrain.train CONFIG [--section.key VALUE ...]``).

One optimizer step = ``gradient_accumulation_steps`` forward/backward passes of ``micro_batch_size``
samples per dp rank (each sp rank holding 1/sp of every sample's tokens), gradient sync on the last
one only, global-norm clipping, AdamW, LR schedule (linear warmup, cosine decay to ``min_lr``). The
parallel strategies are applied by one call, :func:`meshtrain.parallel.parallelize` (pp split -> tp ->
sp -> dp); the loss and norm reductions are those of :mod:`meshtrain.parallel.reduce`.

Determinism: weights come from ``train.seed`` (built whole on every rank, then sharded); data order
from the sampler (layout-free state); dropout masks from generators reseeded every step
(:mod:`meshtrain.parallel.rng`), so a resumed run draws exactly what the uninterrupted run would
have drawn without saving RNG state.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a rank: from its first moment (torch takes seconds to import), a Ctrl-C or
    # SIGTERM is recorded for the loop to stop on, and the rank dies with its launcher
    from meshtrain.faults import STOP, die_with_parent

    STOP.install()
    if "LOCAL_RANK" in os.environ:
        die_with_parent()

import dataclasses
import gc
import math
import resource
import signal
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from meshtrain import checkpoint as ckpt
from meshtrain.batch import global_batch_size, scaled_lr
from meshtrain.config import Config, ConfigError, OptimConfig, load_config, parse_overrides, resolve_world
from meshtrain.data.corpus import load_corpus
from meshtrain.data.sampler import ShardedSampler, eval_batches
from meshtrain.faults import LAUNCHER_PID_ENV, STOP, Stopped, describe_collective_error, die_with_parent
from meshtrain.launch import preflight
from meshtrain.mesh import BATCH_MESH, Axis, ParallelDims, autocast, compute_dtype, device_and_backend, init_distributed
from meshtrain.fileio import write_json_atomic
from meshtrain.metrics import MetricsLog, plot_loss
from meshtrain.models import build_model
from meshtrain.optim import adamw_kernels
from meshtrain.parallel import local_batch, parallelize, parallelize_pipeline
from meshtrain.parallel.data import gradient_sync
from meshtrain.parallel.local_sgd import LocalSGD
from meshtrain.parallel.reduce import backward_context, batch_mean, clip_grad_norm_, cross_entropy, local_value
from meshtrain.parallel.rng import seed_step

SUMMARY_FILE = "summary.json"


class TrainingDiverged(RuntimeError):
    """``train.max_nonfinite_steps`` steps in a row had a NaN/inf loss or gradient norm; the message is one line."""

TIMING_WARMUP_STEPS = 3  # steps left out of the median step time (allocator and autotuning warm-up)


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a pipeline's last stage computes per micro-batch, inside the schedule's ``loss_parallel``
    (:class:`meshtrain.parallel.pipeline.Pipeline` enters it under tp): :func:`cross_entropy` as a plain
    tensor (``to_local`` of the replicated result, so that torch's schedules, which start the backward
    from a plain gradient, hand ``loss_parallel``'s backward a DTensor one)."""
    return local_value(cross_entropy(logits, targets, inside_loss_parallel=True))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr``.

    Warmup ``lr * (step+1) / (warmup_steps+1)``; cosine decay (Loshchilov & Hutter 2017, SGDR, Eq. 5,
    one cycle without restarts) from ``lr`` at ``warmup_steps`` to ``min_lr`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def scaled_optim(cfg: OptimConfig, global_batch_size: int) -> OptimConfig:
    """``cfg`` with ``lr`` and ``min_lr`` scaled to ``global_batch_size`` by ``cfg.lr_scaling``
    (:func:`meshtrain.batch.scaled_lr`); the warmup and the cosine shape are unchanged."""
    factor = scaled_lr(1.0, global_batch_size, cfg.reference_batch_size, cfg.lr_scaling)
    return dataclasses.replace(cfg, lr=cfg.lr * factor, min_lr=cfg.min_lr * factor)


def build_optimizer(params: Iterable[nn.Parameter], cfg: Config,
                    global_batch_size: int) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW over ``params`` with weight decay on matrices only (norm weights and biases undecayed), and
    its schedule, at the learning rate of ``global_batch_size`` (:func:`scaled_optim`)."""
    optim = scaled_optim(cfg.optim, global_batch_size)
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), **adamw_kernels(params, optim))
    scheduler = LambdaLR(optimizer, lambda s: lr_at(s, optim, cfg.train.steps) / optim.lr)
    return optimizer, scheduler


def compiles(cfg: Config, device_type: str) -> bool:
    """Whether ``train.compile`` compiles the blocks on ``device_type``: "auto" on CUDA only (on the CPU
    it measured no faster for the main job, docs/benchmarks.md); only a GPT at pp = tp = sp = 1, sync."""
    p = cfg.parallel
    eligible = (p.pp, p.tp, p.sp) == (1, 1, 1) and p.sync_mode != "async" and cfg.model.type == "gpt"
    return eligible and (cfg.train.compile == "on" or (cfg.train.compile == "auto" and device_type == "cuda"))


class Trainer:
    """Builds the mesh, model, optimizer and data for ``cfg`` on this rank and runs the loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device, backend = device_and_backend()
        self.rank, world = init_distributed(backend, cfg.train.collective_timeout_s)
        _, dp = resolve_world(cfg, world)
        self.dims = ParallelDims(pp=cfg.parallel.pp, dp=dp, sp=cfg.parallel.sp, tp=cfg.parallel.tp, world_size=world)
        self.dims.build_mesh(self.device.type)
        self.sp_rank = self.dims.rank_of(Axis.SP)
        self.world_ranks = list(range(world))
        self.batch_ranks = dist.get_process_group_ranks(self.dims.get_mesh(BATCH_MESH).get_group())
        self.corpus = load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)
        self.vocab_size = cfg.model.vocab_size or self.corpus.tokenizer.vocab_size
        if self.vocab_size < self.corpus.tokenizer.vocab_size:
            raise ConfigError(f"model.vocab_size = {self.vocab_size} is smaller than the corpus vocabulary "
                              f"({self.corpus.tokenizer.vocab_size}): use 0 or >= that")
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, self.vocab_size).to(self.device)
        b = cfg.batch
        self.pipeline = None
        if self.dims.pp_enabled:
            self.pipeline = parallelize_pipeline(model, self.dims, cfg.parallel, b.gradient_accumulation_steps,
                                                 b.gradient_accumulation_steps * b.micro_batch_size * cfg.model.block_size,
                                                 pipeline_loss)
            self.model = self.pipeline.model
        else:
            if compiles(cfg, self.device.type):
                for block in model.blocks.values():
                    block.compile()  # before DDP/FSDP2 wrap it, as torchtitan orders them; names unchanged
            self.model = parallelize(model, self.dims, cfg.parallel)
        p = cfg.parallel
        self.local_sgd = (LocalSGD(self.model, self.dims.get_mesh(BATCH_MESH).get_group(), p.local_sgd_steps,
                                   p.local_sgd_warmup) if p.sync_mode == "local-sgd" else None)
        self.replicas_equal = True
        """False while local-SGD replicas hold different parameters (between two averages)."""
        batch = global_batch_size(b.micro_batch_size, b.gradient_accumulation_steps, dp)
        self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), cfg, batch)
        dp_rank = self.dims.rank_of(Axis.DP)
        self.sampler = ShardedSampler(self.corpus.train, cfg.model.block_size, b.micro_batch_size,
                                      b.gradient_accumulation_steps, dp, dp_rank, cfg.train.seed)
        self.val = eval_batches(self.corpus.val, cfg.model.block_size, b.micro_batch_size, cfg.train.eval_steps,
                                dp, dp_rank, cfg.train.seed)
        self.out_dir = Path(cfg.train.out_dir)
        self.start_step = self._maybe_resume()
        self.dtype = compute_dtype(cfg.train.dtype, self.device.type)
        self.autocast = autocast(self.dtype, self.device.type)

    def _maybe_resume(self) -> int:
        path = resume_checkpoint(self.cfg)
        if path is None:
            return 0
        meta = ckpt.load(path, self.model, self.optimizer,
                         aliases={"lm_head.weight": "tok_emb.weight"})  # the tied weight, by its first name
        self.sampler.load_state_dict(meta["sampler"])
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.rank == 0:
            saved = " ".join(f"{axis}={meta.get(axis, 1)}" for axis in ("dp", "tp", "pp", "sp"))
            print(f"resumed from step {meta['step']} of {path} (saved at {saved}, global batch "
                  f"{meta.get('global_batch_size')}; now dp={self.dims.dp} tp={self.dims.tp} pp={self.dims.pp} "
                  f"sp={self.dims.sp}, global batch {self.sampler.global_batch_size})", file=sys.stderr, flush=True)
        return int(meta["step"])

    def _local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's sp shard of ``x, y`` (B, T): (B, T/sp) each, and their positions (T/sp,)."""
        return local_batch(x.to(self.device), y.to(self.device), self.dims, self.sp_rank, self.cfg.parallel.sp_mode)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over this rank's tokens of the micro-batch ``x, y`` (mbs, T) (its sp shard of them)."""
        x, y, positions = self._local(x, y)  # (mbs, T/sp) each, positions (T/sp,)
        with self.autocast:
            logits = self.model(x, positions)  # (mbs, T/sp, V), a vocab-sharded DTensor under tp
        return cross_entropy(logits, y)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; return this rank's mean loss (a scalar tensor; with
        pp > 1 the pipeline's micro-batches, the loss on the last stage and 0 on the others)."""
        if self.pipeline is not None:
            x, y, positions = self._local(torch.cat([mb[0] for mb in micro_batches]),
                                          torch.cat([mb[1] for mb in micro_batches]))  # (GA*mbs, T/sp)
            with self.autocast:
                return self.pipeline.step(x, y, positions)
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        for i, (x, y) in enumerate(micro_batches):
            with gradient_sync(self.model, enabled=i == n - 1):
                loss = self._loss(x, y)
                with backward_context(loss):
                    (loss / n).backward()
            total += local_value(loss).detach()
        return total / n

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over every token of the validation set (all dp and sp ranks)."""
        self.model.eval()
        if self.pipeline is not None:
            with self.autocast:
                total = self.pipeline.evaluate([self._local(x, y) for x, y in self.val])
        else:
            total = torch.zeros((), device=self.device)
            for x, y in self.val:
                total += local_value(self._loss(x, y))
        self.model.train()
        return batch_mean(total / len(self.val), self.dims)

    def clip_gradients(self) -> float:
        """Clip to ``optim.grad_clip`` by the norm over every rank's gradients; return the norm."""
        if self.pipeline is None:
            return clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        return clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip,
                               pp_group=self.dims.get_mesh(Axis.PP).get_group(), uncounted=self.pipeline.head_copy())

    def save(self, step: int) -> Path:
        """Checkpoint this step (local SGD: the replicas' average; it is also an averaging point); return
        the committed step folder."""
        if not self.replicas_equal:
            self.local_sgd.average_now(self.model.parameters())
            self.replicas_equal = True
        meta = {"config": self.cfg.to_dict(), "tokenizer": self.corpus.tokenizer.to_dict(),
                "corpus_sha256": self.corpus.sha256,
                "vocab_size": self.vocab_size, "sampler": self.sampler.state_dict(),
                "scheduler": self.scheduler.state_dict(), "world_size": self.dims.world_size,
                "dp": self.dims.dp, "tp": self.dims.tp, "sp": self.dims.sp, "pp": self.dims.pp,
                "global_batch_size": self.sampler.global_batch_size}
        return ckpt.save(self.out_dir, step, self.model, self.optimizer, meta, keep=self.cfg.checkpoint.keep)

    def run(self) -> dict[str, Any]:
        """Train from ``start_step`` to ``train.steps``; return a summary (rank 0's view)."""
        t, c = self.cfg.train, self.cfg.checkpoint
        at(f"the stop check before step {self.start_step + 1}", self.world_ranks)
        signum = STOP.agreed(self.device)
        if signum:  # stopped while starting: nothing is written (a resumed run keeps its checkpoint)
            raise Stopped(signum, self.start_step, t.steps, None)
        log = MetricsLog(self.out_dir, self.rank == 0, self.start_step, t.steps)
        tokens_per_step = self.sampler.global_batch_size * self.cfg.model.block_size
        step_times: list[float] = []
        val_loss = None
        nonfinite = 0
        mark = time.perf_counter()
        try:
            for step in range(self.start_step + 1, t.steps + 1):
                # A step's time runs from the end of the previous one, so the previous step's log write and
                # stop check count, as in a hand-written loop timed step to step; evaluation and checkpoint
                # saves (every eval_interval / checkpoint.interval steps) do not.
                t0 = mark
                seed_step(self.model, t.seed, step, self.rank, self.dims.tp)
                lr = self.scheduler.get_last_lr()[0]
                at(f"step {step}: forward/backward", self.world_ranks)
                local_loss = self.forward_backward(self.sampler.next_step())
                at(f"step {step}: gradient norm all-reduce", self.world_ranks)
                grad_norm = self.clip_gradients()
                at(f"step {step}: loss all-reduce", self.batch_ranks)
                loss = batch_mean(local_loss, self.dims)  # the same on every rank, as grad_norm: all skip together
                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                if finite:
                    self.optimizer.step()
                    if self.local_sgd is not None:
                        self.replicas_equal = self.local_sgd.after_step(self.model.parameters())
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                nonfinite = 0 if finite else nonfinite + 1
                dt = time.perf_counter() - t0
                if step > self.start_step + TIMING_WARMUP_STEPS:
                    step_times.append(dt)
                last = step == t.steps
                record = None
                if step % t.log_interval == 0 or last or not finite:
                    record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                              "grad_norm": grad_norm, "step_time_s": dt}
                    if not finite:
                        record["skipped"] = True  # no update: a NaN/inf loss or gradient norm
                log.step(step, record)
                if nonfinite >= t.max_nonfinite_steps:
                    kept = ckpt.list_checkpoints(self.out_dir)
                    raise TrainingDiverged(
                        f"{nonfinite} steps in a row (up to step {step}) had a non-finite loss ({loss}) or gradient "
                        f"norm ({grad_norm}), so none of them updated the model; stopped. Newest checkpoint: "
                        f"{kept[-1] if kept else 'none'}. Lower optim.lr, or check the data")
                periodic = time.perf_counter()
                if last or (t.eval_interval and step % t.eval_interval == 0):
                    at(f"step {step}: evaluation", self.world_ranks)
                    val_loss = self.evaluate()
                    log.eval(step, val_loss)
                saved = None
                if last or (c.interval and step % c.interval == 0):
                    at(f"step {step}: checkpoint save", self.world_ranks)
                    saved = self.save(step)
                periodic = time.perf_counter() - periodic
                if not last:
                    at(f"step {step}: the stop check", self.world_ranks)
                    signum = STOP.agreed(self.device)  # every rank stops after the same step
                    if signum:
                        if saved is None:
                            at(f"step {step}: checkpoint save on {signal.Signals(signum).name}", self.world_ranks)
                            saved = self.save(step)
                        raise Stopped(signum, step, t.steps, saved)
                mark = time.perf_counter() - periodic
        finally:
            log.close()
        return self._finish(step_times, val_loss, tokens_per_step)

    def _finish(self, step_times: list[float], val_loss: float | None, tokens_per_step: int) -> dict[str, Any]:
        """Gather the run's summary (peak memory is the max over ranks); rank 0 writes ``OUT/summary.json``
        and the loss plot. Whatever launched the run compares it with the planner (``meshtrain.launch``)."""
        peak = torch.tensor([peak_memory_bytes(self.device)], dtype=torch.float64, device=self.device)  # nccl: on GPU
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        summary = {"val_loss": val_loss, "step_time_s": statistics.median(step_times) if step_times else None,
                   "peak_memory_bytes": int(peak.item()), "world_size": self.dims.world_size, "dp": self.dims.dp,
                   "tp": self.dims.tp, "sp": self.dims.sp, "vocab_size": self.vocab_size,
                   "device": self.device.type, "dtype": self.dtype,
                   "compiled": compiles(self.cfg, self.device.type)}
        if summary["step_time_s"]:
            summary["tokens_per_s"] = tokens_per_step / summary["step_time_s"]
        if self.pipeline is not None:
            summary["pp"] = self.dims.pp
            summary["pipeline"] = self.pipeline.report(self.out_dir, TIMING_WARMUP_STEPS)
        if self.rank == 0:
            plot_loss(self.out_dir)
            write_json_atomic(self.out_dir / SUMMARY_FILE, summary)
        return summary


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size (ru_maxrss, KiB) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg`` on this process's rank (joins torchrun's group, or a 1-rank group without torchrun).

    On success, and on a stop all ranks agreed on (:class:`meshtrain.faults.Stopped`), every rank meets
    at a barrier before the process group is destroyed, so that no rank tears down gloo's worker
    threads while a peer still has collectives in flight (a rank that exits early can otherwise abort
    with "terminate called without an active exception").

    Raises:
        Stopped: SIGTERM/SIGINT; the synchronous trainer saved a checkpoint after the step all ranks stopped at.
        TrainingDiverged: too many non-finite steps in a row.
    """
    finished, trainer = False, None
    try:
        if cfg.parallel.sync_mode == "async":
            from meshtrain.train_async import AsyncRun

            trainer = AsyncRun(cfg)
        else:
            trainer = Trainer(cfg)
        summary = trainer.run()
        finished = True
        return summary
    except Stopped:
        finished = not STOP.immediate  # the synchronous trainer's ranks all stopped after the same step
        raise
    finally:
        # FSDP/DDP state forms reference cycles that hold the process groups; free it while the
        # interpreter is whole rather than at exit.
        del trainer
        gc.collect()
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


def resume_checkpoint(cfg: Config) -> Path | None:
    """The step folder a rank resumes from: ``checkpoint.resume``, or, in ranks torchrun restarted after a
    failure, the newest checkpoint of this run's own output folder; None to start fresh."""
    resume = cfg.checkpoint.resume
    if elastic_restart() and ckpt.list_checkpoints(cfg.train.out_dir):
        resume = cfg.train.out_dir  # continue this run, not the checkpoint it started from
    return ckpt.resolve_checkpoint(resume) if resume else None


def elastic_restart() -> bool:
    """True in ranks that torchrun restarted after a failure (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


_PHASE: tuple[str, list[int]] = ("setup", [])
"""What this rank is doing and the global ranks it depends on, for :func:`main`'s one-line errors."""


def at(phase: str, ranks: list[int]) -> None:
    """Record the phase this rank enters (``"step 3: loss all-reduce"``) and the ranks its collectives wait on."""
    global _PHASE
    _PHASE = (phase, ranks)


def main(argv: list[str] | None = None) -> int:
    """``python -m meshtrain.train CONFIG [--section.key VALUE ...]`` on every rank (under torchrun).

    Exit codes: 0 done; 1 a collective failed because of another rank (one line; the failed rank prints
    its own error); 2 a bad config; 3 training diverged; 128 + N stopped by signal N after saving.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m meshtrain.train CONFIG [--section.key VALUE ...]", file=sys.stderr)
        return 2
    if "LOCAL_RANK" in os.environ and not STOP.installed:  # a rank started by torchrun: stop with the
        die_with_parent()  # launcher, never train on as an orphan (done on import when run as __main__)
    STOP.install()
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv[0], parse_overrides(argv[1:]))
        if not elastic_restart() and LAUNCHER_PID_ENV not in os.environ:  # the checks of `meshtrain train`
            # (which ran them once, before starting the ranks) for ranks started by torchrun itself; every rank
            # runs them before joining the group, so none can see another rank's new files
            preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        print(f"meshtrain train: error: {e}", file=sys.stderr)
        return 2
    STOP.install(immediate=cfg.parallel.sync_mode == "async")  # no step boundary the async ranks share
    try:
        if STOP.signum:  # while starting: every rank got it (torchrun signals each), none joins the group
            raise Stopped(STOP.signum, 0, cfg.train.steps, None)
        train(cfg)
    except TrainingDiverged as e:
        if rank == 0:  # every rank stops at the same step; one says why
            print(f"meshtrain train: error: {e}", file=sys.stderr)
        return 3
    except Stopped as e:
        if rank == 0:
            print(f"meshtrain train: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except RuntimeError as e:  # gloo's errors (DistBackendError is one) when a peer died or a wait timed out
        line = describe_collective_error(e, rank, *_PHASE, cfg.train.collective_timeout_s)
        if line is None:
            raise
        if not STOP.signum:  # after a stop signal, a peer that went first is expected, not news
            print(f"meshtrain train: error: {line}", file=sys.stderr, flush=True)
        return 128 + STOP.signum if STOP.signum else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
