"""The schedules a pipeline rank runs, and :class:`Pipeline`, this rank's stages driven by one of them.

Schedules (``parallel.pp_schedule``), with the idle fraction of a step for ``p`` stages, ``m``
micro-batches and ``v`` chunks per rank when every stage takes equally long:

- ``naive``: plain model parallelism -- one micro-batch goes forward through every stage and back
  before the next starts; each rank idles ``(p-1)/p`` of the time.
- ``gpipe``: all forwards, then all backwards (Huang et al. 2019, arXiv:1811.06965); bubble
  ``(p-1)/(m+p-1)``, ``m`` micro-batches of activations in flight.
- ``1f1b``: one forward one backward in the steady state (PipeDream-Flush, Narayanan et al. 2021,
  arXiv:2104.04473, Sec. 2.2.1); the same bubble, at most ``p`` micro-batches in flight.
- ``interleaved-1f1b``: ``v`` chunks per rank, looped placement (Narayanan et al. 2021, Sec. 2.2.2);
  bubble ``(p-1)/(v*m+p-1)``, for ``v``-fold more point-to-point messages.
- ``zero-bubble`` (torch's interleaved zero-bubble) and ``zbv`` (V placement, 2 chunks per rank):
  the backward split into input-gradient and weight-gradient passes, the weight passes filling the
  bubble (Qi et al. 2024, arXiv:2401.10241).

:class:`Pipeline` wraps each of this rank's chunks in a traced stage
(:mod:`meshtrain.parallel.pipeline.trace`), runs the step's micro-batches through the schedule, and then
sums the gradients of the embedding and the head's copy of it across the ranks that hold them
(:func:`~meshtrain.parallel.pipeline.split.embedding_group`).

Multi-token prediction (DeepSeek-V3's, :mod:`meshtrain.models.deepseek_v3.mtp`) runs on the last stage, as
Megatron-Core places it: each micro-batch's tokens ahead and their targets go to every stage as one more step
argument (``mtp``), the last stage adds the modules' loss to the main one in the schedule's loss function, and its
copy of the embedding takes part in the same gradient sum as the head's copy of a tied weight.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshtrain.fileio import write_json_atomic
from meshtrain.parallel.pipeline.naive import ScheduleNaive
from meshtrain.parallel.pipeline.trace import (PipelineTracer, TimedStage, chrome_trace, gather, measured_bubble,
                                               plot_timeline)
from meshtrain.parallel.reduce import local_value
from meshtrain.rules.pipeline import RULES, bubble_fraction
from meshtrain.parallel.pipeline.balance import Chunk, chunk_ranks

SCHEDULES: dict[str, type] = {
    "naive": ScheduleNaive,
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


class Pipeline:
    """This rank's stages and the schedule that runs them; what the trainer calls instead of forward/backward.

    Args:
        model: the pruned model :func:`~meshtrain.parallel.pipeline.split.split_model` returned (holds every
            local parameter).
        parts: the chunk modules, after tp/sp/dp were applied to each (DDP or FSDP2 wrappers included).
        chunks: this rank's :class:`Chunk` specs, in the order of ``parts``.
        n_chunks: chunks in the whole pipeline (``pp * virtual_stages``).
        pp_group: the process group of this rank's pipeline (its "pp" mesh axis).
        embedding_group: ranks holding the embedding or the head copy of this pipeline's tied weight
            (None when one rank holds both, or nobody here holds either).
        schedule: a key of :data:`SCHEDULES`.
        n_microbatches: micro-batches per step (``gradient_accumulation_steps``).
        loss_fn: ``(logits (B, T, V), targets (B, T)) -> loss`` of one micro-batch (the step's scaled sum,
            :class:`meshtrain.parallel.compose.PipelineLoss`), with ``summed(logits, targets)``, the unscaled sum
            over the supervised tokens, for evaluation.
        use_loss_parallel: run the schedule inside ``loss_parallel`` (logits are vocab-sharded DTensors).
        hidden_seq_divisor: the sequence of the hidden states between chunks is this rank's tokens / this
            (tp under Megatron sequence parallelism, else 1).
        document_masking: steps carry per-sample positions (B, T') and document ids (B, T) (``data.packing =
            "document"``), split into micro-batches along the batch like the tokens; otherwise the positions
            (T',) are the same for every micro-batch and go whole to each.

    With a model of D > 0 multi-token prediction depths (its ``mtp_depths``), :meth:`step` takes their sequences
    and sets :attr:`mtp_loss`.
    """

    def __init__(self, model: nn.Module, parts: list[nn.Module], chunks: list[Chunk], n_chunks: int,
                 pp_group: dist.ProcessGroup, embedding_group: dist.ProcessGroup | None, schedule: str,
                 n_microbatches: int, loss_fn: Callable, device: torch.device, use_loss_parallel: bool,
                 hidden_seq_divisor: int = 1, document_masking: bool = False) -> None:
        self.model = model
        self.parts = {c.index: part for c, part in zip(chunks, parts)}
        self.n_chunks = n_chunks
        self.chunk_rank = chunk_ranks(dist.get_world_size(pp_group), n_chunks, RULES[schedule].placement)
        self.pp_group, self.pp_rank = pp_group, dist.get_rank(pp_group)
        self.loss_fn = loss_fn
        self.embedding_group = embedding_group
        self.tracer = PipelineTracer()
        self.stages = [TimedStage(part, c.index, n_chunks, device, self.tracer, group=pp_group)
                       for part, c in zip(parts, chunks)]
        self.is_first = any(c.has_embedding for c in chunks)
        self.is_last = any(c.has_head for c in chunks)
        cls = SCHEDULES[schedule]
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages  # one chunk per rank
        # torch splits step kwargs into micro-batches by these specs, whose keys must be exactly the kwargs given
        kwargs_spec = ({"positions": TensorChunkSpec(0), "doc_ids": TensorChunkSpec(0)} if document_masking
                       else {"positions": _Replicate()})
        self.mtp_depths: int = getattr(model, "mtp_depths", 0)
        if self.mtp_depths:
            kwargs_spec["mtp"] = TensorChunkSpec(0)  # (B, 2D, T'): split along the batch like the tokens
        self.mtp_copy = self._own_mtp_copy()
        self.mtp_loss: torch.Tensor | None = None
        """The last step's multi-token prediction loss (the mean over micro-batches of each one's scaled sum, as the
        loss): on the last stage, zeros elsewhere; None without multi-token prediction."""
        self._mtp_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (main, mtp) of each micro-batch, detached
        self.document_masking = document_masking
        self.schedule = cls(stages, n_microbatches, loss_fn=self._loss_with_mtp if self.mtp_depths else loss_fn,
                            kwargs_chunk_spec=kwargs_spec)
        self.n_microbatches, self.schedule_name = n_microbatches, schedule
        self.hidden_seq_divisor = hidden_seq_divisor
        self.loss_context = loss_parallel if use_loss_parallel else nullcontext

    def step(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor,
             doc_ids: torch.Tensor | None = None, mtp: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one step: ``x, y`` (n_microbatches * mbs, T') token ids and targets of
        this rank's sequence shard, ``positions`` (T',), or (n_microbatches * mbs, T') with the document ids
        ``doc_ids`` (n_microbatches * mbs, T) of ``document_masking``; with multi-token prediction ``mtp``
        (n_microbatches * mbs, 2D, T'), its depths' tokens ahead and targets
        (:meth:`meshtrain.models.deepseek_v3.mtp.MultiTokenPrediction.forward`). Returns the mean main loss over
        the micro-batches on the last stage, 0 elsewhere (and sets :attr:`mtp_loss`); gradients are left reduced
        over dp and the tied weight's summed."""
        losses: list[torch.Tensor] = []
        self._mtp_parts = []
        self._refresh_mtp_copy()
        with self.loss_context(), self.tracer.step():
            self._run(x, y, positions, doc_ids, losses, mtp)
        self.sync_tied_gradients()
        if not self.mtp_depths:
            return self._mean(losses)
        parts = self._mtp_parts[-self.n_microbatches:]  # the first step's shape inference computes a loss too
        self.mtp_loss = self._mean([part for _, part in parts])
        return self._mean([main for main, _ in parts])

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]
                 ) -> torch.Tensor:
        """``[loss sum, count]`` over ``batches`` (each ``(x, y, positions, doc_ids)`` of one micro-batch) on the
        last stage (zeros elsewhere), float64 (2,): the loss function's ``evaluated`` of each, summed."""
        out = self.forward_only(batches, self.loss_fn.evaluated)
        return torch.stack(out).double().cpu().sum(0) if out else torch.zeros(2, dtype=torch.float64)

    @torch.no_grad()
    def forward_only(self, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                     head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``head(logits, y)`` of each of ``batches`` on the last stage ([] elsewhere): a forward-only pass, one
        micro-batch at a time through the chunks in order, hidden states (B, T', C) sent to the rank of the next
        chunk (a plain ``dist.send``/``recv`` on the pp group; torch's V-shaped schedules cannot run forward-only)."""
        out = []
        for x, y, positions, doc_ids in batches:
            documents = {} if doc_ids is None else {"doc_ids": doc_ids}
            hidden = None
            for c in range(self.n_chunks):
                if self.chunk_rank[c] != self.pp_rank:
                    continue
                if c > 0 and self.chunk_rank[c - 1] != self.pp_rank:
                    hidden = torch.empty(self.hidden_shape(x), device=x.device)  # (B, T', C)
                    dist.recv(hidden, group=self.pp_group, group_src=self.chunk_rank[c - 1])
                part = self.parts[c]
                hidden = part(x if c == 0 else hidden, positions=positions, **documents)  # every chunk: RoPE, masks
                if c == self.n_chunks - 1:
                    with self.loss_context():
                        out.append(local_value(head(hidden, y)).detach())
                elif self.chunk_rank[c + 1] != self.pp_rank:
                    dist.send(hidden.float().contiguous(), group=self.pp_group, group_dst=self.chunk_rank[c + 1])
        return out

    def hidden_shape(self, x: torch.Tensor) -> tuple[int, int, int]:
        """Shape of the hidden states between chunks for this rank's token ids ``x`` (B, T'):
        (B, T', C), or (B, T'/tp, C) under Megatron sequence parallelism."""
        return (x.size(0), x.size(1) // self.hidden_seq_divisor, self.model.cfg.n_embd)

    def report(self, out_dir: Path, skip_steps: int) -> dict | None:
        """Collectively gather every pipeline rank's step records; on global rank 0 write the last step as
        ``OUT/pipeline_trace.json`` (Chrome trace) and ``OUT/pipeline_schedule.png`` (timeline), and return
        the measured bubble (median over the steps after the first ``skip_steps``) beside the theory."""
        per_rank = gather(self.tracer, self.pp_group)
        if per_rank is None or not per_rank[0] or dist.get_rank() != 0:
            return None  # one writer: every dp/sp/tp replica of the pipeline gathers, global rank 0 writes
        last = [steps[-1] for steps in per_rank]
        measured = measured_bubble([steps[skip_steps:] or steps for steps in per_rank])
        p, v = dist.get_world_size(self.pp_group), self.n_chunks // dist.get_world_size(self.pp_group)
        theory = bubble_fraction(self.schedule_name, p, self.n_microbatches, v)
        write_json_atomic(out_dir / "pipeline_trace.json", chrome_trace(last))
        plot_timeline(last, out_dir / "pipeline_schedule.png",
                      f"{self.schedule_name}: pp={p}, virtual_stages={v}, {self.n_microbatches} micro-batches -- "
                      f"bubble {statistics.median(measured):.0%} measured, {theory:.0%} in theory")
        return {"schedule": self.schedule_name, "pp": p, "virtual_stages": v, "microbatches": self.n_microbatches,
                "bubble_measured": statistics.median(measured), "bubble_theory": theory}

    def _run(self, x, y, positions, doc_ids, losses, mtp=None) -> None:
        args = (x,) if self.is_first else ()
        # positions go to every stage (torch hands a rank's step kwargs to each of its stages): the GPT reads
        # them in its embedding, a Llama's every block rotates q and k by them; document ids likewise, every
        # stage builds its blocks' attention mask from them
        if (doc_ids is not None) != self.document_masking:
            raise ValueError(f"document ids {'given' if doc_ids is not None else 'missing'}: this pipeline was "
                             f"built with document_masking = {self.document_masking}")
        documents = {"doc_ids": doc_ids} if self.document_masking else {}
        if self.mtp_depths:
            if mtp is None:
                raise ValueError("multi-token prediction's sequences missing: this pipeline's model has "
                                 f"{self.mtp_depths} depth(s)")
            documents["mtp"] = mtp
        self.schedule.step(*args, target=y if self.is_last else None, losses=losses if self.is_last else None,
                           positions=positions, **documents)

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not losses:
            return torch.zeros(())
        return torch.stack([loss.detach().float().reshape(()) for loss in map(local_value, losses)]).mean()

    def _head(self) -> nn.Module | None:
        """The last chunk's model on this rank (DDP's wrapper removed), or None."""
        part = self.parts.get(self.n_chunks - 1)
        return getattr(part, "module", part)

    def _loss_with_mtp(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch with multi-token prediction: the main loss (:attr:`loss_fn`) plus the
        last chunk's ``mtp_loss`` of the forward just run, its cross-entropies summed as the main one's
        (``loss_fn.evaluated``) and scaled alike (DeepSeek-V3 report, Eq. 24-25: both over the main loss's supervised
        tokens of the global batch). torch's schedules call it right after each forward of the last stage."""
        main = self.loss_fn(logits, targets)
        mtp = self._head().mtp_loss(targets, lambda lk, yk: self.loss_fn.evaluated(lk, yk)[0])
        mtp = mtp * self.loss_fn.scale
        self._mtp_parts.append((main.detach(), mtp.detach()))
        return main + mtp

    def _own_mtp_copy(self) -> nn.Parameter | None:
        """The last chunk's own copy of the embedding weight for multi-token prediction, where this rank holds the
        first chunk too (V placement; :mod:`meshtrain.models.deepseek_v3.mtp`): not a parameter of :attr:`model`
        (neither optimised nor saved), refreshed from ``tok_emb`` before each step; else None."""
        copy = getattr(self._head(), "mtp_embedding", None)
        return None if copy is None or copy is self.model.tok_emb else copy.weight

    @torch.no_grad()
    def _refresh_mtp_copy(self) -> None:
        """Set :attr:`mtp_copy` to ``tok_emb``'s weight (after the last optimizer step, or a checkpoint's load)."""
        if self.mtp_copy is not None:
            local_value(self.mtp_copy).copy_(local_value(self.model.tok_emb.weight))

    def tied_weights(self) -> list[nn.Parameter]:
        """This rank's copies of the embedding weight that live on different ranks or chunks (0 or 1 of them,
        or 2 when a V-shaped schedule puts the first and last chunk on this rank): the embedding and the head's
        copy of a tied weight; with multi-token prediction of an untied model, the embedding and the last stage's
        copy of it (``tok_emb`` there, or :attr:`mtp_copy`)."""
        m = self.model
        if not m.share_embedding and m.ties_embeddings():  # a tied weight the split gave the head a copy of
            return [mod.weight for mod in (m.tok_emb, m.lm_head) if mod is not None]
        if m.share_embedding or not self.mtp_depths:  # one tensor here, or two independent ones by design
            return []
        own = [self.mtp_copy] if self.mtp_copy is not None else []
        return ([m.tok_emb.weight] if m.tok_emb is not None else []) + own

    def head_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the embedding weight (the head's of a tied weight, or multi-token prediction's),
        which the gradient norm leaves out (the embedding's counts)."""
        weights = self.tied_weights()
        return weights[-1] if weights and self.model.lm_head is not None else None

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Sum the gradients of the embedding and the head's copy of it, so both copies take the same step.

        A tp-sharded copy's gradient is first brought to its weight's layout (the embedding's backward
        yields a replicated gradient for a vocab-sharded weight), so both sides add matching shards."""
        weights = [w for w in self.tied_weights() if w.grad is not None]
        for w in weights:
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                w.grad = w.grad.redistribute(w.grad.device_mesh, w.placements)
        grads = [local_value(w.grad) for w in weights]
        if len(grads) == 2:  # both copies here (V placement): add locally
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif len(grads) == 1 and self.embedding_group is not None:
            dist.all_reduce(grads[0], group=self.embedding_group)
        if self.mtp_copy is not None:  # its sum is in tok_emb's now; it takes no step of its own
            self.mtp_copy.grad = None
