"""Data parallelism: DDP (zero_stage 0) or FSDP2 ``fully_shard`` (zero_stage 2 and 3) over the ranks that
hold different tokens: the ``"dp_sp"`` mesh (dp, and sp whose ranks hold different parts of each
sample; a gradient is averaged over both, DESIGN.md "Composition").

- zero_stage 0: ``DistributedDataParallel`` on that process group; gradients are all-reduced in
  buckets, overlapped with backward (Li et al. 2020, "PyTorch Distributed", VLDB, Sec. 3.2). DDP does
  not take the ``DTensor`` parameters of tensor parallelism, so with tp > 1 zero_stage 0 uses PyTorch's
  FSDP2-based ``replicate`` instead (the same all-reduce of gradients, per parameter group).
- zero_stage 3: every transformer block and then the root are ``fully_shard``-ed: parameters,
  gradients and AdamW states are sharded 1/dp; parameters are all-gathered before each block's
  forward and backward, gradients reduce-scattered (Rajbhandari et al. 2020, ZeRO, Sec. 5, stage P_os+g+p).
- zero_stage 2: the same wrapping with ``reshard_after_forward=False``: parameters gathered in forward
  stay unsharded through backward (one all-gather per step instead of two), so in-step memory is
  that of ZeRO-2 (sharded gradients and optimizer states, full parameters), as torchtitan maps it.

Gradient accumulation: :func:`gradient_sync` turns the gradient collective off on all but the last
micro-step, so a step costs one all-reduce (or one reduce-scatter) whatever the accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_dp(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int) -> nn.Module:
    """Wrap ``model`` for data parallelism over the 1-D ``dp_mesh``; return the module to train.

    ``model`` must expose ``blocks`` (an ``nn.ModuleDict``) for per-block sharding with FSDP2. Its
    parameters may already be ``DTensor`` shards of a tp mesh of the same root mesh (2-D: FSDP2
    shards them further along dp). With one rank and zero_stage 0 the model is returned as is.

    Raises:
        ValueError: ``zero_stage`` not in (0, 2, 3).
    """
    if zero_stage == 0:
        if dp_mesh.size() == 1:
            return model
        if any(isinstance(p, DTensor) for p in model.parameters()):
            replicate(model, mesh=dp_mesh)
            return model
        device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
        return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage = {zero_stage} is not supported: use 0, 2 or 3")
    reshard = zero_stage == 3
    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 shards in place, so it is the module itself)."""
    return model.module if isinstance(model, DDP) else model


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
