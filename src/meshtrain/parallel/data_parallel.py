"""Data parallelism: DDP (zero_stage 0 and 1) or FSDP2 ``fully_shard`` (zero_stage 2 and 3) over the ranks that
hold different tokens: the ``"dp_sp"`` mesh (dp, and sp whose ranks hold different parts of each
sample; a gradient is averaged over both, docs/architecture.md, "Layers").

- zero_stage 0: ``DistributedDataParallel`` on that process group; gradients are all-reduced in
  buckets, overlapped with backward (Li et al. 2020, "PyTorch Distributed", VLDB, Sec. 3.2). DDP does
  not take the ``DTensor`` parameters of tensor parallelism, so with tp > 1 zero_stage 0 uses PyTorch's
  FSDP2-based ``replicate`` instead (the same all-reduce of gradients, per parameter group).
- zero_stage 1: the same DDP; the optimizer shards its states instead (``ZeroRedundancyOptimizer``,
  :func:`meshtrain.optim.build_optimizer`; ZeRO stage P_os, Rajbhandari et al. 2020, Sec. 5).
- zero_stage 3: units of consecutive transformer blocks (:func:`meshtrain.rules.support.fsdp_units`: at
  least ``parallel.fsdp_unit_mb`` of parameters each, one block per unit at 0) and then the root are
  ``fully_shard``-ed: parameters, gradients and AdamW states are sharded 1/dp; each unit's parameters
  are all-gathered before its forward and again before its backward, gradients reduce-scattered
  (Rajbhandari et al. 2020, ZeRO, Sec. 5, stage P_os+g+p). As in torchtitan, the last unit and the
  root keep their parameters after forward: backward starts with them, so gathering them again would
  only cost time.
- zero_stage 2: the same wrapping with ``reshard_after_forward=False`` everywhere: parameters gathered
  in forward stay unsharded through backward (one all-gather per step instead of two), so in-step
  memory is that of ZeRO-2 (sharded gradients and optimizer states, full parameters), as torchtitan
  maps it.

Gradient accumulation: :func:`gradient_sync` turns the gradient collective off on all but the last
micro-step, so a step costs one all-reduce (or one reduce-scatter) whatever the accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from meshtrain.rules.support import fsdp_units


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int, unit_mb: float = 0.0,
             experts: list[nn.Module] = (), expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Wrap ``model`` for data parallelism over the 1-D ``dp_mesh``; return the module to train.

    ``model`` must expose ``blocks`` (an ``nn.ModuleDict``) for sharding with FSDP2, in units of at
    least ``unit_mb`` MiB of this rank's fp32 parameters (``parallel.fsdp_unit_mb``; 0 = one unit per
    block). Its parameters may already be ``DTensor`` shards of a tp mesh of the same root mesh (2-D:
    FSDP2 shards them further along dp). With one rank and zero_stage 0 or 1 the model is returned as is.

    ``experts``: modules whose parameters expert parallelism split over ``ep`` (:mod:`meshtrain.parallel.expert`):
    left out of the wrapping over ``dp_mesh``. At zero_stage 2 and 3 with an ``expert_mesh`` (the ``"edp"`` ranks that
    hold the same experts) each is first ``fully_shard``-ed over it along dim 1 (the expert rows; dim 0 is ep's), which
    averages their gradients over it; otherwise :func:`meshtrain.parallel.expert.sync_expert_gradients` does.

    Raises:
        ValueError: ``zero_stage`` not in (0, 1, 2, 3).
    """
    ignored = {p for m in experts for p in m.parameters()}
    if zero_stage in (0, 1):  # zero_stage 1 shards the optimizer states, not the model
        if dp_mesh.size() == 1:
            return model
        if any(isinstance(p, DTensor) for p in model.parameters() if p not in ignored):
            replicate(model, mesh=dp_mesh, ignored_params=ignored or None)
            return model
        if ignored:
            DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, p in model.named_parameters() if p in ignored])
        device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage = {zero_stage} is not supported: use 0, 1, 2 or 3")
    if expert_mesh is not None:
        for module in experts:
            fully_shard(module, mesh=expert_mesh, shard_placement_fn=lambda p: Shard(1),
                        reshard_after_forward=zero_stage == 3)
        ignored = set()  # FSDP2 leaves modules it already manages to them
    blocks = list(model.blocks.values())
    units, _ = fsdp_units([local_bytes(block) for block in blocks], unit_mb * 2**20)  # the rest stays in the root
    placement = partial(fsdp_placement, dp=dp_mesh.size())
    for i, unit in enumerate(units):
        modules = [blocks[j] for j in unit]
        last = i == len(units) - 1
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=dp_mesh, shard_placement_fn=placement,
                    reshard_after_forward=zero_stage == 3 and not last,
                    ignored_params={p for m in modules for p in m.parameters() if p in ignored} or None)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=placement, reshard_after_forward=False,
                ignored_params=ignored or None)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered weights FSDP2 keeps after a forward (the root's and the last unit's, and every unit's at
    zero_stage 2, ``reshard_after_forward=False``): each rank then holds its shards alone. For a model that only runs
    forward (DPO's frozen reference copy), after each of its forwards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_placement(param: nn.Parameter, dp: int) -> Shard | None:
    """The dim FSDP2 shards ``param`` along over ``dp`` ranks: dim 0 (None, FSDP2's default), but dim 1 for a
    matrix that tp already splits along dim 0 unevenly for ``tp * dp`` (the 65-row vocabulary of a character
    corpus at tp = 2, dp = 4). Sharding that dim again nests an uneven split inside another, and torch 2.13's
    chunk list of such a shard (``_StridedShard``) overlaps its neighbour's, so DCP refuses to save it."""
    if not isinstance(param, DTensor) or param.dim() < 2:
        return None
    tp = 1
    for mesh_dim, p in enumerate(param.placements):
        if isinstance(p, Shard) and p.dim == 0:
            tp *= param.device_mesh.size(mesh_dim)
    return Shard(1) if tp > 1 and param.shape[0] % (tp * dp) else None


def local_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters on this rank (a ``DTensor``'s local shard), as fp32."""
    return sum(4 * (p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, backward synchronises gradients across dp only if ``enabled``."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
