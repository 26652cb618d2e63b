"""DeepSeek-V3 without torch: its checks, costs and family (``model.py`` builds it; its ``[model]`` keys are in
:mod:`meshtrain.models.deepseek_v3.keys`, ``transformers``' ``DeepseekV3ForCausalLM`` format in
:mod:`meshtrain.models.deepseek_v3.hf_names`).

DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; Kimi K2 and Moonlight are the same architecture) is a pre-norm
RMSNorm decoder whose attention is multi-head latent attention (MLA, DeepSeek-V2 report, arXiv:2405.04434,
Sec. 2.1) and whose MLPs, after ``first_k_dense_replace`` dense SwiGLU layers, are DeepSeekMoE layers (Dai et al.
2024, arXiv:2401.06066): ``n_shared_experts`` always-on experts beside ``num_experts`` routed ones, chosen by sigmoid
scores with a selection-only bias, limited to ``topk_group`` of ``n_group`` expert groups (V3 report, Sec. 2.1.2,
Eq. 12-16).

Shape legend: C = n_embd, nh = n_head, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
rq = q_lora_rank (0: q projected from C directly), rkv = kv_lora_rank, E = num_experts, k = num_experts_per_tok,
F = ffn_hidden (each expert's width), S = n_shared_experts * F, D = the dense layers' width (``dense_ffn_hidden``).
Parameters of one block::

    attention  rq*(C + 1 + nh*(dn+dr))  (or C*nh*(dn+dr) without rq)  +  C*(rkv+dr) + rkv + rkv*nh*(dn+dv)  +  nh*dv*C
    MLP        3*C*D (dense layers)  or  E*C + 3*C*F*E + 3*C*S (MoE layers; E routing biases, not trained)
    norms      2*C

Multi-token prediction (``num_nextn_predict_layers`` = D, V3 report Sec. 2.2, Eq. 21-25) adds D modules of
``2*C*C + 3*C`` (the projection M_k, ``enorm``, ``hnorm``, ``shared_head.norm``) plus one block of layer index
``n_layer + k - 1`` each (:func:`mtp_params`); they share the embedding and the head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meshtrain.errors import require
from meshtrain.models.deepseek_v3 import hf_names
from meshtrain.models.deepseek_v3.keys import DeepseekV3Keys, dense_ffn_hidden, qk_head_dim
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family, TPNames
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe


def _positive(m: Any, key: str, even: bool = False, zero: bool = False) -> None:
    value = getattr(m, key)
    require(value >= (0 if zero else 1), f"model.{key} = {value} must be >= {0 if zero else 1}")
    if even:
        require(value % 2 == 0, f"model.{key} = {value} must be even: RoPE rotates pairs of features")


def _finite(m: Any, key: str, what: str, zero: bool = True) -> None:
    """``model.key`` is a finite number >= 0 (> 0 unless ``zero``)."""
    value = getattr(m, key)
    require(math.isfinite(value) and (value >= 0 if zero else value > 0),
            f"model.{key} = {value} must be a finite number {'>=' if zero else '>'} 0 ({what})")


def check_attention(m: Any) -> None:
    """MLA's widths, RoPE and YaRN; the Llama keys MLA has no use for at 0."""
    for key in ("q_lora_rank", "dense_ffn_hidden"):
        _positive(m, key, zero=True)
    for key, why in (("n_kv_head", "MLA's k and v have one head per query head, from the latent"),
                     ("head_dim", "MLA's head widths are qk_nope_head_dim, qk_rope_head_dim and v_head_dim"),
                     ("shared_expert_ffn", "DeepSeek's shared experts are n_shared_experts x ffn_hidden, ungated"),
                     ("rope_scaling_factor", "Llama 3.1's RoPE scaling; DeepSeek-V3 scales RoPE by YaRN: yarn_factor")):
        require(not getattr(m, key), f"model.{key} = {getattr(m, key)} is not supported by model.type = "
                                     f"'deepseek_v3' ({why}): use 0")
    check_mtp(m)
    _finite(m, "seq_aux_loss_alpha", "the sequence-wise balance loss's alpha; V3: 0.0001; 0 = off")
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        _positive(m, key)
    _positive(m, "qk_rope_head_dim", even=True)
    require(m.rope_theta > 1 and math.isfinite(m.rope_theta), f"model.rope_theta = {m.rope_theta} must be a finite "
                                                              f"number > 1 (DeepSeek-V3: 10000)")
    _finite(m, "yarn_factor", "0 = no YaRN scaling")
    if m.yarn_factor:
        for key in ("yarn_beta_fast", "yarn_beta_slow"):
            _finite(m, key, "YaRN's rotation bounds, 32 and 1", zero=False)
        for key in ("yarn_mscale", "yarn_mscale_all_dim"):
            _finite(m, key, "0 = absent")
        _positive(m, "rope_original_max_positions")


