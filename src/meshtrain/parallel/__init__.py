"""Parallel strategies, each ``apply_<x>(model, mesh, ...) -> model`` in its own file, composed here.

:func:`parallelize` applies them in one fixed order (DESIGN.md, "Composition"):

1. pp split -- not built yet (``meshtrain.support``);
2. tp -- :func:`meshtrain.parallel.tensor.apply_tp`: DTensor shards of each block's matrices;
3. sp -- :func:`meshtrain.parallel.sequence.apply_sp`: attention over a sequence shard (Ulysses or ring);
4. dp -- :func:`meshtrain.parallel.data.apply_dp`: DDP / FSDP2 over the ``"dp_sp"`` mesh, last, so that
   it wraps (and, for FSDP2, shards further) the parameters tp produced.

Dropout streams are set up after tp and sp (:mod:`meshtrain.parallel.rng`), since sp replaces the
attention modules whose dropout runs on the per-tp-rank stream. No strategy module imports another.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.config import ParallelConfig
from meshtrain.mesh import BATCH_MESH, Axis, ParallelDims
from meshtrain.parallel.data import apply_dp
from meshtrain.parallel.rng import TPRegionRNG
from meshtrain.parallel.sequence import apply_sp, sequence_positions, shard_sequence
from meshtrain.parallel.tensor import apply_tp


def parallelize(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig) -> nn.Module:
    """Apply tp -> sp -> dp to ``model`` (built on this rank's device) on ``dims``' mesh; return the module to train.

    ``model`` provides ``tp_plan``, ``tie_weights``, ``tp_split_dropout_modules``, ``blocks`` and
    ``inner_attention`` submodules (:class:`meshtrain.models.gpt.GPT` does).
    """
    if dims.tp_enabled:
        model = apply_tp(model, dims.get_mesh(Axis.TP), cfg.tp_sequence_parallel)
    if dims.sp_enabled:
        model = apply_sp(model, dims.get_mesh(Axis.SP), cfg.sp_mode)
    if dims.tp_enabled:
        model.tp_rng = TPRegionRNG(next(model.parameters()).device)
        for module in model.tp_split_dropout_modules(cfg.tp_sequence_parallel):
            model.tp_rng.attach(module)
    return apply_dp(model, dims.get_mesh(BATCH_MESH), cfg.zero_stage)


def local_batch(x: torch.Tensor, y: torch.Tensor, dims: ParallelDims, sp_rank: int,
                sp_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens of a micro-batch: ``x, y`` (B, T) -> (B, T/sp) each, and their global
    positions (T/sp,) int64 (a contiguous chunk for Ulysses, chunks i and 2*sp-1-i for ring attention)."""
    T = x.size(1)
    if not dims.sp_enabled:
        return x, y, torch.arange(T, device=x.device)
    shard = [shard_sequence(t, 1, sp_rank, dims.sp, sp_mode) for t in (x, y)]  # (B, T/sp) each
    return shard[0], shard[1], sequence_positions(T, sp_rank, dims.sp, sp_mode, device=x.device)
