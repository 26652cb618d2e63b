"""What the trainer holds after :func:`meshtrain.parallel.compose.parallelize`: this rank's parameters and how a step
runs on them, the same methods whatever the layout.

- :class:`ReplicatedModel` (pp = 1): the step's micro-batches one after another, gradients synchronised
  over dp on the last one only (DDP's bucketed all-reduce, FSDP2's reduce-scatter, or, under local SGD,
  none after the warm-up: the replicas average their parameters every H steps instead).
- :class:`PipelineModel` (pp > 1): the step's micro-batches streamed through this rank's stages by a
  ``torch.distributed.pipelining`` schedule; the loss exists on the last stage only.

The strategy-specific pieces (the sp sharding of a micro-batch, DDP/FSDP2's gradient-sync switch, local
SGD's averager, the pipeline) are handed in by :func:`meshtrain.parallel.compose.parallelize`, so this module
imports no strategy (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshtrain.mesh import Axis, ParallelDims
from meshtrain.sync_mode import SYNCHRONOUS, SyncMode
from meshtrain.cross_entropy import DEFAULT_CHUNK_MB
from meshtrain.objectives import dpo_loss
from meshtrain.parallel.reduce import (clip_grad_norm_, cross_entropy, local_value, loss_scale, pair_scale, row_counts,
                                      row_logps, supervised_count)

Batch = list[tuple[torch.Tensor, ...]]
"""Micro-batches ``(x, y)``, each (B, T) int64 token ids and targets (``IGNORE_INDEX`` where not in the loss), as
the sampler yields them (CPU); packed conversations add their document ids, ``(x, y, doc_ids)``."""
LocalBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""This rank's ``(x, y, positions, doc_ids)`` of a micro-batch: ``x, y`` (B, T/sp), their global positions
(T/sp,), and None; with ``data.packing = "document"`` per-sample positions (B, T/sp) and the document ids
(B, T) of the whole windows (:func:`meshtrain.parallel.compose.local_batch`)."""
Sharder = Callable[[torch.Tensor, torch.Tensor], LocalBatch]
"""``(x, y)`` (B, T) -> this rank's :data:`LocalBatch`."""


