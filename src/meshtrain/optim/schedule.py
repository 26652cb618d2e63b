"""The learning-rate schedule: linear warmup then cosine decay, at the learning rate of the run's global batch.
Torch-free."""

from __future__ import annotations

import dataclasses
import math

from meshtrain.batch_math import scaled_lr
from meshtrain.config.sections import OptimConfig


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
    """``cfg`` with ``lr`` and ``min_lr`` (and Muon's AdamW ``muon_adamw_lr``) scaled to ``global_batch_size`` by
    ``cfg.lr_scaling`` (:func:`meshtrain.batch_math.scaled_lr`); the warmup and the cosine shape are unchanged."""
    factor = scaled_lr(1.0, global_batch_size, cfg.reference_batch_size, cfg.lr_scaling)
    return dataclasses.replace(cfg, lr=cfg.lr * factor, min_lr=cfg.min_lr * factor,
                               muon_adamw_lr=cfg.muon_adamw_lr * factor)
