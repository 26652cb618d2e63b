"""Mixture-of-experts MLPs without torch: the ``[model]`` keys, checks, parameter and FLOP counts, and the Hugging
Face names of a routed-experts MLP, shared by the MoE families (``mixtral``, ``qwen3_moe``, ``qwen2_moe``; the module is
:mod:`meshtrain.models.moe.layer`).

A MoE MLP replaces the SwiGLU of a Llama block by ``num_experts`` SwiGLU experts of width F (``ffn_hidden``) and a
router ``W_r`` (E, C): each token goes to the ``num_experts_per_tok`` = k experts of largest router probability and
its output is their outputs weighted by those probabilities (renormalised to sum to 1 with ``norm_topk_prob``)
(Shazeer et al. 2017, arXiv:1701.06538, Eq. 3-4; Mixtral, Jiang et al. 2024, arXiv:2401.04088, Sec. 2.1). Every
token reaches its k experts: no capacity, no token dropped ("dropless", Gale et al. 2022, arXiv:2211.15841).

Parameters per MoE MLP: ``E*C`` (router) + ``E * 3*C*F`` (experts); per token only ``k`` experts run, so the
active parameters are ``E*C + k * 3*C*F``.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from meshtrain.errors import require
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family, HFFormat, Source, TPNames
from meshtrain.models.hf_io import HFFormatError, number
from meshtrain.models.llama import spec as llama
from meshtrain.models.llama.spec import LlamaKeys

AUX_LOSS_SCOPES = ("global_batch", "micro_batch")
"""``model.router_aux_loss_scope``: where the load-balancing loss counts each expert's tokens (see :class:`MoEKeys`)."""
EXPERT_COMPUTES = ("grouped", "loop")
"""``model.moe_compute``: one grouped GEMM over all experts, or one GEMM per expert (the reference)."""


@dataclass
class MoEKeys:
    """The ``[model]`` keys of a mixture-of-experts MLP (mixtral, qwen3_moe, qwen2_moe)."""

    num_experts: int = 8
    """moe: routed experts per MoE layer (E); each is a SwiGLU MLP of width ``ffn_hidden``."""
    num_experts_per_tok: int = 2
    """moe: experts each token is routed to (top-k, k <= num_experts)."""
    norm_topk_prob: bool = True
    """moe: renormalise each token's k routing weights to sum to 1 (Mixtral always; Qwen3-MoE's ``norm_topk_prob``)."""
    router_aux_loss_coef: float = 0.001
    """moe: weight of the load-balancing loss added to the cross-entropy (Switch Transformer's alpha, Fedus et al.
    2021, arXiv:2101.03961, Eq. 4; ``transformers``' ``router_aux_loss_coef``, 0.001 by default); 0 = none."""
    router_aux_loss_scope: str = "global_batch"
    """moe: where the load-balancing loss counts the tokens each expert gets: "global_batch" (counted over every
    rank of the batch mesh, dp x sp, before the product: one process's loss on any layout; Qiu et al. 2025,
    arXiv:2501.11873) or "micro_batch" (this rank's micro-batch alone)."""
    router_bias_update_rate: float = 0.0
    """moe: DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 2.1.2; Wang et al.
    2024, arXiv:2408.15664): each expert has a routing bias, added to its router probability to pick the top-k only
    (never to weigh the outputs), which after every step moves by this rate up if the expert got fewer than the
    mean count of the step's assignments (over dp x sp), down if more; 0 = off (DeepSeek-V3: 0.001). The biases are
    saved in checkpoints; a Hugging Face export refuses them (no such tensor)."""
    moe_compute: str = "grouped"
    """moe: "grouped" (the experts' GEMMs as one ``torch._grouped_mm`` over the tokens sorted by expert) or "loop"
    (one GEMM per expert, the reference); the same arithmetic per token."""
    shared_expert_ffn: int = 0
    """moe: width of a shared SwiGLU expert every token runs besides its k routed ones, its output scaled by
    ``sigmoid(x w_g)`` (Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``, Qwen Team 2024; DeepSeekMoE's shared
    experts, Dai et al. 2024, arXiv:2401.06066, Sec. 3.2, are the ungated form); 0 = none. ``qwen2_moe`` reads it from
    ``shared_expert_intermediate_size``."""
    moe_capacity_factor: float = 0.0
    """moe: 0 = dropless (every token reaches its k experts); > 0 caps each expert at ``ceil(factor * N * k / E)``
    assignments of a rank's micro-batch of N tokens (GShard, Lepikhin et al. 2020, arXiv:2006.16668, Sec. 2.2;
    Switch Transformers, Fedus et al. 2021, Sec. 2.2): an expert keeps its assignments in token order (a token's
    choices in rank order) and drops the rest, whose outputs are 0 (the token keeps its residual); the kept weights
    are not renormalised, and the load-balancing loss counts every assignment, dropped or not."""


