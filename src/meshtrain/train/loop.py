"""The synchronous training loop, the same on every rank whatever the layout.

One optimizer step = ``gradient_accumulation_steps`` forward/backward passes of ``micro_batch_size``
samples per dp rank (each sp rank holding 1/sp of every sample's tokens), gradient sync on the last
one only, global-norm clipping, AdamW, LR schedule (linear warmup, cosine decay to ``min_lr``;
:mod:`meshtrain.optim`). Every parallel strategy is chosen by one call,
:func:`meshtrain.parallel.compose.parallelize`, whose :class:`meshtrain.parallel.model.ParallelModel` runs the step;
the loss and norm reductions are those of :mod:`meshtrain.parallel.reduce`.

Determinism: weights come from ``train.seed`` (built whole on every rank, then sharded); data order
from the sampler (layout-free state); dropout masks from generators reseeded every step
(:mod:`meshtrain.parallel.rng`), so a resumed run draws exactly what the uninterrupted run would
have drawn without saving RNG state.
"""

from __future__ import annotations

import math
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain import axes
from meshtrain.adapters.saved import saved_modules, tied_embeddings
from meshtrain.adapters.spec import BASE_KEY, adapter_parameters, base_record
from meshtrain.checkpoint import store as ckpt
from meshtrain.checkpoint.writer import Checkpoints
from meshtrain.batch_math import tokens_per_step
from meshtrain.config.sections import Config
from meshtrain.data.conversations import Conversations
from meshtrain.data.sampler import ShardedSampler, eval_batches
from meshtrain.mesh import BATCH_MESH, Axis, ParallelDims
from meshtrain.metrics import TIMING_WARMUP_STEPS, MetricsLog, peak_memory_bytes, write_summary
from meshtrain.models.hf import load_hf_weights, source_hf_config
from meshtrain.models.resize import GrownRows
from meshtrain.optim.build import build_optimizer
from meshtrain.optim.qk_clip import QKClip
from meshtrain.parallel.compose import parallelize
from meshtrain.parallel.model import ParallelModel
from meshtrain.parallel.reduce import batch_mean, batch_sum, worker_mean
from meshtrain.parallel.rng import seed_step
from meshtrain.preflight import started_tensors
from meshtrain.profiling import StepProfiler
from meshtrain.resolved import ResolvedRun, config_of, for_world
from meshtrain.runtime.device import device_and_backend
from meshtrain.runtime.distributed import init_distributed
from meshtrain.runtime.faults import STOP, Stopped, enter_phase
from meshtrain.objectives import PAIR_METRICS
from meshtrain.train import reference
from meshtrain.train.setup import checkpoint_meta, run_summary, set_up



class TrainingDiverged(RuntimeError):
    """``train.max_nonfinite_steps`` steps in a row had a NaN/inf loss or gradient norm; the message is one line."""