def check_mtp(m: Any) -> None:
    """Multi-token prediction's depth D >= 0 and its loss weight (DeepSeek-V3's and GLM-4.5's)."""
    _positive(m, "num_nextn_predict_layers", zero=True)
    _finite(m, "mtp_loss_weight", "the multi-token prediction loss's lambda; V3: 0.3, then 0.1")


def check_experts(m: Any) -> None:
    """Shared experts, dense first layers, group-limited routing and the scaling factor."""
    _positive(m, "n_shared_experts", zero=True)
    require(0 <= m.first_k_dense_replace < m.n_layer,
            f"model.first_k_dense_replace = {m.first_k_dense_replace} must be in [0, model.n_layer = {m.n_layer}) (at "
            f"least one layer of experts; a dense model is model.type = 'llama')")
    _positive(m, "n_group")
    require(m.num_experts % m.n_group == 0, f"model.num_experts = {m.num_experts} must be divisible by model.n_group "
                                            f"= {m.n_group} (groups of equal size)")
    require(m.num_experts // m.n_group >= 2, f"model.num_experts / model.n_group = {m.num_experts // m.n_group} must "
                                             f"be >= 2: a group is ranked by the sum of its two best scores")
    require(1 <= m.topk_group <= m.n_group, f"model.topk_group = {m.topk_group} must be in [1, model.n_group = "
                                            f"{m.n_group}]")
    allowed = m.topk_group * (m.num_experts // m.n_group)
    require(m.num_experts_per_tok <= allowed, f"model.num_experts_per_tok = {m.num_experts_per_tok} must be <= the "
                                              f"{allowed} experts of model.topk_group = {m.topk_group} groups")
    _finite(m, "routed_scaling_factor", "DeepSeek-V3: 2.5", zero=False)


def check(m: Any) -> None:
    """The MoE Llamas' rules (the experts' counts and choices; the Llama's head and RoPE rules do not apply to MLA),
    then MLA's and DeepSeekMoE's."""
    moe.check(m)
    _positive(m, "ffn_hidden", zero=True)
    check_attention(m)
    check_experts(m)


# --- parameters and FLOPs -----------------------------------------------------------------------------------

def attention_params(m: Any) -> int:
    """MLA's parameters (the module docstring's first line), its two latent norms included."""
    C, nh, rq, rkv = m.n_embd, m.n_head, m.q_lora_rank, m.kv_lora_rank
    q = rq * (C + 1 + nh * qk_head_dim(m)) if rq else C * nh * qk_head_dim(m)
    return q + C * (rkv + m.qk_rope_head_dim) + rkv + rkv * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * C


def mlp_params(m: Any, dense: bool) -> int:
    """One block's MLP: ``3*C*D`` dense, or router + routed experts + shared experts."""
    C, F = m.n_embd, llama.ffn_hidden(m)
    if dense:
        return 3 * C * dense_ffn_hidden(m)
    return m.num_experts * C + 3 * C * F * (m.num_experts + m.n_shared_experts)


def mlp_active_params(m: Any, dense: bool) -> int:
    """Matrix parameters one token runs through in one block's MLP: the router, its k experts and the shared ones."""
    C, F = m.n_embd, llama.ffn_hidden(m)
    if dense:
        return 3 * C * dense_ffn_hidden(m)
    return m.num_experts * C + 3 * C * F * (m.num_experts_per_tok + m.n_shared_experts)


def layer_costs(m: Any, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step as :func:`meshtrain.models.llama.spec.layer_costs`: forward ``2 *``
    active matrix parameters plus ``2*T*nh*(dn+dr)`` (``Q K^T``) and ``2*T*nh*dv`` (``A V``) per token, x3 with
    backward, and the optimizer's update of every parameter. The block is the mean over the layers (dense and MoE
    ones differ; the pipeline split sees every block alike); the head includes the multi-token prediction modules
    (each its M_k, block and a second pass through the head, V3 report Sec. 2.2)."""
    C, T, V, opt = m.n_embd, m.block_size, vocab_size, OPTIMIZER_FLOPS_PER_PARAM
    attention = attention_params(m) - m.q_lora_rank - m.kv_lora_rank  # the latent norms' scales
    scores = 2 * T * m.n_head * (qk_head_dim(m) + m.v_head_dim)
    total = 0.0
    for dense in (True, False):
        layers = m.first_k_dense_replace if dense else m.n_layer - m.first_k_dense_replace
        params = attention_params(m) + mlp_params(m, dense) + 2 * C
        total += layers * (3 * (2 * (attention + mlp_active_params(m, dense)) + scores) * tokens + opt * params)
    head = 3 * 2 * C * V * tokens + opt * C + (0 if m.tie_embeddings else opt * V * C)
    return opt * V * C, total / m.n_layer, head + mtp_costs(m, V, tokens, attention, scores, block_params)


def mtp_costs(m: Any, vocab_size: int, tokens: int, attention: int, scores: int,
              block_params_of: Callable[[Any, int], int]) -> float:
    """FLOPs per step of the D multi-token prediction modules (V3 report Sec. 2.2): each depth's M_k (C x 2C), its
    block (``attention`` matrix parameters and ``scores`` FLOPs per token of the family's attention, the MLP of a layer
    past the last one) and a second pass through the shared head, x3 with backward, and the optimizer's update of the
    depth's own parameters (``block_params_of(m, layer)``, M_k and three norms)."""
    C, opt, total = m.n_embd, OPTIMIZER_FLOPS_PER_PARAM, 0.0
    for k in range(m.num_nextn_predict_layers):
        layer = m.n_layer + k
        matrices = 2 * C * C + attention + mlp_active_params(m, layer < m.first_k_dense_replace) + C * vocab_size
        total += 3 * (2 * matrices + scores) * tokens + opt * (2 * C * C + 3 * C + block_params_of(m, layer))
    return total


def block_params(m: Any, layer: int) -> int:
    """Parameters of block ``layer`` (the module docstring's sum; routing biases are buffers)."""
    return attention_params(m) + mlp_params(m, layer < m.first_k_dense_replace) + 2 * m.n_embd


def mtp_params(m: Any) -> int:
    """Parameters of the D multi-token prediction modules (the module docstring; the shared embedding and head not
    counted again)."""
    C = m.n_embd
    return sum(2 * C * C + 3 * C + block_params(m, m.n_layer + k) for k in range(m.num_nextn_predict_layers))


TP = TPNames(colwise=("attn.q", "attn.q_b", "attn.kv_b", "mlp.gate", "mlp.up", "mlp.shared_experts.gate",
                      "mlp.shared_experts.up"),
             rowwise=("attn.proj", "mlp.down", "mlp.shared_experts.down"), extra_inputs=2, plain_inputs=True,
             experts_sequence_parallel=True)
"""MLA's heads split (DeepSeek-V2 report, Sec. 2.1, under Megatron's layout, Shoeybi et al. 2019, Sec. 3): the
up-projections of q (``q_b``, or ``q`` without ``q_lora_rank``) and of k_nope and v (``kv_b``) column-parallel by head
(nh/tp whole heads each), the output ``proj`` row-parallel. The down-projections ``q_a`` and ``kv_a`` and the latent
norms are replicated: every tp rank computes the latents whole from the whole (all-gathered) input, their gradients
whole from the all-reduced gradients of the column-parallel inputs, and the shared RoPE key k_R's gradient, which each
rank's heads add to, all-reduced (:class:`meshtrain.models.deepseek_v3.model.MLAttention`). The dense layers' SwiGLU and
the shared experts as the Llama's MLP (gate and up column-, down row-parallel); the router and the routed experts
replicated, as in the other MoE families; with ``tp_sequence_parallel`` each MoE layer takes the whole sequence
(all-gathered) and returns this rank's part of it (:meth:`meshtrain.models.deepseek_v3.model.DeepseekV3.tp_plan`). The
multi-token prediction modules are replicated whole (without ``tp_sequence_parallel``)."""


def tp_widths(m: Any) -> dict[str, int]:
    """The SwiGLU widths :data:`TP` splits: the dense layers' (if any) and the shared experts' (if any)."""
    widths = {"the dense layers' SwiGLU width (model.dense_ffn_hidden, or (n_shared_experts + num_experts_per_tok) * "
              "ffn_hidden)": dense_ffn_hidden(m) if m.first_k_dense_replace else 0,
              "the shared experts' width model.n_shared_experts * model.ffn_hidden":
                  m.n_shared_experts * llama.ffn_hidden(m)}
    return {what: width for what, width in widths.items() if width}


def planner(m: Any, vocab_size: int) -> dict[str, Any]:
    """The planner's numbers (``ModelSpec``'s fields) of a ``deepseek_v3`` ``[model]`` table with ``vocab_size`` rows:
    MLA's widths, the routed and shared experts (ungated), the dense first layers and the multi-token prediction
    blocks counted among ``layers`` (``n_layer + num_nextn_predict_layers``; each MTP block is a MoE block, its layer
    index being past ``first_k_dense_replace``). ``tests/test_planner_deepseek_v3.py`` counts their parameters and FLOPs
    against the built model; the ``deepseek-v3`` and ``kimi-k2`` presets are them at their published shapes."""
    f = llama.ffn_hidden(m)
    return dict(layers=m.n_layer + m.num_nextn_predict_layers, hidden=m.n_embd, heads=m.n_head, vocab=vocab_size,
                seq_len=m.block_size, ffn_hidden=f, kv_heads=m.n_head, activation="swiglu",
                tied_embeddings=m.tie_embeddings, learned_positions=False, head_dim=qk_head_dim(m),
                experts=m.num_experts, experts_per_token=m.num_experts_per_tok, shared_ffn=m.n_shared_experts * f,
                shared_gate=False, expert_groups=m.n_group if m.n_group > 1 else 0,
                expert_topk_groups=m.topk_group if m.n_group > 1 else 0, q_lora_rank=m.q_lora_rank,
                kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                dense_layers=m.first_k_dense_replace, dense_ffn=dense_ffn_hidden(m) if m.first_k_dense_replace else 0,
                mtp_layers=m.num_nextn_predict_layers)


def _family() -> Family:
    base = llama.FAMILY
    return replace(base, name="deepseek_v3", keys=DeepseekV3Keys, check=check, layer_costs=layer_costs,
                   summary="DeepSeek-V3 (multi-head latent attention, shared and group-limited sigmoid-routed experts, "
                           "dense first layers)",
                   model="meshtrain.models.deepseek_v3.model:DeepseekV3", kv_heads=lambda m: m.n_head,
                   head_dim=qk_head_dim, ffn_hidden=llama.ffn_hidden, planner=planner, hf=hf_names.FORMAT, tp=TP,
                   derived={"ffn_hidden": llama.ffn_hidden, "dense_ffn_hidden": dense_ffn_hidden}, experts=True,
                   aux_loss=True,
                   resume_keys=llama.RESUME_KEYS + ("num_experts", "first_k_dense_replace", "num_nextn_predict_layers"),
                   qk_clip=False, tp_widths=tp_widths)


FAMILY = _family()
"""Tensor parallelism by :data:`TP`; the planner's numbers by :func:`planner`."""
