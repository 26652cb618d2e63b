"""Parallel strategies, each ``apply_<x>(model, mesh, ...) -> model`` in its own file, composed here.

:func:`parallelize` applies them in one fixed order (DESIGN.md, "Composition"):

1. pp split -- :func:`meshtrain.parallel.pipeline.split_model`: this rank's chunks of consecutive
   layers (:func:`parallelize_pipeline`); each chunk then gets 2-4 on its own;
2. tp -- :func:`meshtrain.parallel.tensor.apply_tp`: DTensor shards of each block's matrices;
3. sp -- :func:`meshtrain.parallel.sequence.apply_sp`: attention over a sequence shard (Ulysses or ring);
4. dp -- :func:`meshtrain.parallel.data.apply_dp`: DDP / FSDP2 over the ``"dp_sp"`` mesh, last, so that
   it wraps (and, for FSDP2, shards further) the parameters tp produced; optionally with DDP's
   all-reduce made hierarchical (:mod:`meshtrain.parallel.hierarchical`). Local SGD and the parameter
   server replace this all-reduce altogether (:mod:`meshtrain.parallel.local_sgd`,
   :mod:`meshtrain.parallel.async_ps`).

Dropout streams are set up after tp and sp (:mod:`meshtrain.parallel.rng`), since sp replaces the
attention modules whose dropout runs on the per-tp-rank stream. No strategy module imports another.
"""

from __future__ import annotations

import torch
from torch import nn

from collections.abc import Callable

from meshtrain.config import ParallelConfig
from meshtrain.mesh import BATCH_MESH, Axis, ParallelDims
from meshtrain.parallel.data import apply_dp
from meshtrain.parallel.hierarchical import apply_hierarchical_allreduce
from meshtrain.parallel.pipeline import Pipeline, embedding_group, split_model
from meshtrain.parallel.rng import TPRegionRNG
from meshtrain.parallel.sequence import apply_sp, sequence_positions, shard_sequence
from meshtrain.parallel.tensor import apply_tp


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """Apply tp -> sp -> dp to ``model`` (built on this rank's device) on ``dims``' mesh; return the module to train.

    ``model`` provides ``tp_plan``, ``tie_weights``, ``tp_split_dropout_modules``, ``blocks`` and
    ``inner_attention`` submodules (:class:`meshtrain.models.gpt.GPT` does). With pp > 1 use
    :func:`parallelize_pipeline`.
    """
    if dims.pp > 1:
        raise ValueError(f"pp = {dims.pp}: use parallelize_pipeline")
    model = _shard(model, dims, cfg)
    _attach_tp_rng(model, dims, cfg)
    model = apply_dp(model, dims.get_mesh(BATCH_MESH), cfg.zero_stage, cfg.fsdp_unit_mb)
    _maybe_hierarchical(dims, cfg, [model])
    return model


def parallelize_pipeline(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, n_microbatches: int,
                         tokens_per_step: int, loss_fn: Callable) -> Pipeline:
    """Split ``model`` into pipeline chunks for this rank, apply tp -> sp -> dp to each; return the
    :class:`Pipeline` that trains them (``.model`` holds this rank's parameters, unwrapped).

    ``n_microbatches``: micro-batches per step; ``tokens_per_step``: for balancing the chunks' costs;
    ``loss_fn``: ``(logits (B, T, V), targets (B, T)) -> mean loss`` on the last stage.
    """
    pp_mesh = dims.get_mesh(Axis.PP)
    chunks, mine, parts = split_model(model, dims.pp, pp_mesh.get_local_rank(), cfg.virtual_stages,
                                      cfg.pp_schedule, tokens_per_step)
    parts = [_shard(part, dims, cfg) for part in parts]
    _attach_tp_rng(model, dims, cfg)
    parts = [apply_dp(part, dims.get_mesh(BATCH_MESH), cfg.zero_stage, cfg.fsdp_unit_mb) for part in parts]
    _maybe_hierarchical(dims, cfg, parts)
    return Pipeline(model, parts, mine, len(chunks), pp_mesh.get_group(),
                    embedding_group(dims.mesh.mesh, cfg.pp_schedule), cfg.pp_schedule, n_microbatches, loss_fn,
                    next(model.parameters()).device, use_loss_parallel=dims.tp_enabled,
                    hidden_seq_divisor=dims.tp if cfg.tp_sequence_parallel else 1)


def _maybe_hierarchical(dims: ParallelDims, cfg: ParallelConfig, models: list[nn.Module]) -> None:
    """With ``hierarchical_allreduce``, DDP's all-reduce becomes reduce / all-reduce between nodes /
    broadcast (:mod:`meshtrain.parallel.hierarchical`); nothing to do with one replica."""
    if cfg.hierarchical_allreduce and dims.batch_degree > 1:
        apply_hierarchical_allreduce(models, dims.batch_groups())


def _shard(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """tp, then sp, on ``model`` (a whole model or one pipeline chunk)."""
    if dims.tp_enabled:
        model = apply_tp(model, dims.get_mesh(Axis.TP), cfg.tp_sequence_parallel)
    if dims.sp_enabled:
        model = apply_sp(model, dims.get_mesh(Axis.SP), cfg.sp_mode)
    return model


def _attach_tp_rng(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> None:
    """Run the dropouts on tp-split activations on a per-rank stream (:mod:`meshtrain.parallel.rng`)."""
    if dims.tp_enabled:
        model.tp_rng = TPRegionRNG(next(model.parameters()).device)
        for module in model.tp_split_dropout_modules(cfg.tp_sequence_parallel):
            model.tp_rng.attach(module)


def local_batch(x: torch.Tensor, y: torch.Tensor, dims: ParallelDims, sp_rank: int,
                sp_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens of a micro-batch: ``x, y`` (B, T) -> (B, T/sp) each, and their global
    positions (T/sp,) int64 (a contiguous chunk for Ulysses, chunks i and 2*sp-1-i for ring attention)."""
    T = x.size(1)
    if not dims.sp_enabled:
        return x, y, torch.arange(T, device=x.device)
    shard = [shard_sequence(t, 1, sp_rank, dims.sp, sp_mode) for t in (x, y)]  # (B, T/sp) each
    return shard[0], shard[1], sequence_positions(T, sp_rank, dims.sp, sp_mode, device=x.device)