def check(m: Any) -> None:
    """The experts' counts, top-k, the loss coefficient and the two choices."""
    require(m.num_experts >= 2, f"model.num_experts = {m.num_experts} must be >= 2 (a mixture of experts)")
    require(1 <= m.num_experts_per_tok <= m.num_experts,
            f"model.num_experts_per_tok = {m.num_experts_per_tok} must be in [1, model.num_experts = {m.num_experts}]")
    require(m.router_aux_loss_coef >= 0 and math.isfinite(m.router_aux_loss_coef),
            f"model.router_aux_loss_coef = {m.router_aux_loss_coef} must be a finite number >= 0 (0 = none)")
    require(m.router_aux_loss_scope in AUX_LOSS_SCOPES, f"model.router_aux_loss_scope = {m.router_aux_loss_scope!r} "
                                                        f"is not valid: use one of {', '.join(AUX_LOSS_SCOPES)}")
    require(m.router_bias_update_rate >= 0 and math.isfinite(m.router_bias_update_rate),
            f"model.router_bias_update_rate = {m.router_bias_update_rate} must be a finite number >= 0 (0 = off)")
    require(m.shared_expert_ffn >= 0, f"model.shared_expert_ffn = {m.shared_expert_ffn} must be >= 0 (0 = no shared "
                                      f"expert)")
    require(m.moe_capacity_factor >= 0 and math.isfinite(m.moe_capacity_factor),
            f"model.moe_capacity_factor = {m.moe_capacity_factor} must be a finite number >= 0 (0 = dropless)")
    require(m.moe_compute in EXPERT_COMPUTES,
            f"model.moe_compute = {m.moe_compute!r} is not valid: use one of {', '.join(EXPERT_COMPUTES)}")


def shared_params(m: Any) -> int:
    """Parameters of the shared expert and its gate: ``3*C*S + C`` (S = ``shared_expert_ffn``; 0 without one)."""
    return 3 * m.n_embd * m.shared_expert_ffn + m.n_embd if m.shared_expert_ffn else 0


def mlp_params(m: Any, ffn: int) -> int:
    """Parameters of one MoE MLP: router ``E*C`` + experts ``E * 3*C*F`` + the shared expert (:func:`shared_params`)."""
    return m.num_experts * m.n_embd + m.num_experts * 3 * m.n_embd * ffn + shared_params(m)


def mlp_active_matrix_params(m: Any, ffn: int) -> int:
    """Matrix parameters one token runs through: the router, its ``k`` experts and the shared expert."""
    return m.num_experts * m.n_embd + m.num_experts_per_tok * 3 * m.n_embd * ffn + shared_params(m)


# --- Hugging Face names of the experts ----------------------------------------------------------------------

NO_SOURCE = Source("")
"""The routing biases of auxiliary-loss-free balancing: no Hugging Face tensor holds them (an import starts them at 0,
an export refuses a model that has them, :func:`check_exportable`)."""


def check_exportable(m: Any, shared: bool = False) -> None:
    """Raises HFFormatError: routing biases (``router_bias_update_rate`` > 0), which no Hugging Face MoE holds, or a
    shared expert where the format has none (``shared``: it has one)."""
    if m.shared_expert_ffn and not shared:
        raise HFFormatError(f"model.shared_expert_ffn = {m.shared_expert_ffn} trained a shared expert that {m.type}'s "
                            f"Hugging Face format has no tensor for: export it with --format safetensors, or train "
                            f"model.type = 'qwen2_moe'")
    if m.router_bias_update_rate:
        raise HFFormatError(f"model.router_bias_update_rate = {m.router_bias_update_rate} trained routing biases that "
                            f"{m.type}'s Hugging Face format has no tensor for: export it with --format safetensors")


