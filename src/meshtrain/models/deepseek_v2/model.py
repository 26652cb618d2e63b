"""DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434): DeepSeek-V3's decoder (:mod:`meshtrain.models.deepseek_v3.model`:
multi-head latent attention, shared experts, dense first layers) with V2's router: softmax scores, greedy or
group-limited greedy top-k, no selection bias, the weights the chosen scores times ``routed_scaling_factor``.

Shape legend: N tokens, C = n_embd, E = num_experts, k = num_experts_per_tok, G = n_group.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.base import LayeredLM
from meshtrain.models.deepseek_v3.model import DeepseekBlock, DeepseekMoE, DeepseekV3, rope_frequencies
from meshtrain.models.registry import ModelConfig


class DeepseekV2MoE(DeepseekMoE):
    """DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066) with DeepSeek-V2's routing (:meth:`route`); its shared experts,
    dispatch and experts are DeepSeek-V3's. The selection bias ``expert_bias`` stays 0 and unused."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.group_limited = cfg.topk_method == "group_limited_greedy"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (N, C) -> (probs (N, E), weights (N, k), experts (N, k)), in fp32.

        ``s = softmax(x W_r^T)`` (V2 report, Sec. 2.1.2, Eq. 23-24 with the shared experts apart); with
        "group_limited_greedy" the G groups ranked by their best score, the ``topk_group`` best kept and the rest
        masked to 0 (``transformers``' ``DeepseekV2TopkRouter``; every kept score is > 0); the k largest scores'
        experts, weighted by those scores (not renormalised) times ``routed_scaling_factor``."""
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)  # (N, E)
        scores, (N, E) = probs, probs.shape
        if self.group_limited:
            group_best = probs.view(N, self.n_group, -1).amax(dim=-1)  # (N, G)
            groups = group_best.topk(self.topk_group, dim=-1).indices  # (N, topk_group)
            keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, groups, True)  # (N, G)
            scores = probs.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), 0.0)  # (N, E)
        weights, experts = scores.topk(self.top_k, dim=-1)  # (N, k) each
        if self.seq_balance:
            self._probs = probs
        return probs, weights * self.scale, experts


class DeepseekV2Block(DeepseekBlock):
    """:class:`meshtrain.models.deepseek_v3.model.DeepseekBlock` whose MoE layers route as DeepSeek-V2's."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        if isinstance(self.mlp, DeepseekMoE):
            self.mlp = DeepseekV2MoE(cfg)  # every weight is drawn by the model's init_weights afterwards


class DeepseekV2(DeepseekV3):
    """DeepSeek-V2 decoder returning logits (B, T, V): DeepSeek-V3's over :class:`DeepseekV2Block`\\ s, without
    multi-token prediction."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        self.inv_freq, self.rope_scale = rope_frequencies(cfg)  # plain values: not parameters, not in checkpoints
        self.mtp_logits = None
        LayeredLM.__init__(self, cfg, vocab_size, lambda i: DeepseekV2Block(cfg, i),
                           head={"norm": lambda: nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)})