class Trainer:
    """Builds the mesh, model, optimizer and data of a resolved run on this rank and runs the loop.

    ``run``: the launcher's :class:`~meshtrain.resolved.ResolvedRun`, or a :class:`~meshtrain.config.sections.Config`
    (ranks started without the launcher, tests), resolved here for the process group's world.
    """

    val_metrics: dict[str, float] = {}
    """DPO: the last evaluation's mean rewards, accuracy and margin over the validation pairs (``val_`` + the names of
    :data:`meshtrain.objectives.PAIR_METRICS`); empty otherwise."""

    adapter_base: dict | None = None
    """LoRA runs, on rank 0: what identifies the frozen base (:func:`meshtrain.adapters.spec.base_record`), kept in
    every checkpoint, which holds the adapters only."""

    source_hf_config: dict | None = None
    """The ``config.json`` of the Hugging Face model this run started from (``model.init_from``), kept in every
    checkpoint so that ``export --format hf`` carries what training does not change (:func:`meshtrain.models.hf.carried_config`)."""

    def __init__(self, run: ResolvedRun | Config) -> None:
        self.device, backend = device_and_backend()
        timeout = config_of(run).train.collective_timeout_s
        self.rank, world = init_distributed(backend, timeout)
        self.resolved = for_world(run, world)
        self.cfg = cfg = self.resolved.config
        dp, workers = self.resolved.dp, self.resolved.workers  # dp: every worker's replicas together
        self.dims = ParallelDims(**{**self.resolved.degrees, "dp": dp // workers}, world_size=world, workers=workers)
        self.dims.build_mesh(self.device.type)
        self.world_ranks = list(range(world))
        self.batch_ranks = dist.get_process_group_ranks(self.dims.get_mesh(BATCH_MESH).get_group())
        self.setup = set_up(cfg, self.device)
        conversations = isinstance(self.setup.corpus.train, Conversations)  # targets outside the loss
        quantized = cfg.adapter.quantize_base != "none"  # QLoRA: the base is quantized as the adapters are added
        grown = self.setup.growth and GrownRows(self.setup.growth.old, self.setup.growth.new, cfg.train.seed)
        if quantized and cfg.model.init_from:  # so read it first: whole, on each rank, then quantized
            load_hf_weights(self.setup.model, cfg.model.init_from, cfg.model, grown)
        self._say_adapters()
        self.parallel = parallelize(self.setup.model, self.dims, cfg, self.setup.autocast,
                                    eos_id=self.setup.corpus.tokenizer.eos_id,  # data.packing = "document" splits at it
                                    conversations=conversations)
        self.model = self.parallel.model
        """This rank's parameters (its pipeline stages, its tp/FSDP2 shards), wrapped as dp needs."""
        zero1 = cfg.parallel.zero_stage == 1 and len(self.batch_ranks) > 1  # AdamW states sharded over dp*sp
        self.optimizer, self.scheduler = build_optimizer(
            self.model.named_parameters(), cfg, self.resolved.global_batch_size,
            self.dims.get_mesh(BATCH_MESH).get_group() if zero1 else None)
        self.qk_clip = self._qk_clip()
        self._build_data(dp)
        self.out_dir = Path(cfg.train.out_dir)
        # DiLoCo: the outer weights are the model as it starts; elastic workers join the others (behind them, they
        # take over a living one's state and step)
        self.start_step = self.parallel.sync.start(self._maybe_resume(), self.optimizer, self.sampler, self.scheduler)
        c = cfg.checkpoint
        self.checkpoints = Checkpoints(self.out_dir, c.keep, c.async_save, cfg.train.collective_timeout_s, self.device)
        self._load_base(grown, quantized)
        self.reference: ParallelModel | None = None
        """``train.dpo_reference = "copy"``: the frozen copy of the starting weights (:mod:`meshtrain.train.reference`)
        that gives each step's micro-batches their reference log-probabilities; else None."""
        if cfg.train.objective == "dpo":
            self._set_reference(grown)

    def _qk_clip(self) -> QKClip | None:
        """``optim.qk_clip``'s observer of this rank's attention blocks, its maxima reduced over dp x sp and tp."""
        if not self.cfg.optim.qk_clip:
            return None
        groups = tuple(self.dims.get_mesh(axis).get_group() for axis, n in ((BATCH_MESH, len(self.batch_ranks)),
                                                                            (Axis.TP, self.dims.tp)) if n > 1)
        return QKClip(self.model, self.cfg.optim.qk_clip, self.dims.rank_of(Axis.TP), groups)

    def _say_adapters(self) -> None:
        """LoRA, on rank 0: how many adapter parameters train, how many of the modules trained beside them
        (``adapter.modules_to_save``: V x C each, a tied pair once), and how many of the base's are frozen."""
        a, m = self.cfg.adapter, self.cfg.model
        if a.lora_rank and self.rank == 0:
            n = adapter_parameters(m, list(a.lora_targets), a.lora_rank, a.use_dora)
            saved = saved_modules(m, list(a.modules_to_save))
            full = self.setup.vocab_size * m.n_embd * (1 if saved and tied_embeddings(m) else len(saved))
            beside = f" and {full:,} of {', '.join(a.modules_to_save)} in full" if saved else ""
            print(f"LoRA: {n:,} adapter parameters train (rank {a.lora_rank} on {', '.join(a.lora_targets)}){beside}; "
                  f"the base's{' other' if saved else ''} {self.setup.model.num_params() - full:,} are frozen", file=sys.stderr, flush=True)

    def _build_data(self, dp: int) -> None:
        """This rank's train sampler and validation batches: its share among the ``dp`` replicas of every worker (and
        DiLoCo's elastic workers' shares, :meth:`meshtrain.sync_mode.SyncMode.data_share`)."""
        cfg, b, corpus = self.cfg, self.cfg.batch, self.setup.corpus
        shares, worker = self.parallel.sync.data_share(self.dims, self.rank)
        dp_rank = worker * self.dims.dp + self.dims.rank_of(Axis.DP)  # among all workers'
        self.sampler = ShardedSampler(corpus.train, cfg.model.block_size, b.micro_batch_size,
                                      b.gradient_accumulation_steps, dp * shares, dp_rank, cfg.train.seed)
        self.val = eval_batches(corpus.val, cfg.model.block_size, b.micro_batch_size, cfg.train.eval_steps,
                                dp * shares, dp_rank, cfg.train.seed)
        if isinstance(corpus.train, Conversations) and self.rank == 0 and corpus.train.truncated:
            print(f"{corpus.train.truncated} of {corpus.train.conversations} train conversations are longer than a "
                  f"window (model.block_size + 1 = {cfg.model.block_size + 1} tokens): each keeps its first "
                  f"{cfg.model.block_size + 1} tokens, its tail is cut", file=sys.stderr, flush=True)

    def _load_base(self, grown: Any, quantized: bool) -> None:
        """``model.init_from``'s weights into this rank's slices when the run starts, and on every resume of adapters
        (the frozen base is not in their checkpoints; QLoRA read it before quantizing); what they came from."""
        cfg = self.cfg
        adapters = cfg.adapter.lora_rank > 0
        if cfg.model.init_from and (self.start_step == 0 or adapters) and not quantized:
            load_hf_weights(self.model, cfg.model.init_from, cfg.model, grown)  # each rank reads the slices it holds
            if grown and self.rank == 0:
                print(self.setup.growth.describe(cfg.model.init_from, cfg.train.seed, grown.sampled),
                      file=sys.stderr, flush=True)
        if cfg.model.init_from and (self.start_step == 0 or adapters):
            self.source_hf_config = self.source_hf_config or source_hf_config(cfg.model.init_from)
        if adapters and self.rank == 0:  # what a resume, export or generate checks the base against
            self.adapter_base = base_record(cfg.model.init_from, cfg.train.seed)

    def _set_reference(self, grown: Any) -> None:
        """DPO: the reference of the starting weights (:mod:`meshtrain.train.reference`): with
        ``train.dpo_reference = "copy"`` the frozen copy (rebuilt on a resume), else the log-probabilities of the
        train pairs, computed now or read back when resuming; and those of this rank's validation pairs."""
        seed_step(self.model, self.cfg.train.seed, 0, self.rank, self.dims.tp)  # tp's dropout regions want a seed
        if self.cfg.train.dpo_reference == "copy":
            self.reference = reference.reference_copy(self.cfg, self.dims, self.setup.vocab_size, self.device,
                                                      self.setup.autocast, grown)
            self.val = reference.with_reference(self.reference, self.val)
            return
        pairs, resumed = self.setup.corpus.train, ckpt.resume_checkpoint(self.cfg)
        if resumed is None:
            pairs.reference = reference.train_reference(self.parallel, pairs, self.dims, self.cfg.batch.micro_batch_size)
        else:
            pairs.reference = reference.load(resumed, self.setup.corpus.sha256, 2 * len(pairs))
        if self.rank == 0 and not (self.out_dir / reference.REFERENCE_FILE).exists():  # a resume into a new folder too
            reference.save(pairs.reference, self.out_dir, self.setup.corpus.sha256)
        self.val = reference.with_reference(self.parallel, self.val)

    @property
    def dtype(self) -> str:
        return self.setup.dtype

    def _maybe_resume(self) -> int:
        path = ckpt.resume_checkpoint(self.cfg)
        if path is None:
            return 0
        fresh = self.cfg.checkpoint.fresh_optimizer
        started, said = started_tensors(self.cfg, ckpt.read_meta(path), path)  # routing biases added: at 0
        meta = ckpt.load(path, self.model, self.optimizer,
                         aliases={"lm_head.weight": "tok_emb.weight"},  # the tied weight, by its first name
                         extra=self.parallel.sync.checkpointed(), fresh_optimizer=fresh, started=started)
        self.sampler.load_state_dict(meta["sampler"])
        if fresh:  # another optimizer's groups: the schedule continues at the checkpoint's step on this one's
            self.scheduler.last_epoch = int(meta["step"]) - 1
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
                self.scheduler.step()
        else:
            self.scheduler.load_state_dict(meta["scheduler"])
        self.source_hf_config = meta.get("source_hf_config")
        if self.rank == 0:
            saved = axes.describe({str(s.axis): meta.get(str(s.axis), 1) for s in axes.AXIS_TABLE})
            saved += f" in {meta['diloco_workers']} DiLoCo workers" if meta.get("diloco_workers", 1) > 1 else ""
            now = axes.describe(self._layout())
            now += f" in {self.dims.workers} DiLoCo workers" if self.dims.workers > 1 else ""
            print(f"resumed from step {meta['step']} of {path} (saved at {saved}, global batch "
                  f"{meta.get('global_batch_size')}; now {now}, global batch "
                  f"{self.sampler.global_batch_size})", file=sys.stderr, flush=True)
            if said:
                print(said, file=sys.stderr, flush=True)
        return int(meta["step"])

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; return this rank's mean loss (a scalar tensor; with
        pp > 1 the loss on the last stage and 0 on the others). DPO with a frozen copy: its forward gives the
        micro-batches' reference log-probabilities first."""
        if self.reference is not None:
            micro_batches = reference.with_reference(self.reference, micro_batches)
        return self.parallel.forward_backward(micro_batches)

    def evaluate(self) -> float:
        """Mean val loss over every supervised token of the validation set (all dp and sp ranks: their summed loss
        over their count; DiLoCo: of every worker's model on its share, the mean over workers)."""
        loss, count, *metrics = batch_sum(self.parallel.evaluate(self.val), self.dims).tolist()
        if metrics:  # DPO: each sp rank of a group counted the same pairs
            self.val_metrics = {f"val_{k}": v / max(count, 1.0) for k, v in zip(PAIR_METRICS, metrics)}
        return worker_mean(loss / max(count, 1.0), self.dims)

    def clip_gradients(self) -> float:
        """Clip to ``optim.grad_clip`` by the norm over every rank's gradients; return the norm."""
        return self.parallel.clip_gradients(self.cfg.optim.grad_clip)

    def _layout(self) -> dict[str, int]:
        """The run's layout as the config states it: ``dp`` over every replica (DiLoCo: its workers' dp together,
        ``diloco_workers`` beside it; ``dims.dp`` is one worker's)."""
        workers = {"diloco_workers": self.dims.workers} if self.dims.workers > 1 else {}
        return {"world_size": self.dims.world_size, **axes.as_dict(self.dims), "dp": self.dims.dp * self.dims.workers,
                **workers}

    def save(self, step: int, wait: bool = False) -> Path | None:
        """Checkpoint this step (local SGD: the replicas' average; it is also an averaging point); return
        the committed step folder, or None while ``checkpoint.async_save`` writes it in the background
        (``wait``: wait for that write and commit it). A step whose write is in flight is not saved twice."""
        saved = None
        if not self.parallel.sync.can_save(step):
            return self.checkpoints.wait() if wait else None  # an elastic worker between outer steps: no outer model
        if self.checkpoints.in_flight != step:
            self.parallel.consolidate(step)
            carried = {"source_hf_config": self.source_hf_config} if self.source_hf_config else {}
            if self.adapter_base is not None:
                carried[BASE_KEY] = self.adapter_base
            meta = checkpoint_meta(self.cfg, self.setup, self.sampler.state_dict(), self._layout(),
                                   self.sampler.global_batch_size, scheduler=self.scheduler.state_dict(), **carried)
            saved = self.checkpoints.save(step, self.model, self.optimizer, meta, extra=self.parallel.sync.checkpointed())
        return saved or (self.checkpoints.wait() if wait else None)

    def run(self) -> dict[str, Any]:
        """Train from ``start_step`` to ``train.steps``; return a summary (rank 0's view)."""
        t = self.cfg.train
        enter_phase(f"the stop check before step {self.start_step + 1}", self.world_ranks)
        signum = STOP.agreed(self.device)
        if signum:  # stopped while starting: nothing is written (a resumed run keeps its checkpoint)
            raise Stopped(signum, self.start_step, t.steps, None)
        log = MetricsLog(self.out_dir, self.rank == 0, self.start_step, t.steps, tensorboard=t.tensorboard)
        profiler = StepProfiler(t.profile_steps, self.out_dir, self.rank, self.device.type)
        rows = getattr(self.setup.corpus.train, "rows_per_sample", 1)  # a preference pair is two sequences
        tokens = tokens_per_step(self.sampler.global_batch_size * rows, self.cfg.model.block_size)
        step_times: list[float] = []
        val_loss = None
        self._nonfinite, self._streak = 0, None
        mark = time.perf_counter()
        try:
            for step in range(self.start_step + 1, t.steps + 1):
                # A step's time runs from the end of the previous one, so the previous step's log write and
                # stop check count, as in a hand-written loop timed step to step; evaluation and checkpoint
                # saves (every eval_interval / checkpoint.interval steps) do not.
                t0 = mark
                profiler.begin(step)
                loss, grad_norm, lr, stop = self._train_step(step)
                finite = math.isfinite(loss) and math.isfinite(grad_norm)
                dt = time.perf_counter() - t0
                if step > self.start_step + TIMING_WARMUP_STEPS:
                    step_times.append(dt)
                last = step == t.steps
                logged = step % t.log_interval == 0 or last or not finite
                log.step(step, self._record(step, loss, lr, grad_norm, dt, tokens) if logged else None)
                if stop is not None:  # train.max_nonfinite_steps, agreed by every rank
                    self._diverged(step, stop, loss)
                periodic = time.perf_counter()
                profiler.end(step)  # writes the trace after the last profiled step, untimed
                if last or (t.eval_interval and step % t.eval_interval == 0):
                    enter_phase(f"step {step}: evaluation", self.world_ranks)
                    val_loss = self.evaluate()
                    log.eval(step, val_loss, **self.val_metrics)
                saved = self._save_due(step, last)
                periodic = time.perf_counter() - periodic
                if not last:
                    self._stop_check(step, saved)
                mark = time.perf_counter() - periodic
        finally:
            profiler.close()
            log.close()
        summary = self._finish(step_times, val_loss, tokens)
        self.parallel.sync.close()  # elastic workers leave the quorum
        return summary

    def _train_step(self, step: int) -> tuple[float, float, float, str | None]:
        """One optimizer step on every rank: forward/backward of the step's micro-batches, the clipped gradient norm,
        the update (skipped by every rank alike when the loss or the norm is not finite), the LR schedule and the
        sync mode's hook, which takes this rank's vote to stop (``train.max_nonfinite_steps`` non-finite steps in a
        row, now or before). Returns ``(loss, grad_norm, lr, stop)``: the global batch's mean loss, the norm, the step's
        LR, and None, or who diverged when every rank agreed to stop now
        (:meth:`meshtrain.sync_mode.SyncMode.after_step`)."""
        seed_step(self.model, self.cfg.train.seed, step, self.rank, self.dims.tp)
        lr = self.scheduler.get_last_lr()[0]
        enter_phase(f"step {step}: forward/backward", self.world_ranks)
        local_loss = self.forward_backward(self.sampler.next_step())
        enter_phase(f"step {step}: gradient norm all-reduce", self.world_ranks)
        grad_norm = self.clip_gradients()
        enter_phase(f"step {step}: loss all-reduce", self.batch_ranks)
        loss = batch_mean(local_loss, self.dims)  # the same on every rank, as grad_norm: all skip together
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.parallel.after_optimizer_step()
            if self.qk_clip is not None:
                self.qk_clip.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self._nonfinite = 0 if finite else self._nonfinite + 1
        if self._nonfinite >= self.cfg.train.max_nonfinite_steps:
            self._streak = (self._nonfinite, step, loss, grad_norm)  # the vote stays until every rank agrees
        enter_phase(f"step {step}: {self.parallel.sync.phase or 'the end of the step'}", self.world_ranks)
        stop = self.parallel.end_step(step, self._streak is not None)
        return loss, grad_norm, lr, stop

    def _record(self, step: int, loss: float, lr: float, grad_norm: float, dt: float, tokens: int) -> dict[str, Any]:
        """The step's line of ``metrics.jsonl`` (``dt`` seconds, ``tokens`` per step)."""
        record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens / dt, "grad_norm": grad_norm,
                  "step_time_s": dt, "peak_memory_bytes": peak_memory_bytes(self.device.type)}  # rank 0's, so far
        if self.parallel.masked and self.parallel.dpo is None:  # the tokens the loss is the mean over
            record["supervised_tokens"] = self.parallel.supervised_tokens
        if self.parallel.dpo is not None:  # TRL's rewards/*, means over the global batch's pairs
            sums = batch_sum(self.parallel.pair_metrics, self.dims) / (self.parallel.pairs * self.dims.sp)
            record.update(zip(PAIR_METRICS, sums.tolist()), pairs=self.parallel.pairs)
        if self.qk_clip is not None:  # this rank's stage's largest attention logit and the heads QK-clip scaled
            record.update(qk_max_logit=self.qk_clip.last_max, qk_clipped_heads=self.qk_clip.last_clipped)
        if self.parallel.aux_loss is not None:  # the routers' load balancing, added to the loss's gradient
            record["aux_loss"] = batch_mean(self.parallel.aux_loss, self.dims)
        if self.parallel.mtp_loss is not None:  # DeepSeek-V3's multi-token prediction, added to the loss's gradient
            record["mtp_loss"] = batch_mean(self.parallel.mtp_loss, self.dims)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            record["skipped"] = True  # no update: a NaN/inf loss or gradient norm
        return record

    def _diverged(self, step: int, who: str, loss: float) -> None:
        """Raise TrainingDiverged once every rank agreed to stop after ``step`` (``who``: "" when every rank counted the
        same steps, else the DiLoCo workers that diverged), once the checkpoint being written is committed."""
        enter_phase(f"step {step}: waiting for the checkpoint write", self.world_ranks)
        self.checkpoints.wait()
        kept = ckpt.list_checkpoints(self.out_dir)
        fix = (f"Newest checkpoint: {kept[-1] if kept else 'none'}. Lower optim.lr{' or diloco.outer_lr' if who else ''}"
               f", or check the data")
        if self._streak is None:  # another DiLoCo worker diverged; this one had fewer non-finite steps in a row
            raise TrainingDiverged(
                f"{who} had train.max_nonfinite_steps = {self.cfg.train.max_nonfinite_steps} steps in a row with a "
                f"non-finite loss or gradient norm (this worker fewer; its last loss {loss}); every worker "
                f"stopped after step {step}, where they agreed. {fix}")
        nonfinite, upto, bad_loss, grad_norm = self._streak
        agreed = f" after step {step} with every worker ({who} diverged)" if who else ""
        raise TrainingDiverged(
            f"{nonfinite} steps in a row (up to step {upto}) had a non-finite loss ({bad_loss}) or gradient "
            f"norm ({grad_norm}), so none of them updated the model; stopped{agreed}. {fix}")

    def _save_due(self, step: int, last: bool) -> Path | None:
        """The checkpoint of ``step`` when one is due (every ``checkpoint.interval`` steps, and the last, whose write
        is committed before the end), else the commit of one written in the background; the committed folder or
        None."""
        interval = self.cfg.checkpoint.interval
        if last or (interval and step % interval == 0):
            enter_phase(f"step {step}: checkpoint save", self.world_ranks)
            return self.save(step, wait=last)
        if self.checkpoints.in_flight:
            enter_phase(f"step {step}: the checkpoint commit check", self.world_ranks)
            self.checkpoints.commit_if_written()
        return None

    def _stop_check(self, step: int, saved: Path | None) -> None:
        """Every rank stops after the same step on a stop signal: then saved (unless ``saved`` already), Stopped."""
        enter_phase(f"step {step}: the stop check", self.world_ranks)
        signum = STOP.agreed(self.device)
        if signum:
            if saved is None:
                enter_phase(f"step {step}: checkpoint save on {signal.Signals(signum).name}", self.world_ranks)
                saved = self.save(step, wait=True)
            raise Stopped(signum, step, self.cfg.train.steps, saved)

    def _finish(self, step_times: list[float], val_loss: float | None, tokens: int) -> dict[str, Any]:
        """Gather the run's summary (peak memory is the max over ranks); rank 0 writes ``OUT/summary.json``
        and the loss plot. Whatever launched the run compares it with the planner (``meshtrain.launch``)."""
        peak = torch.tensor([peak_memory_bytes(self.device.type)], dtype=torch.float64, device=self.device)  # nccl: on GPU
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        summary = run_summary(self.setup, val_loss, statistics.median(step_times) if step_times else None,
                              int(peak.item()), self._layout(), self.device.type, self.parallel.compiled, tokens,
                              **self.parallel.report(self.out_dir, TIMING_WARMUP_STEPS))
        if self.rank == 0:
            write_summary(self.out_dir, summary)
        return summary
