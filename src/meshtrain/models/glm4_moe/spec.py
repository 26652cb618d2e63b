"""GLM-4.5 without torch: its checks, costs and family (``model.py`` builds it; its ``[model]`` keys are in
:mod:`meshtrain.models.glm4_moe.keys`, ``transformers``' ``Glm4MoeForCausalLM`` format in
:mod:`meshtrain.models.glm4_moe.hf_names`).

GLM-4.5 (GLM-4.5 Team 2025, arXiv:2508.06471, Sec. 2.1) is a pre-norm RMSNorm decoder with grouped-query attention
(biases on q, k, v with ``attention_bias``; per-head q/k RMSNorm with ``qk_norm``), RoPE on the first
``partial_rotary_factor`` of each head's features, and DeepSeek-V3's MLPs: ``first_k_dense_replace`` dense SwiGLU layers,
then DeepSeekMoE layers (Dai et al. 2024, arXiv:2401.06066; DeepSeek-V3 report, arXiv:2412.19437, Sec. 2.1.2,
Eq. 12-16): ``n_shared_experts`` always-on experts beside ``num_experts`` routed ones, chosen by sigmoid scores plus a
selection-only bias within ``topk_group`` of ``n_group`` groups, weights scaled by ``routed_scaling_factor``.

Shape legend: C = n_embd, nh = n_head, nkv = n_kv_head, hd = head size, E = num_experts, k = num_experts_per_tok,
F = ffn_hidden (each expert's width), S = n_shared_experts * F, D = the dense layers' width. Parameters of one block::

    attention  C*nh*hd + 2*C*nkv*hd + nh*hd*C  (+ nh*hd + 2*nkv*hd biases, + 2*hd q/k norms)
    MLP        3*C*D (dense layers)  or  E*C + 3*C*F*E + 3*C*S (MoE layers; E routing biases, not trained)
    norms      2*C
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from meshtrain.errors import require
from meshtrain.models.deepseek_v3 import spec as deepseek
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family, TPNames
from meshtrain.models.glm4_moe import hf_names
from meshtrain.models.glm4_moe.keys import Glm4MoeKeys, rotary_dim
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe


def check(m: Any) -> None:
    """The Llama's attention rules and the experts' counts, then partial RoPE and DeepSeekMoE's rules
    (:func:`meshtrain.models.deepseek_v3.spec.check_experts`).

    Raises:
        ConfigError: the first broken rule, in one line naming the key.
    """
    llama.check(m)
    moe.check(m)
    require(not m.rope_scaling_factor, f"model.rope_scaling_factor = {m.rope_scaling_factor} is not supported by "
                                       f"model.type = 'glm4_moe' (GLM-4.5 has plain partial RoPE): use 0")
    require(not m.shared_expert_ffn, f"model.shared_expert_ffn = {m.shared_expert_ffn} is not supported by model.type "
                                     f"= 'glm4_moe' (its shared experts are n_shared_experts x ffn_hidden, ungated): use 0")
    require(0 < m.partial_rotary_factor <= 1 and rotary_dim(m) >= 2 and rotary_dim(m) % 2 == 0,
            f"model.partial_rotary_factor = {m.partial_rotary_factor} must be in (0, 1] with int(head size "
            f"{llama.head_dim(m)} * it) = {rotary_dim(m) if math.isfinite(m.partial_rotary_factor) else 'nan'} even "
            f"and >= 2: RoPE rotates pairs of features")
    require(m.dense_ffn_hidden >= 0, f"model.dense_ffn_hidden = {m.dense_ffn_hidden} must be >= 0")
    deepseek.check_experts(m)
    deepseek.check_mtp(m)


def block_params(m: Any, layer: int) -> int:
    """Parameters of block ``layer`` (the module docstring's sum; routing biases are buffers)."""
    attention = llama.block_params(m, m.attention_bias, m.qk_norm) - 3 * m.n_embd * llama.ffn_hidden(m) - 2 * m.n_embd
    return attention + deepseek.mlp_params(m, layer < m.first_k_dense_replace) + 2 * m.n_embd


def layer_costs(m: Any, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step as :func:`meshtrain.models.llama.spec.layer_costs`: forward ``2 *``
    active matrix parameters plus ``4*T*nh*hd`` (``Q K^T`` and ``A V``) per token, x3 with backward, and the
    optimizer's update of every parameter; the block is the mean over the dense and MoE layers."""
    C, T, opt = m.n_embd, m.block_size, OPTIMIZER_FLOPS_PER_PARAM
    hd, nh, nkv = llama.head_dim(m), m.n_head, llama.kv_heads(m)
    attention = 2 * C * nh * hd + 2 * C * nkv * hd
    total = 0.0
    for dense in (True, False):
        layers = m.first_k_dense_replace if dense else m.n_layer - m.first_k_dense_replace
        params = block_params(m, 0 if dense else m.n_layer)
        flops = 3 * (2 * (attention + deepseek.mlp_active_params(m, dense)) + 4 * T * nh * hd) * tokens
        total += layers * (flops + opt * params)
    embedding, _, head = llama.layer_costs(m, vocab_size, tokens)
    mtp = deepseek.mtp_costs(m, vocab_size, tokens, attention, 4 * T * nh * hd, block_params)
    return embedding, total / m.n_layer, head + mtp


def planner(m: Any, vocab_size: int) -> dict[str, Any]:
    """The planner's numbers (``ModelSpec``'s fields) of a ``glm4_moe`` ``[model]`` table with ``vocab_size`` rows:
    grouped-query attention of ``head_dim``-wide heads (q is ``n_head * head_dim`` wide, not ``n_embd``), its q/k/v
    biases and q/k norms, DeepSeek-V3's MLP (:func:`meshtrain.models.deepseek_v3.spec.planner`: routed and ungated
    shared experts, group-limited routing, dense first layers) and the multi-token prediction blocks counted among
    ``layers`` (``n_layer + num_nextn_predict_layers``, as DeepSeek-V3's). ``tests/test_planner_glm_v2.py`` counts
    parameters and FLOPs against the built model; the ``glm-4.5`` and ``glm-4.5-air`` presets are them at the published shapes."""
    f = llama.ffn_hidden(m)
    return dict(layers=m.n_layer + m.num_nextn_predict_layers, hidden=m.n_embd, heads=m.n_head, vocab=vocab_size, seq_len=m.block_size,
                ffn_hidden=f, kv_heads=llama.kv_heads(m), activation="swiglu", tied_embeddings=m.tie_embeddings,
                learned_positions=False, head_dim=llama.head_dim(m), qkv_bias=m.attention_bias, qk_norm=m.qk_norm,
                experts=m.num_experts, experts_per_token=m.num_experts_per_tok, shared_ffn=m.n_shared_experts * f,
                shared_gate=False, expert_groups=m.n_group if m.n_group > 1 else 0,
                expert_topk_groups=m.topk_group if m.n_group > 1 else 0, dense_layers=m.first_k_dense_replace,
                dense_ffn=deepseek.dense_ffn_hidden(m) if m.first_k_dense_replace else 0,
                mtp_layers=m.num_nextn_predict_layers)


TP = TPNames(colwise=("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up", "mlp.shared_experts.gate",
                      "mlp.shared_experts.up"),
             rowwise=("attn.proj", "mlp.down", "mlp.shared_experts.down"), head_norms=("attn.q_norm", "attn.k_norm"),
             extra_inputs=2, plain_inputs=True, experts_sequence_parallel=True)
"""Megatron's layout (Shoeybi et al. 2019, Sec. 3): q, k, v column-parallel by head (their biases with them), the
output row-parallel, the per-head q/k norms replicated over this rank's heads; the dense layers' SwiGLU and the shared
experts as the Llama's MLP; the router and routed experts replicated, each MoE layer taking the whole sequence under
``tp_sequence_parallel`` (DeepSeek-V3's plan, :meth:`meshtrain.models.deepseek_v3.model.DeepseekV3.tp_plan`)."""


def _family() -> Family:
    base = llama.family("glm4_moe", "GLM-4.5 (grouped-query attention with partial RoPE; DeepSeek-V3's shared and "
                        "group-limited sigmoid-routed experts, dense first layers)",
                        "meshtrain.models.glm4_moe.model:Glm4Moe", hf_names.FORMAT)
    return replace(base, keys=Glm4MoeKeys, check=check, layer_costs=layer_costs, planner=planner, tp=TP,
                   derived={**base.derived, "dense_ffn_hidden": deepseek.dense_ffn_hidden}, experts=True,
                   aux_loss=True,
                   resume_keys=base.resume_keys + ("num_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
                   qk_clip=False, tp_widths=deepseek.tp_widths)


FAMILY = _family()
"""Tensor parallelism by :data:`TP`; the planner's numbers by :func:`planner`; QK-clip off (the
q/k norms and biases of the GLM attention are not what it scales)."""
