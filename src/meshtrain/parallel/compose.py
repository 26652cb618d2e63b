"""How the parallel strategies compose: the one function the trainer calls, :func:`parallelize`.

Each strategy is ``apply_<x>(model, mesh, ...) -> model`` in its own module; they are applied in one fixed
order (docs/architecture.md, "Layers"):

1. pp split -- :func:`meshtrain.parallel.pipeline.split.split_model`: this rank's chunks of consecutive
   layers (:func:`parallelize_pipeline`); each chunk then gets 2-4 on its own;
2. tp -- :func:`meshtrain.parallel.tensor.apply_tp`: DTensor shards of each block's matrices;
3. sp -- :func:`meshtrain.parallel.sequence.apply_sp`: attention over a sequence shard (Ulysses, ring or USP);
4. ep -- :func:`meshtrain.parallel.expert.apply_ep`: a mixture of experts' experts split over ``ep`` ranks
   borrowed from dp x sp, tokens sent to them by all-to-all;
5. dp -- :func:`meshtrain.parallel.data_parallel.apply_dp`: DDP / FSDP2 over the ``"dp_sp"`` mesh, last, so that
   it wraps (and, for FSDP2, shards further) the parameters tp produced (the experts ep split: over the
   ``"edp"`` ranks that hold the same ones); optionally with DDP's
   all-reduce made hierarchical (:mod:`meshtrain.parallel.hierarchical`). Local SGD and the parameter
   server replace this all-reduce altogether (:mod:`meshtrain.parallel.local_sgd`,
   :mod:`meshtrain.parallel.async_ps`);
6. DiLoCo's outer loop -- :class:`meshtrain.parallel.diloco.DiLoCo`: with workers, 1-5 run inside each worker and
   the workers exchange pseudo-gradients every H steps over the ``"diloco"`` mesh.

Dropout streams are set up after tp and sp (:mod:`meshtrain.parallel.rng`), since sp replaces the
attention modules whose dropout runs on the per-tp-rank stream. No strategy module imports another.

:func:`parallelize` also decides everything else about how a step runs -- compiled blocks (before DDP/
FSDP2 wrap them, as torchtitan orders it), the pipeline schedule, local SGD's parameter averaging -- and
returns a :class:`ParallelModel` (:mod:`meshtrain.parallel.model`) whose methods the trainer calls, so the
training loop holds no ``if strategy`` branch. (Composition lives in this module: it is the one module of the
package that may import every strategy.) The parameter server is a loop of its own
(:func:`meshtrain.rules.support.uses_parameter_server`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from torch import nn

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshtrain.adapters.apply import adapt
from meshtrain.adapters.lora import tp_split_dropouts
from meshtrain.batch_math import global_batch_size, tokens_per_step
from meshtrain.config.sections import Config, ParallelConfig
from meshtrain.cross_entropy import DEFAULT_CHUNK_MB
from meshtrain.errors import ConfigError
from meshtrain.data.packing import document_positions, pack_documents
from meshtrain.mesh import (BATCH_MESH, EXPERT_MESH, EXPERT_REPLICA_MESH, SP_RING_MESH, SP_ULYSSES_MESH, WORKER_MESH,
                            Axis, ParallelDims)
from meshtrain.parallel.data_parallel import apply_dp, gradient_sync, reshard
from meshtrain.parallel.diloco import DiLoCo
from meshtrain.parallel.expert import apply_ep, expert_modules, sync_expert_gradients
from meshtrain.parallel.hierarchical import apply_hierarchical_allreduce
from meshtrain.parallel.local_sgd import LocalSGD
from meshtrain.parallel.model import LocalBatch, ParallelModel, PipelineModel, ReplicatedModel
from meshtrain.parallel.pipeline.split import embedding_group, split_model
from meshtrain.parallel.recompute import apply_recompute, compile_blocks
from meshtrain.parallel.rng import TPRegionRNG
from meshtrain.parallel.reduce import cross_entropy, local_value, row_logps, supervised_count
from meshtrain.parallel.sequence import apply_sp, sequence_positions, shard_sequence
from meshtrain.parallel.tensor import apply_tp
from meshtrain.rules.support import blocks_compiled, compile_eligible

if TYPE_CHECKING:  # torch.distributed.pipelining imports torch._dynamo (~0.6 s a process): only pp > 1 runs need it
    from meshtrain.parallel.pipeline.schedule import Pipeline


def parallelize(model: nn.Module, dims: ParallelDims, cfg: Config,
                autocast: contextlib.AbstractContextManager, eos_id: int | None = None,
                conversations: bool = False, frozen: bool = False) -> ParallelModel:
    """Everything ``cfg`` asks of ``model`` (a whole :class:`meshtrain.models.base.LayeredLM`, built from the
    seed on this rank's device) on ``dims``' built mesh; return what the trainer runs steps with.

    With pp > 1 the model is cut into this rank's pipeline chunks (:func:`parallelize_pipeline`), else it
    gets compiled blocks where ``train.compile`` resolves to on (:func:`meshtrain.rules.support.blocks_compiled`),
    then tp -> sp -> dp (:func:`parallelize_model`), and local SGD's averaging where ``sync_mode`` asks
    for it. ``autocast``: the context every forward runs in (bf16 autocast, or none). ``eos_id``: the
    tokenizer's end-of-document id, which ``data.packing = "document"`` splits each window at
    (:mod:`meshtrain.data.packing`); unused with "concat". ``conversations``: the data is prepared conversations
    (:mod:`meshtrain.data.conversations`): targets outside the loss, and, packed, document ids that come with each
    micro-batch instead of being found at EOS tokens. ``frozen``: a model that only runs forward (DPO's reference
    copy, :mod:`meshtrain.train.reference`): no parameter requires a gradient, FSDP2 shards it as the policy's
    (zero_stage 2 and 3) and its gathered weights are freed after each forward
    (:attr:`~meshtrain.parallel.model.ParallelModel.after_forward_only`), DDP does not wrap it (zero_stage 0 and 1:
    nothing to synchronise, every replica holds it whole), and no sync mode averages it.

    Raises:
        ConfigError: ``data.packing = "document"`` and ``eos_id`` is None (a tokenizer without EOS).
    """
    p, b = cfg.parallel, cfg.batch
    if frozen:
        model.requires_grad_(False)
        p = dataclasses.replace(p, hierarchical_allreduce=False)  # no DDP to make hierarchical
    eos = _packing_eos(cfg, eos_id) if not conversations else None  # conversations: their ids come with the batch
    document_masking = eos is not None or (conversations and cfg.data.packing == "document")
    _set_balance_group(model, dims)
    device_type = next(model.parameters()).device.type
    compiled = blocks_compiled(cfg.train.compile, compile_eligible(cfg.model.type, p.sync_mode),
                               device_type)
    blockwise = {"recompute": cfg.train.recompute, "compiled": compiled,
                 "adapt": (lambda part: adapt(part, cfg.adapter, cfg.model)) if cfg.adapter.lora_rank else None}
    if dims.pp_enabled:
        tokens = tokens_per_step(global_batch_size(b.micro_batch_size, b.gradient_accumulation_steps, 1),
                                 cfg.model.block_size)  # one replica's, for balancing the chunks' costs
        pipeline = parallelize_pipeline(model, dims, p, b.gradient_accumulation_steps, tokens, PipelineLoss(cfg.train.loss_chunk_mb),
                                        document_masking=document_masking, **blockwise)
        parallel: ParallelModel = PipelineModel(pipeline, dims, _sharder(dims, p, eos), autocast,
                                                compiled=compiled, after_backward=_expert_sync([pipeline.model], dims, p))
    else:
        model = parallelize_model(model, dims, p, **blockwise)
        local_sgd = (LocalSGD(model, dims.get_mesh(BATCH_MESH).get_group(), cfg.local_sgd.steps, cfg.local_sgd.warmup)
                     if p.sync_mode == "local-sgd" and not frozen else None)
        parallel = ReplicatedModel(model, dims, _sharder(dims, p, eos), autocast, gradient_sync,
                                   compiled=compiled, local_sgd=local_sgd, after_backward=_expert_sync([model], dims, p))
    parallel.masked = conversations
    parallel.loss_chunk_mb = cfg.train.loss_chunk_mb
    if frozen:
        parallel.after_forward_only = lambda: reshard(parallel.model)
        return parallel
    if cfg.train.objective == "dpo":
        parallel.dpo = {"beta": cfg.train.dpo_beta, "loss_type": cfg.train.dpo_loss,
                        "label_smoothing": cfg.train.dpo_label_smoothing}
    sync = _sync_mode(parallel, dims, cfg)
    if sync is not None:
        parallel.sync = sync
    return parallel


def _sync_mode(parallel: ParallelModel, dims: ParallelDims, cfg: Config):
    """DiLoCo's outer loop around ``parallel`` (elastic when this job is one worker of several), or None."""
    p = cfg.parallel
    replicated = p.zero_stage < 2 and dims.batch_degree > 1  # DDP (and ZeRO-1): the batch ranks' weights are equal
    replicas = dims.get_mesh(BATCH_MESH).get_group() if replicated else None
    if cfg.elastic:  # this job is one worker; the others are jobs too
        from meshtrain.parallel.diloco.elastic import ElasticDiLoCo
        from meshtrain.runtime.distributed import LOOPBACK_ENV

        return ElasticDiLoCo(parallel.model, cfg.model.n_layer, cfg.diloco, replicas,
                             cfg.train.collective_timeout_s, loopback=os.environ.get(LOOPBACK_ENV) == "1")
    if dims.workers > 1:
        return DiLoCo(parallel.model, dims.get_mesh(WORKER_MESH).get_group(), cfg.model.n_layer, cfg.diloco, replicas)
    return None


def _set_balance_group(model: nn.Module, dims: ParallelDims) -> None:
    """Give each router (a module with ``balance_group``, :class:`meshtrain.models.moe.layer.MoE`) the batch mesh
    (dp x sp), whose ranks' expert counts the global-batch load-balancing loss sums; none on one such rank."""
    group = dims.get_mesh(BATCH_MESH).get_group() if dims.batch_degree > 1 else None
    for module in model.modules():
        if hasattr(module, "balance_group"):
            module.balance_group = group


def _expert_fsdp(dims: ParallelDims, cfg: ParallelConfig) -> bool:
    """Whether FSDP2 shards the experts over the ``"edp"`` ranks (zero_stage 2 or 3 with more than one of them)."""
    return dims.ep_enabled and cfg.zero_stage in (2, 3) and dims.expert_replicas > 1


def _expert_sync(models: list[nn.Module], dims: ParallelDims, cfg: ParallelConfig) -> Callable[[], None] | None:
    """What averages the experts' gradients over the ``"edp"`` ranks after a step's backward, where FSDP2 does not
    (:func:`meshtrain.parallel.expert.sync_expert_gradients`); None without ep or with one such rank."""
    if not dims.ep_enabled or dims.expert_replicas == 1 or _expert_fsdp(dims, cfg):
        return None
    experts = [m for model in models for m in expert_modules(model)]
    group = dims.get_mesh(EXPERT_REPLICA_MESH).get_group()
    return lambda: sync_expert_gradients(experts, group)


def _data_parallel(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """dp over the batch mesh, the experts of ep left to the ``"edp"`` ranks (:func:`apply_dp`); a frozen model (no
    parameter requires a gradient) at zero_stage 0 or 1 as it is: DDP only synchronises gradients."""
    if cfg.zero_stage < 2 and not any(p.requires_grad for p in model.parameters()):
        return model
    experts = expert_modules(model) if dims.ep_enabled else []
    expert_mesh = dims.get_mesh(EXPERT_REPLICA_MESH) if _expert_fsdp(dims, cfg) else None
    return apply_dp(model, dims.get_mesh(BATCH_MESH), cfg.zero_stage, cfg.fsdp_unit_mb, experts, expert_mesh)


def _packing_eos(cfg: Config, eos_id: int | None) -> int | None:
    """The EOS id windows are split into documents at: ``eos_id`` with ``data.packing = "document"``, else None.

    Raises:
        ConfigError: "document" with no ``eos_id``: a tokenizer file without an EOS token (config validation
            refuses the char tokenizer before launch; a file's special tokens are known once it is read).
    """
    if cfg.data.packing != "document":
        return None
    if eos_id is None:
        raise ConfigError(f"data.packing = 'document' needs an end-of-document token, and data.tokenizer = "
                          f"'{cfg.data.tokenizer}' has none: use a tokenizer with an EOS token or data.packing = 'concat'")
    return eos_id


class PipelineLoss:
    """The loss a pipeline's last stage computes per micro-batch, inside the schedule's ``loss_parallel``
    (:class:`meshtrain.parallel.pipeline.schedule.Pipeline` enters it under tp): :func:`cross_entropy` summed over the
    supervised tokens, times :attr:`scale` (the step's :func:`meshtrain.parallel.reduce.loss_scale`), as a plain
    tensor (``to_local`` of the replicated result, so that torch's schedules, which start the backward from a plain
    gradient, hand ``loss_parallel``'s backward a DTensor one). A copy, not ``to_local``'s view: the zero-bubble
    schedules ``detach_()`` the loss after its input-gradient pass, which a view refuses."""

    def __init__(self, chunk_mb: float = DEFAULT_CHUNK_MB) -> None:
        self.chunk_mb = chunk_mb
        """``train.loss_chunk_mb`` (:func:`meshtrain.parallel.reduce.cross_entropy`)."""

    scale: float = 1.0
    model: ParallelModel | None = None
    """With DPO (its ``dpo`` set): the model whose :meth:`~meshtrain.parallel.model.ParallelModel.pair_losses` and
    ``sp_group`` the loss uses; targets then carry each row's reference log-probability as one more column
    (:meth:`meshtrain.parallel.model.PipelineModel._with_reference`)."""

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.evaluated(logits, targets)[0] * self.scale

    def evaluated(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[summed loss, count]`` (2,) of one micro-batch: the cross-entropy over the supervised tokens of
        ``targets`` (B, T) and their count, or with DPO the pairs' losses and the pairs."""
        if self.model is None or self.model.dpo is None:
            summed = local_value(cross_entropy(logits, targets, inside_loss_parallel=True, reduction="sum",
                                               chunk_mb=self.chunk_mb)).clone()
            return torch.stack([summed, supervised_count(targets).to(summed)])
        y, reference = targets[:, :-1], targets[:, -1].contiguous().view(torch.float64)  # (B, T'), (B,)
        losses = self.model.pair_losses(self.rows(logits, y, self.model.sp_group, self.chunk_mb), reference, y)
        return torch.stack([losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)])

    @staticmethod
    def rows(logits: torch.Tensor, targets: torch.Tensor, sp_group, chunk_mb: float = DEFAULT_CHUNK_MB) -> torch.Tensor:
        """Each row's log-probability of its supervised ``targets`` (:func:`meshtrain.parallel.reduce.row_logps`)."""
        return row_logps(logits, targets, sp_group, inside_loss_parallel=True, chunk_mb=chunk_mb)


def parallelize_model(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, recompute: str = "none",
                      compiled: bool = False, adapt: Callable[[nn.Module], object] | None = None) -> nn.Module:
    """Apply tp -> sp -> ep -> adapters -> per-block recomputation and compile -> dp to ``model`` (built on this
    rank's device) on ``dims``' mesh; return the module to train.

    ``model`` provides ``tp_plan``, ``tie_weights``, ``tp_split_dropout_modules``, ``blocks`` and
    ``inner_attention`` submodules (:class:`meshtrain.models.gpt.model.GPT` does). ``recompute``: ``train.recompute``
    ("none", "selective", "full"); ``compiled``: ``torch.compile`` each block (:mod:`meshtrain.parallel.recompute`);
    ``adapt``: adds LoRA adapters to the sharded model and freezes its base (:func:`meshtrain.adapters.apply.adapt`),
    before dp wraps it so that DDP and FSDP2 see which parameters train. With pp > 1 use :func:`parallelize_pipeline`.

    Raises:
        ValueError: ``dims.pp > 1``, or an unknown ``recompute``.
    """
    if dims.pp > 1:
        raise ValueError(f"pp = {dims.pp}: use parallelize_pipeline")
    model = _shard(model, dims, cfg)
    if adapt is not None:
        adapt(model)
    _attach_tp_rng(model, dims, cfg)
    _blockwise(model, model, recompute, compiled)
    model = _data_parallel(model, dims, cfg)
    _maybe_hierarchical(dims, cfg, [model])
    return model


def parallelize_pipeline(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, n_microbatches: int,
                         tokens_per_step: int, loss_fn: Callable, document_masking: bool = False,
                         recompute: str = "none", compiled: bool = False,
                         adapt: Callable[[nn.Module], object] | None = None) -> Pipeline:
    """Split ``model`` into pipeline chunks for this rank, apply tp -> sp -> per-block recomputation and
    compile -> dp to each; return the :class:`Pipeline` that trains them (``.model`` holds this rank's
    parameters, unwrapped).

    ``n_microbatches``: micro-batches per step; ``tokens_per_step``: for balancing the chunks' costs;
    ``loss_fn``: ``(logits (B, T, V), targets (B, T)) -> mean loss`` on the last stage;
    ``document_masking``: steps carry per-sample positions and document ids (``data.packing = "document"``);
    ``recompute``, ``compiled``, ``adapt``: as in :func:`parallelize_model` (``adapt`` on each chunk).
    """
    pp_mesh = dims.get_mesh(Axis.PP)
    chunks, mine, parts = split_model(model, dims.pp, pp_mesh.get_local_rank(), cfg.virtual_stages,
                                      cfg.pp_schedule, tokens_per_step)
    parts = [_shard(part, dims, cfg) for part in parts]
    for part in parts if adapt is not None else ():
        adapt(part)
    _attach_tp_rng(model, dims, cfg)
    for part in parts:
        _blockwise(part, model, recompute, compiled, split_backward=cfg.pp_schedule in ("zero-bubble", "zbv"))
    parts = [_data_parallel(part, dims, cfg) for part in parts]
    _maybe_hierarchical(dims, cfg, parts)
    from meshtrain.parallel.pipeline.schedule import Pipeline

    return Pipeline(model, parts, mine, len(chunks), pp_mesh.get_group(),
                    embedding_group(dims.stage_ranks(), cfg.pp_schedule), cfg.pp_schedule, n_microbatches, loss_fn,
                    next(model.parameters()).device, use_loss_parallel=dims.tp_enabled,
                    hidden_seq_divisor=dims.tp if cfg.tp_sequence_parallel else 1, document_masking=document_masking)


def _blockwise(part: nn.Module, model: nn.Module, recompute: str, compiled: bool, split_backward: bool = False) -> None:
    """Recomputation, then compile, on each block of ``part`` (``model``, or one of its pipeline chunks, whose
    tp dropout stream ``model.tp_rng`` the recomputation rewinds), after tp/sp and before dp: torchtitan's order.
    ``split_backward``: a zero-bubble schedule runs them (:func:`meshtrain.parallel.recompute.compile_blocks`)."""
    apply_recompute(part.blocks, recompute, getattr(model, "tp_rng", None))
    if compiled:
        compile_blocks(part.blocks, split_backward)


def _maybe_hierarchical(dims: ParallelDims, cfg: ParallelConfig, models: list[nn.Module]) -> None:
    """With ``hierarchical_allreduce``, DDP's all-reduce becomes reduce / all-reduce between nodes /
    broadcast (:mod:`meshtrain.parallel.hierarchical`); nothing to do with one replica."""
    if cfg.hierarchical_allreduce and dims.batch_degree > 1:
        apply_hierarchical_allreduce(models, dims.batch_groups())


def _shard(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """tp, then sp, then ep on ``model`` (a whole model or one pipeline chunk)."""
    if dims.tp_enabled:
        model = apply_tp(model, dims.get_mesh(Axis.TP), cfg.tp_sequence_parallel)
    if dims.sp_enabled and cfg.sp_mode == "usp":  # Ulysses inside, ring across: the sp mesh split in two
        dims.split_sp(cfg.sp_ulysses)
        model = apply_sp(model, dims.get_mesh(Axis.SP), cfg.sp_mode, dims.get_mesh(SP_ULYSSES_MESH),
                         dims.get_mesh(SP_RING_MESH))
    elif dims.sp_enabled:
        model = apply_sp(model, dims.get_mesh(Axis.SP), cfg.sp_mode)
    if dims.ep_enabled:
        model = apply_ep(model, dims.get_mesh(EXPERT_MESH))
    return model


def _attach_tp_rng(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> None:
    """Run the dropouts on tp-split activations on a per-rank stream (:mod:`meshtrain.parallel.rng`): the model's
    own, and the LoRA adapters' on row-parallel inputs (:func:`meshtrain.adapters.lora.tp_split_dropouts`)."""
    if dims.tp_enabled:
        model.tp_rng = TPRegionRNG(next(model.parameters()).device)
        for module in [*model.tp_split_dropout_modules(cfg.tp_sequence_parallel), *tp_split_dropouts(model)]:
            model.tp_rng.attach(module)


def local_batch(x: torch.Tensor, y: torch.Tensor, dims: ParallelDims, sp_rank: int, sp_mode: str,
                eos_id: int | None = None, doc_ids: torch.Tensor | None = None, sp_ulysses: int = 1) -> LocalBatch:
    """This rank's tokens of a micro-batch: ``x, y`` (B, T) -> (B, T/sp) each, their global positions
    (T/sp,) int64 (a contiguous chunk for Ulysses, chunks i and 2*sp-1-i for ring attention, for USP piece u of
    chunks r and 2R-1-r with ``sp_rank = r * sp_ulysses + u``), and None.

    With ``eos_id`` (``data.packing = "document"``) the documents are found in the whole windows first
    (:func:`meshtrain.data.packing.pack_documents`): positions become per sample, (B, T/sp), restarting at
    each document and cut like the tokens, and the fourth item is the document ids (B, T) of the whole
    window, which every rank keeps: Ulysses attends over all T tokens of its heads, and tp ranks share them.
    Prepared conversations bring their ``doc_ids`` (B, T) with the batch instead."""
    T = x.size(1)
    positions = None
    if doc_ids is not None:
        positions = document_positions(doc_ids)  # (B, T)
    elif eos_id is not None:
        doc_ids, positions = pack_documents(x, eos_id)  # (B, T) each
    if not dims.sp_enabled:
        return x, y, (torch.arange(T, device=x.device) if positions is None else positions), doc_ids
    shard = [shard_sequence(t, 1, sp_rank, dims.sp, sp_mode, sp_ulysses) for t in (x, y)]  # (B, T/sp) each
    positions = (sequence_positions(T, sp_rank, dims.sp, sp_mode, device=x.device, ulysses=sp_ulysses)
                 if positions is None
                 else shard_sequence(positions, 1, sp_rank, dims.sp, sp_mode, sp_ulysses))  # (T/sp,) or (B, T/sp)
    return shard[0], shard[1], positions, doc_ids


def _sharder(dims: ParallelDims, cfg: ParallelConfig, eos_id: int | None = None) -> Callable:
    """``(x, y[, doc_ids]) -> (x, y, positions, doc_ids)``: this rank's sp shard of a micro-batch (:func:`local_batch`)."""
    sp_rank, mode, ulysses = dims.rank_of(Axis.SP), cfg.sp_mode, cfg.sp_ulysses
    return lambda x, y, doc_ids=None: local_batch(x, y, dims, sp_rank, mode, eos_id, doc_ids, ulysses)
