"""GLM-4.5 (GLM-4.5 Team 2025, arXiv:2508.06471, Sec. 2.1): the Llama's grouped-query attention with partial RoPE,
and DeepSeek-V3's MLPs (:class:`meshtrain.models.deepseek_v3.model.DeepseekMoE` after ``first_k_dense_replace`` dense
SwiGLU layers), in the DeepSeek-V3 decoder (:class:`meshtrain.models.deepseek_v3.model.DeepseekV3`: its auxiliary
losses, tensor-parallel plan and init), without multi-token prediction.

Shape legend: B batch, T tokens (this rank's under sp), C = n_embd, nh = n_head, nkv = n_kv_head, hd = head size,
rd = the features RoPE rotates (``int(hd * partial_rotary_factor)``). Module names are the Llama's (``blocks.3.attn.q``,
``blocks.3.mlp.router``, ``blocks.3.mlp.shared_experts.up``); the Hugging Face names are in ``hf_names.py``.
"""

from __future__ import annotations


import torch
import torch.nn as nn

from meshtrain.models.base import LayeredLM
from meshtrain.models.deepseek_v3.model import DeepseekBlock, DeepseekV3
from meshtrain.models.glm4_moe.keys import rotary_dim
from meshtrain.models.llama.model import LlamaAttention, rotate
from meshtrain.models.registry import ModelConfig


class PartialRopeAttention(LlamaAttention):
    """:class:`meshtrain.models.llama.model.LlamaAttention` whose RoPE (Su et al. 2021, arXiv:2104.09864, Eq. 34;
    the halves convention) rotates only the first rd features of each head of q and k; the other hd - rd pass
    unrotated (GPT-NeoX's partial rotary, as ``transformers``' ``Glm4Moe`` ``apply_rotary_pos_emb``). Biases on q, k
    and v with ``attention_bias``; q/k RMSNorm per head, before RoPE, with ``qk_norm``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, bias=cfg.attention_bias, qk_norm=cfg.qk_norm)
        self.rd = rotary_dim(cfg)

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``t`` (B, h, T, hd), ``cos, sin`` (T, rd) or (B, 1, T, rd) -> (B, h, T, hd): the first rd features
        rotated, the rest as they are."""
        return torch.cat([rotate(t[..., :self.rd], cos, sin), t[..., self.rd:]], dim=-1)


class Glm4MoeBlock(DeepseekBlock):
    """DeepSeek-V3's block (:class:`meshtrain.models.deepseek_v3.model.DeepseekBlock`: a dense SwiGLU in the first
    ``first_k_dense_replace`` layers, :class:`DeepseekMoE` after) with :class:`PartialRopeAttention` for MLA."""

    ATTENTION = PartialRopeAttention


class Glm4Moe(DeepseekV3):
    """GLM-4.5 decoder returning logits (B, T, V): DeepSeek-V3's model over :class:`Glm4MoeBlock`\\ s, its RoPE
    tables over the rd rotated features (``theta ** (-2i / rd)``, ``transformers``'
    ``compute_default_rope_parameters`` with ``partial_rotary_factor``), unscaled."""

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        rd = rotary_dim(cfg)
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd))  # (rd/2,) fp32
        self.rope_scale = 1.0
        self.mtp_logits = None
        LayeredLM.__init__(self, cfg, vocab_size, lambda i: Glm4MoeBlock(cfg, i),
                           head={"norm": lambda: nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)})
        self.add_mtp(cfg, lambda i: Glm4MoeBlock(cfg, i))  # DeepSeek-V3's multi-token prediction