class ParallelModel:
    """This rank's part of the model (``model``: its parameters, for the optimizer, the checkpoint and the
    gradient norm) and a step on it. Built by :func:`meshtrain.parallel.compose.parallelize`."""

    compiled: bool = False
    """Whether the blocks run ``torch.compile``-d (:func:`meshtrain.rules.support.blocks_compiled`)."""

    def __init__(self, model: nn.Module, dims: ParallelDims, shard: Sharder,
                 autocast: contextlib.AbstractContextManager,
                 after_backward: Callable[[], None] | None = None) -> None:
        self.model = model
        self.dims = dims
        self.device = next(model.parameters()).device
        self._shard = shard
        self.autocast = autocast
        """The context every forward runs in: bf16 autocast (fp32 master weights) or none."""
        self.after_backward = after_backward or (lambda: None)
        """Called once a step's gradients are accumulated, before they are clipped: the experts' gradient
        reduction of expert parallelism (:func:`meshtrain.parallel.expert.sync_expert_gradients`), or nothing."""

    sync: SyncMode = SYNCHRONOUS
    """The sync mode's hooks around the loop's steps (:class:`SyncMode`; DiLoCo's outer loop,
    :class:`meshtrain.parallel.diloco.DiLoCo`): set by :func:`meshtrain.parallel.compose.parallelize`."""

    aux_loss: torch.Tensor | None = None
    """The family's auxiliary loss (a mixture of experts' load balancing) of the last step, this rank's mean over the
    micro-batches, or None: a model without one, or a pipeline (each stage holds part of it)."""

    mtp_loss: torch.Tensor | None = None
    """The multi-token prediction loss of the last step (``(lambda / D) * sum_k CE_k`` over the supervised tokens of the
    global batch, DeepSeek-V3 report Eq. 25), this rank's share as the loss's, or None: a model without it."""

    masked: bool = False
    """Whether targets may be left out of the loss (prepared conversations): the step then counts the supervised
    tokens of the global batch with an all-reduce (:func:`meshtrain.parallel.reduce.loss_scale`)."""

    supervised_tokens: int = 0
    """The supervised tokens of the last step's global batch (this DiLoCo worker's)."""

    def local(self, x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None) -> LocalBatch:
        """This rank's sp shard of ``x, y`` (B, T) on its device: (B, T/sp) each, positions (T/sp,) (or
        (B, T/sp)) and the document ids (B, T) of document packing (else None), :data:`LocalBatch`."""
        return self._shard(x.to(self.device), y.to(self.device), None if doc_ids is None else doc_ids.to(self.device))

    dpo: dict[str, Any] | None = None
    """``train.objective = "dpo"``: ``{"beta", "loss_type", "label_smoothing"}`` of
    :func:`meshtrain.objectives.dpo_loss`; micro-batches are then ``(x, y, None, reference)`` of pairs (two rows
    each, :class:`meshtrain.data.conversations.Pairs`). None: the cross-entropy."""

    pairs: int = 0
    """DPO: the pairs of the last step's global batch."""

    after_forward_only: Callable[[], None] = staticmethod(lambda: None)
    """Called after :meth:`reference_logps`: a frozen model's (DPO's reference copy) frees the weights FSDP2 gathered
    for it (:func:`meshtrain.parallel.data_parallel.reshard`); nothing for a model that trains."""

    pair_metrics: torch.Tensor | None = None
    """DPO: this rank's sums over the last step's pairs of :data:`meshtrain.objectives.PAIR_METRICS`, (4,) float64
    (each sp rank of a group holds the same; zeros off a pipeline's last stage)."""

    vocab_parallel: bool = False
    """Whether the last forward's logits were vocab-sharded (tp): a backward then runs inside ``loss_parallel``."""

    loss_chunk_mb: float = DEFAULT_CHUNK_MB
    """``train.loss_chunk_mb``: fp32 MiB of logits the loss computes at once (:func:`meshtrain.cross_entropy.token_nll`;
    0 = all at once). Vocab-sharded logits (tp) take ``loss_parallel`` instead."""

    def step_scale(self, micro_batches: Batch) -> float:
        """What each micro-batch's summed loss is multiplied by in this step, so that the step's gradient is the
        global batch's summed loss over its supervised tokens (:func:`meshtrain.parallel.reduce.loss_scale`), or
        with DPO the mean over its pairs (:func:`~meshtrain.parallel.reduce.pair_scale`); sets
        :attr:`supervised_tokens` (or :attr:`pairs`)."""
        if self.dpo is not None:
            self.pair_metrics = torch.zeros(4, dtype=torch.float64)
            scale, self.pairs = pair_scale(sum(mb[0].size(0) // 2 for mb in micro_batches), len(micro_batches),
                                           self.dims)
            return scale
        count = sum(int(supervised_count(mb[1])) for mb in micro_batches)
        scale, self.supervised_tokens = loss_scale(count, len(micro_batches), self.dims, self.masked)
        return scale

    @property
    def sp_group(self):
        """The sp group whose shards of a row :func:`~meshtrain.parallel.reduce.row_logps` sums, or None."""
        return self.dims.get_mesh(Axis.SP).get_group() if self.dims.sp_enabled else None

    def pair_losses(self, logps: torch.Tensor, reference: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """DPO's per-pair losses (P,) of the rows' log-probabilities ``logps`` (2P,) against ``reference`` (2P,), the
        rows' targets ``y`` (2P, T') of this rank's shard giving IPO its token counts; adds their metrics to
        :attr:`pair_metrics`."""
        counts = row_counts(y, self.sp_group) if self.dpo["loss_type"] == "ipo" else None
        losses, metrics = dpo_loss(logps, reference.to(logps.device, logps.dtype), counts=counts, **self.dpo)
        self.pair_metrics += metrics.sum(dim=0).double().cpu()
        return losses

    def backward_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel`` when the last forward's logits were vocab-sharded, else nothing."""
        return loss_parallel() if self.vocab_parallel else contextlib.nullcontext()

    def reference_logps(self, batches: Batch) -> torch.Tensor:
        """Every row's log-probability of its supervised targets under the current weights (no gradients, dropout
        off): (rows,) float64 on every rank, rows of ``batches`` in order (the DPO reference, computed once)."""
        raise NotImplementedError

    def forward_backward(self, micro_batches: Batch) -> torch.Tensor:
        """Accumulate the step's gradients over ``micro_batches``; return this rank's mean loss (a scalar;
        with pp > 1 the loss on the last stage and 0 on the others)."""
        raise NotImplementedError

    def evaluate(self, batches: Batch) -> torch.Tensor:
        """``[loss sum, supervised tokens]`` of this rank's tokens of ``batches``, float64 (2,) (no gradients;
        dropout off); with pp > 1 on the last stage, zeros elsewhere."""
        raise NotImplementedError

    def clip_gradients(self, max_norm: float) -> float:
        """Clip to ``max_norm`` by the norm over every rank's gradients (0 = no clipping); return the norm."""
        return clip_grad_norm_(self.model.parameters(), max_norm)

    def after_optimizer_step(self) -> None:
        """Called after every ``optimizer.step()``: routers with auxiliary-loss-free balancing move their biases
        (:meth:`meshtrain.models.moe.layer.MoE.update_bias`)."""
        for module in self.model.modules():
            if hasattr(module, "update_bias"):
                module.update_bias()

    def end_step(self, step: int, diverged: bool = False) -> str | None:
        """Called after optimizer step ``step`` (1-based) on every rank, updated or skipped: the sync mode's
        (DiLoCo's outer steps), with this rank's vote to stop (``diverged``); None to go on, else who diverged
        (:meth:`meshtrain.sync_mode.SyncMode.after_step`)."""
        return self.sync.after_step(step, diverged)

    def consolidate(self, step: int) -> None:
        """Make the replicas hold the same parameters before a checkpoint after step ``step`` (they always do, but
        under local SGD and DiLoCo)."""
        self.sync.consolidate(step)

    def report(self, out_dir: Path, skip_steps: int) -> dict[str, Any]:
        """Layout-specific entries of the run's summary (the pipeline's bubble, DiLoCo's exchanges); ``skip_steps``
        warm-up steps are left out of timings."""
        return self.sync.report()


class ReplicatedModel(ParallelModel):
    """pp = 1: micro-batches in turn, the gradient collective on the last one only.

    Args:
        gradient_sync: ``(model, enabled) -> context``: within it, backward synchronises gradients over dp
            only if ``enabled`` (:func:`meshtrain.parallel.data_parallel.gradient_sync`).
        local_sgd: the averager of local SGD (:class:`meshtrain.parallel.local_sgd.LocalSGD`), or None.
        after_backward: see :attr:`ParallelModel.after_backward`.
    """

    def __init__(self, model: nn.Module, dims: ParallelDims, shard: Sharder,
                 autocast: contextlib.AbstractContextManager,
                 gradient_sync: Callable[[nn.Module, bool], contextlib.AbstractContextManager], *,
                 compiled: bool = False, local_sgd: Any = None, after_backward: Callable[[], None] | None = None) -> None:
        super().__init__(model, dims, shard, autocast, after_backward)
        self.gradient_sync = gradient_sync
        self.compiled = compiled
        self.local_sgd = local_sgd
        self.replicas_equal = True
        """False while local-SGD replicas hold different parameters (between two averages)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor, doc_ids: torch.Tensor | None = None, *_
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, targets)`` of this rank's shard of the micro-batch ``x, y`` (mbs, T): (mbs, T/sp, V), a
        vocab-sharded DTensor under tp, and (mbs, T/sp)."""
        self._shard_mtp(x, y)
        x, y, positions, doc_ids = self.local(x, y, doc_ids)  # (mbs, T/sp) each, positions (T/sp,) or (mbs, T/sp)
        documents = {} if doc_ids is None else {"doc_ids": doc_ids}  # (mbs, T): document packing
        with self.autocast:
            logits = self.model(x, positions, **documents)
        self.vocab_parallel = isinstance(logits, DTensor)
        return logits, y

    def _shard_mtp(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Under sp, a training model with multi-token prediction (DeepSeek-V3's ``mtp_sequences``) gets its depths'
        next tokens and targets made on the whole window ``x, y`` (mbs, T) and cut as ``x, y`` are: their shift
        crosses the sp shards."""
        core = getattr(self.model, "module", self.model)  # DDP wraps the model
        depths = getattr(core, "mtp_depths", 0)
        if self.dims.sp > 1 and depths and core.training and self.dpo is None:
            core.mtp_shards = [self.local(a, t)[:2] for a, t in core.mtp_sequences(x, y, depths)]  # (mbs, T/sp) each

    def loss(self, *micro_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum, count)``: the cross-entropy summed over this rank's supervised tokens of the micro-batch
        ``(x, y[, doc_ids])`` (mbs, T) (its sp shard of them), and their count; with DPO, the summed loss of its pairs
        and their count (the same on each sp rank)."""
        if self.dpo is None:
            main, mtp, count = self.lm_loss(*micro_batch)
            return (main if mtp is None else main + mtp), count
        logits, y = self.forward(*micro_batch)
        losses = self.pair_losses(row_logps(logits, y, self.sp_group, chunk_mb=self.loss_chunk_mb), micro_batch[3], y)
        return losses.sum(), torch.tensor(losses.numel())

    def lm_loss(self, *micro_batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(main, mtp, count)`` of the micro-batch: the main head's cross-entropy summed over this rank's supervised
        tokens, the model's multi-token prediction loss summed alike (None without one, and in eval:
        :meth:`meshtrain.models.deepseek_v3.model.DeepseekV3.mtp_loss`), and the count of those tokens, which
        normalises both (DeepSeek-V3 report, Eq. 24)."""
        logits, y = self.forward(*micro_batch)
        main = cross_entropy(logits, y, reduction="sum", chunk_mb=self.loss_chunk_mb)
        extra = getattr(getattr(self.model, "module", self.model), "mtp_loss", None)  # DDP wraps the model
        mtp = extra(y, lambda lk, yk: cross_entropy(lk, yk, reduction="sum", chunk_mb=self.loss_chunk_mb)) if extra \
            else None
        return main, mtp, supervised_count(y)

    @torch.no_grad()
    def reference_logps(self, batches: Batch) -> torch.Tensor:
        self.model.eval()
        rows = [row_logps(*self.forward(*micro_batch), self.sp_group, chunk_mb=self.loss_chunk_mb).double().cpu()
                for micro_batch in batches]
        self.model.train()
        return torch.cat(rows)

    def forward_backward(self, micro_batches: Batch) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        scale = self.step_scale(micro_batches)
        lm = getattr(self.model, "module", self.model)  # DDP wraps the language model; FSDP2 and tp keep it
        lm.aux_grad_scale = 1.0 / n  # a family's auxiliary loss joins the backward with the loss's weight
        aux, mtps = [], []
        for i, micro_batch in enumerate(micro_batches):
            with self.gradient_sync(self.model, i == n - 1):
                main, mtp, _ = self.lm_loss(*micro_batch) if self.dpo is None else (self.loss(*micro_batch)[0], None, 0)
                loss = main * scale
                objective = loss if mtp is None else loss + mtp * scale  # the same normalisation (Eq. 24)
                with self.backward_context():
                    (objective / n).backward()
            total += local_value(loss).detach()
            if mtp is not None:
                mtps.append(local_value(mtp * scale).detach())
            if (value := lm.aux_loss()) is not None:
                aux.append(value.detach())
        self.aux_loss = torch.stack(aux).mean() if aux else None
        self.mtp_loss = torch.stack(mtps).mean() if mtps else None
        self.after_backward()
        return total / n

    @torch.no_grad()
    def evaluate(self, batches: Batch) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        self.pair_metrics = torch.zeros(4, dtype=torch.float64)
        for micro_batch in batches:
            loss, count = self.loss(*micro_batch)
            total += torch.stack([local_value(loss).detach().cpu().double(), count.cpu().double()])
        self.model.train()
        return total if self.dpo is None else torch.cat([total, self.pair_metrics])

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        if self.local_sgd is not None:
            self.replicas_equal = self.local_sgd.after_step(self.model.parameters())

    def consolidate(self, step: int) -> None:
        super().consolidate(step)
        if not self.replicas_equal:  # local SGD between two averages: save the replicas' mean model
            self.local_sgd.average_now(self.model.parameters())
            self.replicas_equal = True


class PipelineModel(ParallelModel):
    """pp > 1: the step's micro-batches through this rank's stages
    (:class:`meshtrain.parallel.pipeline.schedule.Pipeline`)."""

    def __init__(self, pipeline: Any, dims: ParallelDims, shard: Sharder,
                 autocast: contextlib.AbstractContextManager, *, compiled: bool = False,
                 after_backward: Callable[[], None] | None = None) -> None:
        super().__init__(pipeline.model, dims, shard, autocast, after_backward)
        self.pipeline = pipeline
        self.compiled = compiled

    def forward_backward(self, micro_batches: Batch) -> torch.Tensor:
        loss_fn = self.pipeline.loss_fn
        loss_fn.scale = self.step_scale(micro_batches)
        whole = [torch.cat(parts) for parts in list(zip(*micro_batches))[:2]]  # x, y (GA*mbs, T)
        x, y, positions, doc_ids = self.local(*whole, *self._documents(micro_batches))  # (GA*mbs, T/sp)
        mtp = {"mtp": self._mtp_sequences(*whole)} if self.pipeline.mtp_depths else {}
        if self.dpo is not None:  # each row's reference rides with its targets through the schedule's split
            loss_fn.model = self
            y = self._with_reference(y, torch.cat([mb[3] for mb in micro_batches]))
        parts = [getattr(part, "module", part) for part in self.pipeline.parts.values()]  # DDP wraps a chunk
        for part in parts:  # each chunk's auxiliary losses of this step, one per micro-batch
            part.aux_history = []
        try:
            with self.autocast:
                loss = self.pipeline.step(x, y, positions, doc_ids, **mtp)
            n = self.pipeline.n_microbatches  # each chunk's last n: the first step's shape inference runs a forward too
            history = [value for part in parts for value in part.aux_history[-n:]]
        finally:
            for part in parts:
                part.aux_history = None
        # this rank's chunks' share of the mean over micro-batches: the metrics' batch_mean sums it over the stages;
        # a stage with no router (DeepSeek-V3's dense first layers) shares 0, so that every stage joins that sum
        routers = any(getattr(part, "MOE", False) for part in parts)
        self.aux_loss = torch.stack(history).sum() / n if history else torch.zeros(()) if routers else None
        self.mtp_loss = self.pipeline.mtp_loss  # the last stage's, zeros on the others (the metrics sum over stages)
        self.after_backward()
        return loss

    def _mtp_sequences(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step's multi-token prediction inputs for the last stage, which holds hidden states, not ids: depth k's
        tokens ahead and targets (``mtp_sequences`` of the model) made on the whole windows ``x, y`` (GA*mbs, T) (the
        shift crosses sp shards), cut to this rank's sp shard as ``x, y`` are, and stacked
        ``[ahead_1..D, targets_1..D]``: (GA*mbs, 2D, T/sp) int64."""
        pairs = [self.local(a, t)[:2] for a, t in self.model.mtp_sequences(x, y, self.pipeline.mtp_depths)]
        return torch.stack([a for a, _ in pairs] + [t for _, t in pairs], dim=1)

    @torch.no_grad()
    def evaluate(self, batches: Batch) -> torch.Tensor:
        self.model.eval()
        with self.autocast:
            self.pipeline.loss_fn.model = self
            self.pair_metrics = torch.zeros(4, dtype=torch.float64)
            total = self.pipeline.evaluate([self._local_with_reference(mb) for mb in batches])
        self.model.train()
        return total if self.dpo is None else torch.cat([total, self.pair_metrics])

    @torch.no_grad()
    def reference_logps(self, batches: Batch) -> torch.Tensor:
        self.model.eval()
        with self.autocast:
            rows = self.pipeline.forward_only([self.local(*mb[:3]) for mb in batches],
                                              lambda logits, y: self.pipeline.loss_fn.rows(logits, y, self.sp_group,
                                                                                       self.loss_chunk_mb))
        self.model.train()
        rows = torch.cat(rows).double().cpu() if rows else torch.zeros(sum(len(mb[0]) for mb in batches),
                                                                     dtype=torch.float64)
        dist.all_reduce(rows, group=self.dims.get_mesh(Axis.PP).get_group())  # from the last stage to every stage
        return rows

    @staticmethod
    def _documents(micro_batches: Batch) -> list[torch.Tensor]:
        """The step's document ids (GA*mbs, T), or none."""
        docs = [mb[2] for mb in micro_batches if len(mb) > 2 and mb[2] is not None]
        return [torch.cat(docs)] if docs else []

    @staticmethod
    def _with_reference(y: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Targets (B, T') with each row's reference log-probability (B,) float64 appended as one more int64 column
        (its bits: :meth:`~meshtrain.parallel.compose.PipelineLoss.__call__` reads them back exactly)."""
        return torch.cat([y, reference.to(y.device, torch.float64).view(torch.int64)[:, None]], dim=1)

    def _local_with_reference(self, micro_batch) -> tuple:
        x, y, positions, doc_ids = self.local(*micro_batch[:3])
        return x, (self._with_reference(y, micro_batch[3]) if self.dpo is not None else y), positions, doc_ids

    def clip_gradients(self, max_norm: float) -> float:
        """The norm over every stage's gradients, the head's copy of a tied weight counted once."""
        return clip_grad_norm_(self.model.parameters(), max_norm, pp_group=self.dims.get_mesh(Axis.PP).get_group(),
                               uncounted=self.pipeline.head_copy())

    def report(self, out_dir: Path, skip_steps: int) -> dict[str, Any]:
        return {**super().report(out_dir, skip_steps), "pp": self.dims.pp,
                "pipeline": self.pipeline.report(out_dir, skip_steps)}
