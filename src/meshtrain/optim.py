"""Which AdamW kernels a set of parameters gets: shared by the trainer (``train.build_optimizer``) and
the planner's calibration, which times the same kernels (``planner.calibrate``)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.config import OptimConfig


def adamw_kernels(params: list[nn.Parameter], optim: OptimConfig) -> dict[str, bool]:
    """AdamW's implementation for ``params``: with ``optim.fused``, the fused kernel for plain tensors and
    foreach kernels (one per operation over all tensors) for DTensors, whose resumed optimizer states the
    fused kernel rejects; otherwise, or for a mix of both (tp keeps some parameters plain; neither kind
    of kernel takes a mix), torch's default (a per-tensor loop on CPU)."""
    kinds = {isinstance(p, DTensor) for p in params}
    if not optim.fused or len(kinds) != 1:
        return {}
    return {"foreach": True} if kinds == {True} else {"fused": True}
