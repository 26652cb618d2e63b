"""DeepSeek-V3's ``[model]`` keys and the widths and scales they derive, without torch (read by ``spec.py``,
``hf_names.py`` and ``model.py``; shape legend: :mod:`meshtrain.models.deepseek_v3.spec`).

Other families read some of them with the same names, defaults and meanings, so each key's docstring starts with the
``model.type`` names that read it: DeepSeek-V2 (:class:`meshtrain.models.deepseek_v2.keys.DeepseekV2Keys`) all but
multi-token prediction and the sequence-wise balance loss, which it refuses; GLM-4.5
(:data:`meshtrain.models.glm4_moe.keys.SHARED_KEYS`) the MoE part (dense first layers, shared experts, group-limited
routing) and multi-token prediction, not MLA."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe


@dataclass
class DeepseekV3Keys(moe.MoELlamaKeys):
    """The ``[model]`` keys of DeepSeek-V3: the MoE Llamas' (``ffn_hidden`` is each routed expert's width,
    ``num_experts`` the routed experts; ``n_kv_head``, ``head_dim``, ``shared_expert_ffn`` and Llama 3.1's RoPE
    scaling stay 0) and these."""

    q_lora_rank: int = 0
    """deepseek_v3 and deepseek_v2: rank of q's low-rank path ``q_b(RMSNorm(q_a(x)))`` (V3: 1536); 0 = q projected
    from the hidden state directly (V2-Lite, Kimi's Moonlight)."""
    kv_lora_rank: int = 512
    """deepseek_v3 and deepseek_v2: width of the compressed key/value latent ``c_KV`` (V2 report, Eq. 9; V3: 512)."""
    qk_nope_head_dim: int = 128
    """deepseek_v3 and deepseek_v2: features per head of q and k without RoPE (V3: 128)."""
    qk_rope_head_dim: int = 64
    """deepseek_v3 and deepseek_v2: features per head of the decoupled RoPE part, its key shared by every head (V2
    report, Eq. 14-19; V3: 64); even."""
    v_head_dim: int = 128
    """deepseek_v3 and deepseek_v2: features per head of v (V3: 128)."""
    rope_interleave: bool = True
    """deepseek_v3 and deepseek_v2: RoPE rotates the adjacent pairs ``(x0, x1), (x2, x3), ...`` of the RoPE part
    (DeepSeek's layout and ``transformers``' ``rope_interleave``; a V2 import always); false: its two halves, as the
    Llama."""
    yarn_factor: float = 0.0
    """deepseek_v3 and deepseek_v2: YaRN's context-extension factor (Peng et al. 2023, arXiv:2309.00071; V3: 40), with
    the pretraining context ``rope_original_max_positions``; 0 = no scaling."""
    yarn_beta_fast: float = 32.0
    """deepseek_v3 and deepseek_v2, with yarn_factor: rotations above which a frequency is kept (YaRN's beta, 32)."""
    yarn_beta_slow: float = 1.0
    """deepseek_v3 and deepseek_v2, with yarn_factor: rotations below which a frequency is divided by the factor
    (YaRN's alpha, 1)."""
    yarn_mscale: float = 0.0
    """deepseek_v3 and deepseek_v2, with yarn_factor: DeepSeek's ``mscale`` of the cos/sin scale; 0 = absent (V3:
    1)."""
    yarn_mscale_all_dim: float = 0.0
    """deepseek_v3 and deepseek_v2, with yarn_factor: DeepSeek's ``mscale_all_dim``; the softmax scale is multiplied
    by ``(0.1 * this * ln(factor) + 1)^2``; 0 = absent (V3: 1)."""
    dense_ffn_hidden: int = 0
    """deepseek_v3, deepseek_v2 and glm4_moe: SwiGLU width of the first ``first_k_dense_replace`` (dense) layers (V3:
    18432); 0 = the width of the experts a token runs, ``(n_shared_experts + num_experts_per_tok) * ffn_hidden`` (V3's
    ratio, 9 x 2048)."""
    first_k_dense_replace: int = 1
    """deepseek_v3, deepseek_v2 and glm4_moe: how many first layers have a dense SwiGLU instead of experts (V3: 3,
    GLM-4.5: 3, GLM-4.5-Air: 1); < n_layer."""
    n_shared_experts: int = 1
    """deepseek_v3, deepseek_v2 and glm4_moe: always-on experts, one SwiGLU of width ``n_shared_experts *
    ffn_hidden``, ungated (V3: 1, GLM-4.5: 1)."""
    n_group: int = 1
    """deepseek_v3, deepseek_v2 and glm4_moe: groups of routed experts (V3: 8, one per node); a token's experts come
    from its ``topk_group`` best groups, a group ranked by the sum of its two best scores (V3's and GLM-4.5's
    node-limited routing) or, in deepseek_v2 with ``topk_method = "group_limited_greedy"``, by its best score; 1 = no
    limit (GLM-4.5: 1)."""
    topk_group: int = 1
    """deepseek_v3, deepseek_v2 and glm4_moe: groups a token's experts may come from, <= n_group (V3: 4)."""
    routed_scaling_factor: float = 2.5
    """deepseek_v3, deepseek_v2 and glm4_moe: factor on the routed experts' weights (V3: 2.5, GLM-4.5: 2.5)."""
    num_nextn_predict_layers: int = 0
    """deepseek_v3 and glm4_moe (deepseek_v2: 0): multi-token prediction depths D (V3 report, Sec. 2.2; V3 and
    GLM-4.5: 1), each a projection, one block and a norm before the shared head, trained with ``mtp_loss_weight``; an
    import reads it from the checkpoint's layers ``n_layer .. n_layer + D - 1`` (a glm4_moe run may set 0 to train
    without them). Needs pp = 1."""
    mtp_loss_weight: float = 0.3
    """deepseek_v3 and glm4_moe, with num_nextn_predict_layers: lambda of the multi-token prediction loss ``(lambda /
    D) * sum_k CE_k`` added to the main loss in training (V3 report, Sec. 2.2, Eq. 25; 0.3 for its first 10T tokens,
    0.1 after)."""
    seq_aux_loss_alpha: float = 0.0
    """deepseek_v3 (deepseek_v2: 0): alpha of the complementary sequence-wise balance loss ``alpha * sum_i f_i P_i`` of
    each MoE layer, per sequence, averaged over the sequences and summed over the layers (V3 report, Sec. 2.1.2, Eq.
    17-20; V3: 0.0001), beside the selection bias; 0 = off. Needs sp = 1 (a sequence's tokens on one rank)."""

def dense_ffn_hidden(m: Any) -> int:
    """The dense layers' SwiGLU width D: ``dense_ffn_hidden``, or ``(n_shared_experts + k) * F``."""
    return m.dense_ffn_hidden or (m.n_shared_experts + m.num_experts_per_tok) * llama.ffn_hidden(m)


def qk_head_dim(m: Any) -> int:
    """Features per head of q and k: ``dn + dr``."""
    return m.qk_nope_head_dim + m.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for a factor <= 1), as DeepSeek's reference
    code and ``transformers``' ``yarn_get_mscale`` compute it (Peng et al. 2023, Eq. 22 with DeepSeek's mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_mscale(m: Any) -> float:
    """What multiplies the softmax scale ``1/sqrt(dn+dr)``: ``yarn_mscale(factor, mscale_all_dim)^2`` with YaRN and
    ``mscale_all_dim`` (``transformers``' ``yarn_apply_mscale``), else 1."""
    if not (m.yarn_factor and m.yarn_mscale_all_dim):
        return 1.0
    return yarn_mscale(m.yarn_factor, m.yarn_mscale_all_dim) ** 2
