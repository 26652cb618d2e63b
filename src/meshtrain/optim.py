"""The optimizer and its learning-rate schedule: AdamW with weight decay on matrices only, linear warmup
then cosine decay, at the learning rate of the run's global batch. The trainer, the parameter-server run
and the planner's calibration (which times the same AdamW kernels, ``planner.calibrate``) share it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from meshtrain.batch_math import scaled_lr
from meshtrain.config.sections import Config, OptimConfig


def adamw_kernels(params: list[nn.Parameter], optim: OptimConfig) -> dict[str, bool]:
    """AdamW's implementation for ``params``: with ``optim.fused``, the fused kernel for plain tensors and
    foreach kernels (one per operation over all tensors) for DTensors, whose resumed optimizer states the
    fused kernel rejects; otherwise, or for a mix of both (tp keeps some parameters plain; neither kind
    of kernel takes a mix), torch's default (a per-tensor loop on CPU)."""
    kinds = {isinstance(p, DTensor) for p in params}
    if not optim.fused or len(kinds) != 1:
        return {}
    return {"foreach": True} if kinds == {True} else {"fused": True}


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr``.

    Warmup ``lr * (step+1) / (warmup_steps+1)``; cosine decay (Loshchilov & Hutter 2017, SGDR, Eq. 5,
    one cycle without restarts) from ``lr`` at ``warmup_steps`` to ``min_lr`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def scaled_optim(cfg: OptimConfig, global_batch_size: int) -> OptimConfig:
    """``cfg`` with ``lr`` and ``min_lr`` scaled to ``global_batch_size`` by ``cfg.lr_scaling``
    (:func:`meshtrain.batch_math.scaled_lr`); the warmup and the cosine shape are unchanged."""
    factor = scaled_lr(1.0, global_batch_size, cfg.reference_batch_size, cfg.lr_scaling)
    return dataclasses.replace(cfg, lr=cfg.lr * factor, min_lr=cfg.min_lr * factor)


def build_optimizer(params: Iterable[nn.Parameter], cfg: Config, global_batch_size: int,
                    zero_group: ProcessGroup | None = None) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW (``optim.name = "sgd"``: plain SGD, its weight decay an L2 term) over ``params`` with weight decay on
    matrices only (norm weights and biases undecayed), and its schedule, at the learning rate of ``global_batch_size`` (:func:`scaled_optim`).

    With ``zero_group`` (``parallel.zero_stage = 1`` over DDP), torch's ``ZeroRedundancyOptimizer`` wraps
    the AdamW: each rank of the group keeps the states of its share of the parameters (about 1/n of
    them), updates those parameters, and broadcasts them to the others (ZeRO stage P_os, Rajbhandari et al.
    2020, Sec. 5). Its checkpoints are those of a plain AdamW (:func:`meshtrain.checkpoint.store.save`)."""
    optim = scaled_optim(cfg.optim, global_batch_size)
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # LoRA adapters are all matrices: no second group
    if optim.name == "sgd":
        kind, kwargs = torch.optim.SGD, {"lr": optim.lr}
    else:
        kind, kwargs = torch.optim.AdamW, {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), **adamw_kernels(params, optim)}
    if zero_group is None:
        optimizer = kind(groups, **kwargs)
    else:
        optimizer = ZeroRedundancyOptimizer(groups, kind, process_group=zero_group, **kwargs)
    scheduler = LambdaLR(optimizer, lambda s: lr_at(s, optim, cfg.train.steps) / optim.lr)
    return optimizer, scheduler