def expert_sources(layer: str, names: tuple[str, str, str], fused: str | None, ffn: int, experts: int) -> dict[str, Source]:
    """meshtrain's ``mlp.router.weight`` and ``mlp.experts.w_gate/w_up/w_down`` (each (E, rows, cols)) of the layer whose
    Hugging Face prefix is ``layer`` (``model.layers.3.mlp``): per-expert tensors ``{layer}.experts.{e}.{name}.weight``
    of the ``names`` (gate, up, down: ``w1, w3, w2`` in Mixtral's published files, ``gate_proj, up_proj, down_proj``
    in Qwen3-MoE's), or, with ``fused`` (the prefix of ``transformers`` 5's in-memory tensors, saved as they are), the
    3-D ``{fused}.experts.gate_up_proj`` (E, 2F, C: gate rows first) and ``{fused}.experts.down_proj`` (E, C, F)."""
    if fused is not None:
        return {"mlp.router.weight": Source(f"{fused}.gate.weight"), "mlp.expert_bias": NO_SOURCE,
                "mlp.experts.w_gate": Source(f"{fused}.experts.gate_up_proj"),
                "mlp.experts.w_up": Source(f"{fused}.experts.gate_up_proj", row0=ffn),
                "mlp.experts.w_down": Source(f"{fused}.experts.down_proj")}
    gate, up, down = names
    return {"mlp.router.weight": Source(f"{layer}.gate.weight"), "mlp.expert_bias": NO_SOURCE,
            "mlp.experts.w_gate": Source(f"{layer}.experts.{{e}}.{gate}.weight", experts=experts),
            "mlp.experts.w_up": Source(f"{layer}.experts.{{e}}.{up}.weight", experts=experts),
            "mlp.experts.w_down": Source(f"{layer}.experts.{{e}}.{down}.weight", experts=experts)}


def expert_shapes(layer: str, names: tuple[str, str, str], fused: str | None, m: Any,
                  ffn: int) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`expert_sources`' tensors."""
    E, C = m.num_experts, m.n_embd
    if fused is not None:
        return {f"{fused}.gate.weight": (E, C), f"{fused}.experts.gate_up_proj": (E, 2 * ffn, C),
                f"{fused}.experts.down_proj": (E, C, ffn)}
    gate, up, down = names
    out: dict[str, tuple[int, ...]] = {f"{layer}.gate.weight": (E, C)}
    for e in range(E):
        out.update({f"{layer}.experts.{e}.{gate}.weight": (ffn, C), f"{layer}.experts.{e}.{up}.weight": (ffn, C),
                    f"{layer}.experts.{e}.{down}.weight": (C, ffn)})
    return out


TRAINING = {**llama.TRAINING, "router_aux_loss_coef": ("router_aux_loss_coef",)}
"""The attention's dropout and the load-balancing loss's weight, which training may choose (the folder's unless the
run sets them)."""


def aux_loss_coef(hf: dict[str, Any], where: Any) -> float:
    """``router_aux_loss_coef`` of a ``config.json`` filled with its defaults: a finite number >= 0.

    Raises:
        HFFormatError: not a number, negative or not finite.
    """
    value = hf.get("router_aux_loss_coef")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
        raise HFFormatError(f"'{where}': router_aux_loss_coef = {value!r} must be a finite number >= 0")
    return float(value)


def qwen_moe_keys(hf: dict[str, Any], where: Any) -> dict[str, Any]:
    """The experts' ``[model]`` keys of a Qwen MoE ``config.json`` (Qwen2-MoE's and Qwen3-MoE's spelling, filled
    with the family's defaults): expert width ``moe_intermediate_size``, ``num_experts`` (Qwen3-MoE's
    ``num_local_experts`` is an alias, its family's :attr:`meshtrain.models.family.HFFormat.aliases`), top-k,
    ``norm_topk_prob``, the load-balancing loss's weight.

    Raises:
        HFFormatError: dense layers among the sparse ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``), or a
            ``norm_topk_prob`` that is not a boolean.
    """
    if hf.get("decoder_sparse_step") != 1 or hf.get("mlp_only_layers") not in (None, []):
        raise HFFormatError(f"'{where}': decoder_sparse_step = {hf.get('decoder_sparse_step')!r} and mlp_only_layers "
                            f"= {hf.get('mlp_only_layers')!r} are not supported (dense layers among the sparse ones): "
                            f"meshtrain builds 1 and [] (experts in every layer)")
    norm = hf.get("norm_topk_prob")
    if not isinstance(norm, bool):
        raise HFFormatError(f"'{where}': norm_topk_prob = {norm!r} must be true or false")
    return dict(ffn_hidden=number(hf, "moe_intermediate_size", where, int),
                num_experts=number(hf, "num_experts", where, int),
                num_experts_per_tok=number(hf, "num_experts_per_tok", where, int), norm_topk_prob=norm,
                router_aux_loss_coef=aux_loss_coef(hf, where))


