"""Qwen2-MoE (Qwen Team 2024, "Qwen1.5-MoE" / Qwen2 Technical Report, arXiv:2407.10671, Sec. 2.2.2): Qwen2's attention
(q, k, v biases; :mod:`meshtrain.models.qwen2.model`) with every block's MLP routed experts plus a shared expert
gated by ``sigmoid(x w_g)`` (:class:`meshtrain.models.moe.layer.MoE` with ``shared_expert_ffn``)."""

from __future__ import annotations

from meshtrain.models.qwen2.model import Qwen2


class Qwen2MoE(Qwen2):
    """Qwen2 whose MLPs are routed experts and a shared expert."""

    MOE = True
