"""Qwen3-MoE (Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388, Sec. 2): Qwen3's attention (q/k RMSNorm
per head, decoupled ``head_dim``; :mod:`meshtrain.models.qwen3.model`) with every block's MLP a mixture of 128
fine-grained experts, 8 per token in the released models, no shared expert
(:class:`meshtrain.models.moe.layer.MoE`)."""

from __future__ import annotations

from meshtrain.models.qwen3.model import Qwen3


class Qwen3MoE(Qwen3):
    """Qwen3 whose MLPs are routed experts."""

    MOE = True