QWEN_MOE_DEFAULTS: dict[str, Any] = {
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
"""The expert keys whose defaults ``Qwen2MoeConfig`` and ``Qwen3MoeConfig`` share (``transformers`` 5.24;
``mlp_only_layers``: None in the signature, [] after ``__post_init__``); the sizes (``moe_intermediate_size``,
``num_experts``, ``num_experts_per_tok``) are each class's own."""


def qwen_moe_config(m: Any, expert_width: int) -> dict[str, Any]:
    """The experts' keys of a Qwen MoE ``config.json`` for the ``[model]`` section ``m``, the inverse of
    :func:`qwen_moe_keys`: experts in every layer, router logits not returned."""
    return dict(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok, norm_topk_prob=m.norm_topk_prob,
                router_aux_loss_coef=m.router_aux_loss_coef, moe_intermediate_size=expert_width, decoder_sparse_step=1,
                mlp_only_layers=[], output_router_logits=False)


def without_dense_width(config: dict[str, Any]) -> dict[str, Any]:
    """A Qwen MoE ``config.json`` without ``intermediate_size``: the width of the dense MLPs of ``mlp_only_layers``,
    which a model with experts in every layer has none of (``transformers`` fills its default; an export from a
    Hugging Face folder keeps the folder's, :func:`meshtrain.models.hf_carry.carried_config`)."""
    return {k: v for k, v in config.items() if k != "intermediate_size"}


def fused_prefix(present: Collection[str], fused: str) -> str | None:
    """``fused`` (``model.layers.{i}.mlp``, with ``{i}``) when the folder holds ``transformers`` 5's fused expert
    tensors (layer 0's ``gate_up_proj``), else None: per-expert tensors, the published form and what exports write."""
    return fused if f"{fused.format(i=0)}.experts.gate_up_proj" in present else None


# --- a Llama whose MLPs are routed experts ------------------------------------------------------------------

@dataclass
class MoELlamaKeys(MoEKeys, LlamaKeys):
    """The ``[model]`` keys of the Llama family's mixture-of-experts relatives (mixtral, qwen3_moe, qwen2_moe): the Llama's
    (``ffn_hidden`` is each expert's width) and the experts'."""


def check_moe_llama(m: Any) -> None:
    llama.check(m)
    check(m)


def tp_names(qk_norm: bool) -> TPNames:
    """The attention's tensor-parallel plan of the Llama (:data:`meshtrain.models.llama.spec.TP`); the MoE MLP is left
    out, so tp replicates the router and the experts (Megatron-Core's expert tensor parallelism of 1: no expert GEMM
    is split, every tp rank routes and computes the same tokens; expert parallelism is what splits the experts)."""
    return TPNames(tuple(n for n in llama.TP.colwise if n.startswith("attn.")),
                   tuple(n for n in llama.TP.rowwise if n.startswith("attn.")),
                   ("attn.q_norm", "attn.k_norm") if qk_norm else (), llama.TP.extra_inputs)


def block_params(m: Any, qkv_bias: bool = False, qk_norm: bool = False) -> int:
    """Parameters of one block: the Llama's attention and norms, and a MoE MLP (:func:`mlp_params`)."""
    F = llama.ffn_hidden(m)
    return llama.block_params(m, qkv_bias, qk_norm) - 3 * m.n_embd * F + mlp_params(m, F)


def layer_costs(m: Any, vocab_size: int, tokens: int, qkv_bias: bool = False,
                qk_norm: bool = False) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step as :func:`meshtrain.models.llama.spec.layer_costs`, the MLP's matrices
    counted for the router and the k experts a token runs through; AdamW updates every expert."""
    embedding, dense_block, head = llama.layer_costs(m, vocab_size, tokens, qkv_bias=qkv_bias, qk_norm=qk_norm)
    F = llama.ffn_hidden(m)
    dense_mlp = 3 * m.n_embd * F
    active = 3 * 2 * (mlp_active_matrix_params(m, F) - dense_mlp) * tokens
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * (mlp_params(m, F) - dense_mlp)
    return embedding, dense_block + active + optimizer, head


def planner(m: Any, vocab_size: int, qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Any]:
    """The Llama's planner numbers (:func:`meshtrain.models.llama.spec.planner`) with the experts: E MLPs of width
    ``ffn_hidden`` and a router per layer, k run per token."""
    return {**llama.planner(m, vocab_size, qkv_bias=qkv_bias, qk_norm=qk_norm), "experts": m.num_experts,
            "experts_per_token": m.num_experts_per_tok, "shared_ffn": m.shared_expert_ffn}


SHARED = (("mlp.shared.gate", "shared_expert.gate_proj"), ("mlp.shared.up", "shared_expert.up_proj"),
          ("mlp.shared.down", "shared_expert.down_proj"), ("mlp.shared_gate", "shared_expert_gate"))
"""(meshtrain's module in ``blocks.{i}``, ``transformers``' in ``model.layers.{i}.mlp``) of Qwen2-MoE's shared expert."""


def moe_sources(m: Any, present: Collection[str], published: str, names: tuple[str, str, str],
                qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Source]:
    """The Llama's sources but its MLPs, and each block's router and experts (:func:`expert_sources`): the
    per-expert tensors under ``model.layers.{i}.<published>``, or the fused ones under ``model.layers.{i}.mlp``; and
    a shared expert's (:data:`SHARED`)."""
    out = {k: v for k, v in llama.sources(m, present, qkv_bias=qkv_bias, qk_norm=qk_norm).items() if ".mlp." not in k}
    fused = fused_prefix(present, "model.layers.{i}.mlp")
    for i in range(m.n_layer):
        experts = expert_sources(f"model.layers.{i}.{published}", names, fused and fused.format(i=i),
                                 llama.ffn_hidden(m), m.num_experts)
        out.update({f"blocks.{i}.{k}": v for k, v in experts.items()})
        if m.shared_expert_ffn:
            out.update({f"blocks.{i}.{ours}.weight": Source(f"model.layers.{i}.mlp.{theirs}.weight")
                        for ours, theirs in SHARED})
    return out


def moe_shapes(m: Any, vocab_size: int, present: Collection[str], published: str, names: tuple[str, str, str],
               qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`moe_sources`' tensors."""
    out = {k: v for k, v in llama.shapes(m, vocab_size, present, qkv_bias=qkv_bias, qk_norm=qk_norm).items()
           if ".mlp." not in k}
    fused = fused_prefix(present, "model.layers.{i}.mlp")
    C, S = m.n_embd, m.shared_expert_ffn
    for i in range(m.n_layer):
        out.update(expert_shapes(f"model.layers.{i}.{published}", names, fused and fused.format(i=i), m,
                                 llama.ffn_hidden(m)))
        if S:
            shapes = ((S, C), (S, C), (C, S), (1, C))
            out.update({f"model.layers.{i}.mlp.{theirs}.weight": shape for (_, theirs), shape in zip(SHARED, shapes)})
    return out


def moe_family(name: str, summary: str, model: str, hf: HFFormat, qkv_bias: bool = False, qk_norm: bool = False,
               check_family: Any = None) -> Family:
    """A Llama relative with routed experts in every block: the Llama's keys, rules and names (:func:`meshtrain.models
    .llama.spec.family`), the experts' keys and checks, the planner's numbers with experts (:func:`planner`), tensor
    parallelism of the attention alone (:func:`tp_names`), and an auxiliary loss (the routers' load balancing)."""
    base = llama.family(name, summary, model, hf, qkv_bias=qkv_bias, qk_norm=qk_norm)

    def check_all(m: Any) -> None:
        check_moe_llama(m)
        if check_family is not None:
            check_family(m)

    return replace(base, keys=MoELlamaKeys, check=check_all,
                   layer_costs=partial(layer_costs, qkv_bias=qkv_bias, qk_norm=qk_norm),
                   planner=partial(planner, qkv_bias=qkv_bias, qk_norm=qk_norm),
                   tp=tp_names(qk_norm), experts=True, aux_loss=True,
                   resume_keys=base.resume_keys + ("num_experts",))
