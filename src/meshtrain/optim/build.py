"""The optimizer of a run, built from its row of :data:`meshtrain.optim.table.TABLE`: AdamW, SGD or Muon (with
AdamW on what Muon does not take), weight decay on matrices only, and the learning-rate schedule. The trainer, the
parameter-server run and the planner's calibration (which times the same AdamW kernels, ``planner.calibrate``)
share it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from meshtrain.config.sections import Config, OptimConfig
from meshtrain.optim.muon import Muon
from meshtrain.optim.schedule import lr_at, scaled_optim
from meshtrain.optim.table import TABLE, takes_muon


def adamw_kernels(params: list[nn.Parameter], optim: OptimConfig) -> dict[str, bool]:
    """AdamW's implementation for ``params``: with ``optim.fused``, the fused kernel for plain tensors and
    foreach kernels (one per operation over all tensors) for DTensors, whose resumed optimizer states the
    fused kernel rejects; otherwise, or for a mix of both (tp keeps some parameters plain; neither kind
    of kernel takes a mix), torch's default (a per-tensor loop on CPU)."""
    kinds = {isinstance(p, DTensor) for p in params}
    if not optim.fused or len(kinds) != 1:
        return {}
    return {"foreach": True} if kinds == {True} else {"fused": True}


def param_groups(named: Iterable[tuple[str, nn.Parameter]], optim: OptimConfig) -> list[dict]:
    """The trained parameters in groups: with Muon, its matrices (:func:`meshtrain.optim.table.takes_muon`, decayed)
    first; then matrices (decayed) and vectors (norm weights and biases, undecayed), with Muon at AdamW's own
    learning rate ``muon_adamw_lr`` (0 = ``lr``). Empty groups are dropped (LoRA adapters are all matrices)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    muon = TABLE[optim.name].hidden_matrices
    taken = [p for n, p in named if muon and takes_muon(n, tuple(p.shape))]
    rest = [p for n, p in named if not (muon and takes_muon(n, tuple(p.shape)))]
    extra = {"muon": False, "lr": optim.muon_adamw_lr or optim.lr} if muon else {}
    groups = [{"params": taken, "weight_decay": optim.weight_decay, "muon": True},
              {"params": [p for p in rest if p.dim() >= 2], "weight_decay": optim.weight_decay, **extra},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, **extra}]
    return [g for g in groups if g["params"]]


def _kind(optim: OptimConfig, adamw_params: list[nn.Parameter]) -> tuple[type, dict]:
    """The torch optimizer class of ``optim.name`` and its keyword arguments."""
    if optim.name == "sgd":
        return torch.optim.SGD, {"lr": optim.lr}
    adamw = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), **adamw_kernels(adamw_params, optim)}
    if optim.name == "adamw":
        return torch.optim.AdamW, adamw
    return Muon, {**adamw, "momentum": optim.muon_momentum, "nesterov": optim.muon_nesterov,
                  "ns_steps": optim.muon_ns_steps, "ns_dtype": optim.muon_ns_dtype,
                  "lr_adjust": optim.muon_lr_adjust, "exchange": optim.muon_exchange}


def build_optimizer(named: Iterable[tuple[str, nn.Parameter]], cfg: Config, global_batch_size: int,
                    zero_group: ProcessGroup | None = None) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The optimizer of ``optim.name`` over the named parameters ``named`` (``model.named_parameters()``; those
    without ``requires_grad`` are left out), grouped by :func:`param_groups`, and its schedule, at the learning
    rate of ``global_batch_size`` (:func:`meshtrain.optim.schedule.scaled_optim`). "adamw": AdamW; "sgd": plain SGD,
    its weight decay an L2 term; "muon": :class:`meshtrain.optim.muon.Muon`.

    With ``zero_group`` (``parallel.zero_stage = 1`` over DDP), torch's ``ZeroRedundancyOptimizer`` wraps
    the optimizer: each rank of the group keeps the states of its share of the parameters (about 1/n of
    them), updates those parameters, and broadcasts them to the others (ZeRO stage P_os, Rajbhandari et al.
    2020, Sec. 5); with Muon each rank so orthogonalizes its share of the matrices only. Its checkpoints are
    those of the plain optimizer (:func:`meshtrain.checkpoint.store.save`)."""
    optim = scaled_optim(cfg.optim, global_batch_size)
    groups = param_groups(named, optim)
    kind, kwargs = _kind(optim, [p for g in groups if not g.get("muon") for p in g["params"]])
    if zero_group is None:
        optimizer = kind(groups, **kwargs)
    else:
        optimizer = ZeroRedundancyOptimizer(groups, kind, process_group=zero_group, **kwargs)
    scheduler = LambdaLR(optimizer, lambda s: lr_at(s, optim, cfg.train.steps) / optim.lr)
    return optimizer, scheduler
