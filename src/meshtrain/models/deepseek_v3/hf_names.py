"""DeepSeek-V3's Hugging Face format without torch: ``transformers``' ``DeepseekV3ForCausalLM`` ``config.json`` and
tensor names (``transformers`` 5.24, ``models/deepseek_v3/modeling_deepseek_v3.py``).

Block ``i`` is ``model.layers.{i}``: ``input_layernorm`` / ``post_attention_layernorm``; MLA's ``self_attn.q_proj``
(nh*(dn+dr), C) or, with ``q_lora_rank``, ``q_a_proj`` (rq, C), ``q_a_layernorm`` (rq,) and ``q_b_proj``
(nh*(dn+dr), rq); ``kv_a_proj_with_mqa`` (rkv+dr, C: the latent's rows, then the shared RoPE key's), ``kv_a_layernorm``
(rkv,), ``kv_b_proj`` (nh*(dn+dv), rkv: each head's k_nope rows, then its v rows) and ``o_proj`` (C, nh*dv). A dense
layer's MLP is ``mlp.gate_proj``/``up_proj``/``down_proj``; a MoE layer's router ``mlp.gate.weight`` (E, C) and its
selection bias ``mlp.gate.e_score_correction_bias`` (E,), the experts per expert ``mlp.experts.{e}.gate_proj`` ...
(what ``save_pretrained`` writes) or fused ``mlp.experts.gate_up_proj`` (E, 2F, C) / ``down_proj`` (E, C, F) (what
``transformers`` keeps in memory; both are read, exports write the per-expert form), and the shared experts
``mlp.shared_experts.gate_proj``/``up_proj`` (S, C), ``down_proj`` (C, S). Shape legend: :mod:`.spec`.

Multi-token prediction depth k (1-based) is ``model.layers.{n_layer + k - 1}`` (DeepSeek-V3's layer 61, as its
reference checkpoint writes it; ``transformers`` has no such module and drops it): ``enorm``, ``hnorm`` (C,),
``eh_proj`` (C, 2C), a block's tensors as any layer of that index, ``shared_head.norm`` (C,), and copies of the shared
``embed_tokens`` and ``shared_head.head`` (V, C), which an import checks are there and an export writes again.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from meshtrain.models.deepseek_v3.keys import dense_ffn_hidden, qk_head_dim
from meshtrain.models.family import HFFormat, Source
from meshtrain.models.hf_io import HFFormatError, fraction, number, refuse, weight_map, with_defaults
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe

ARCHITECTURE = "DeepseekV3ForCausalLM"
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None,
    "rope_theta": 10000.0, "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
    "num_nextn_predict_layers": 1}
"""``DeepseekV3Config``'s defaults (``transformers`` 5.24, ``models/deepseek_v3/configuration_deepseek_v3.py``) of every
key :func:`read` reads; ``rope_theta`` is the class's ``default_theta``. ``num_key_value_heads`` is not read: MLA
expands one k and one v per query head from the latent whatever it says (``transformers``' SDPA attention ignores it
where it runs; an export writes ``num_attention_heads``). ``num_nextn_predict_layers`` is 1 by default, as V3's,
but counts only where the folder holds those layers (:func:`mtp_layers`)."""
ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
"""``DeepseekV3Config.attribute_map`` (of the keys read)."""
LAYER = re.compile(r"model\.layers\.(\d+)\.")
MTP = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm"))
"""(meshtrain's module in ``mtp.{k-1}``, the checkpoint's in ``model.layers.{n_layer + k - 1}``) beside the block."""


def _count(hf: dict[str, Any], key: str, where: Path) -> int:
    """``hf[key]``, an integer >= 0. Raises HFFormatError."""
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HFFormatError(f"'{where}': {key} = {value!r} must be an integer >= 0")
    return value


def _flag(hf: dict[str, Any], key: str, where: Path) -> bool:
    value = hf.get(key)
    if not isinstance(value, bool):
        raise HFFormatError(f"'{where}': {key} = {value!r} must be true or false")
    return value


def read_rope(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """RoPE's ``[model]`` keys as ``transformers`` 5 reads them (``rope_scaling`` over ``rope_parameters``, its
    ``rope_theta`` over the top-level one): "default", or "yarn" with ``factor`` (required),
    ``original_max_position_embeddings`` (default ``max_position_embeddings``), ``beta_fast``/``beta_slow`` (32/1 where
    absent or 0, ``_compute_yarn_parameters``) and DeepSeek's ``mscale``/``mscale_all_dim`` (absent: 0).

    Raises:
        HFFormatError: another rope type, a YaRN without its factor, or YaRN options not built (``attention_factor``,
            ``truncate = false``).
    """
    spelled = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(spelled) or {}
    if not isinstance(rope, dict):
        raise HFFormatError(f"'{where}': {spelled} = {rope!r:.60} must be an object (rope_type, factor, ...) or null")
    theta = rope.get("rope_theta", hf["rope_theta"])
    keys: dict[str, Any] = {"rope_theta": float(number({"rope_theta": theta}, "rope_theta", where, (int, float))),
                            "yarn_factor": 0.0}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return keys
    if kind != "yarn":
        raise HFFormatError(f"'{where}': rope type {kind!r} is not supported: meshtrain builds 'default' and 'yarn' "
                            f"(DeepSeek-V3's context extension)")
    if rope.get("factor") is None:
        raise HFFormatError(f"'{where}': {spelled} of rope_type 'yarn' has no factor: give it (DeepSeek-V3: 40)")
    refuse(rope, "attention_factor", (None,), where, "YaRN's temperature from factor, mscale and mscale_all_dim")
    refuse(rope, "truncate", (True,), where, "YaRN's correction range rounded to whole dimensions")
    original = rope.get("original_max_position_embeddings", hf["max_position_embeddings"])
    extra = {name: rope.get(name) or default for name, default in
             (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 0.0), ("mscale_all_dim", 0.0))}
    for name, value in extra.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise HFFormatError(f"'{where}': {spelled}'s {name} = {value!r} must be a number")
    keys.update(yarn_factor=float(number(rope, "factor", where, (int, float))),
                rope_original_max_positions=number({"original_max_position_embeddings": original},
                                                   "original_max_position_embeddings", where, int),
                **{f"yarn_{name}": float(value) for name, value in extra.items()})
    return keys


def mtp_layers(hf: dict[str, Any], where: Path, n_layer: int) -> int:
    """D, the multi-token prediction depths of the checkpoint whose ``config.json`` is ``where``: 0 where its weights
    hold no layer from ``n_layer`` on (what ``save_pretrained`` of ``transformers``, which drops them, leaves, whatever
    ``num_nextn_predict_layers`` says), else ``num_nextn_predict_layers``, which must name exactly the layers held.
    A folder without readable weights counts 0 (the weight check says why before launch).

    Raises:
        HFFormatError: layers past the main model that are not ``n_layer .. n_layer + num_nextn_predict_layers - 1``.
    """
    claimed = _count(hf, "num_nextn_predict_layers", where)
    try:
        names = weight_map(where.parent)
    except HFFormatError:
        return 0
    held = sorted({int(g[1]) for name in names if (g := LAYER.match(name)) and int(g[1]) >= n_layer})
    if held and held != list(range(n_layer, n_layer + claimed)):
        shown = f"{held[0]}..{held[-1]}" if len(held) > 1 else str(held[0])
        raise HFFormatError(f"'{where.parent}' holds layers {shown} past its {n_layer} main ones but config.json's "
                            f"num_nextn_predict_layers = {claimed} gives multi-token prediction layers "
                            f"{n_layer}..{n_layer + claimed - 1}: fix num_nextn_predict_layers or the layers")
    return claimed if held else 0


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """``[model]`` keys of a ``DeepseekV3ForCausalLM`` ``config.json`` (a key it lacks at ``DeepseekV3Config``'s
    default); ``num_nextn_predict_layers`` as the folder holds them (:func:`mtp_layers`).

    Raises:
        HFFormatError: an option meshtrain does not build (not SwiGLU, attention biases, a rope type but default
            and YaRN), a missing or ill-typed key, or multi-token prediction layers that do not match
            ``num_nextn_predict_layers``.
    """
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    refuse(hf, "hidden_act", ("silu",), where, "SwiGLU experts")
    refuse(hf, "attention_bias", (False,), where, "MLA's projections have no biases")
    heads = number(hf, "num_attention_heads", where, int)
    q_rank = hf.get("q_lora_rank")
    keys = {"type": "deepseek_v3", "n_layer": number(hf, "num_hidden_layers", where, int), "n_head": heads,
            "n_embd": number(hf, "hidden_size", where, int), "vocab_size": number(hf, "vocab_size", where, int),
            "norm_eps": float(number(hf, "rms_norm_eps", where, (int, float))),
            "tie_embeddings": bool(hf.get("tie_word_embeddings")), "dropout": fraction(hf, "attention_dropout", where),
            "ffn_hidden": number(hf, "moe_intermediate_size", where, int),
            "dense_ffn_hidden": number(hf, "intermediate_size", where, int),
            "num_experts": number(hf, "n_routed_experts", where, int),
            "num_experts_per_tok": number(hf, "num_experts_per_tok", where, int),
            "norm_topk_prob": _flag(hf, "norm_topk_prob", where), "rope_interleave": _flag(hf, "rope_interleave", where),
            "n_shared_experts": _count(hf, "n_shared_experts", where),
            "routed_scaling_factor": float(number(hf, "routed_scaling_factor", where, (int, float))),
            "q_lora_rank": 0 if q_rank is None else number(hf, "q_lora_rank", where, int),
            "first_k_dense_replace": _count(hf, "first_k_dense_replace", where)}
    keys.update({key: number(hf, key, where, int) for key in
                 ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group")})
    keys.update(read_rope(hf, where))
    keys["num_nextn_predict_layers"] = mtp_layers(hf, where, keys["n_layer"])
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    """``config.json`` of ``DeepseekV3ForCausalLM`` for the model ``m`` (its multi-token prediction depths included,
    which ``transformers`` reads and does not build)."""
    rope = None
    if m.yarn_factor:
        rope = {"rope_type": "yarn", "factor": m.yarn_factor, "beta_fast": m.yarn_beta_fast,
                "beta_slow": m.yarn_beta_slow, "original_max_position_embeddings": m.rope_original_max_positions}
        rope.update({name: value for name, value in (("mscale", m.yarn_mscale),
                                                     ("mscale_all_dim", m.yarn_mscale_all_dim)) if value})
    return {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": vocab_size,
            "hidden_size": m.n_embd, "intermediate_size": dense_ffn_hidden(m),
            "moe_intermediate_size": llama.ffn_hidden(m), "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": m.n_head, "n_shared_experts": m.n_shared_experts,
            "n_routed_experts": m.num_experts, "routed_scaling_factor": m.routed_scaling_factor,
            "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
            "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "qk_nope_head_dim": m.qk_nope_head_dim,
            "n_group": m.n_group, "topk_group": m.topk_group, "num_experts_per_tok": m.num_experts_per_tok,
            "first_k_dense_replace": m.first_k_dense_replace, "norm_topk_prob": m.norm_topk_prob,
            "hidden_act": "silu", "max_position_embeddings": m.block_size, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_scaling": rope, "rope_interleave": m.rope_interleave,
            "attention_bias": False, "attention_dropout": m.dropout, "tie_word_embeddings": m.tie_embeddings,
            "num_nextn_predict_layers": m.num_nextn_predict_layers, "output_router_logits": False, "bos_token_id": None,
            "eos_token_id": None, "torch_dtype": "float32"}


# --- tensor names and shapes ------------------------------------------------------------------------------------

ATTENTION = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
             ("attn.kv_a", "self_attn.kv_a_proj_with_mqa"), ("attn.kv_norm", "self_attn.kv_a_layernorm"),
             ("attn.kv_b", "self_attn.kv_b_proj"), ("attn.proj", "self_attn.o_proj"))
"""(meshtrain's module in ``blocks.{i}``, ``transformers``' in ``model.layers.{i}``) of every block."""
Q_LORA = (("attn.q_a", "self_attn.q_a_proj"), ("attn.q_norm", "self_attn.q_a_layernorm"),
          ("attn.q_b", "self_attn.q_b_proj"))
Q_DIRECT = (("attn.q", "self_attn.q_proj"),)
DENSE = (("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))
SHARED = (("mlp.shared_experts.gate", "mlp.shared_experts.gate_proj"),
          ("mlp.shared_experts.up", "mlp.shared_experts.up_proj"),
          ("mlp.shared_experts.down", "mlp.shared_experts.down_proj"))
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _pairs(m: Any, i: int) -> tuple[tuple[str, str], ...]:
    """The one-to-one modules of block ``i`` (all but the routed experts)."""
    pairs = ATTENTION + (Q_LORA if m.q_lora_rank else Q_DIRECT)
    if i < m.first_k_dense_replace:
        return pairs + DENSE
    return pairs + (SHARED if m.n_shared_experts else ())


def _fused(m: Any, present: Collection[str]) -> bool:
    """Whether the folder holds ``transformers``' fused expert tensors (checked at the first MoE layer)."""
    return f"model.layers.{m.first_k_dense_replace}.mlp.experts.gate_up_proj" in present


def sources(m: Any, present: Collection[str]) -> dict[str, Source]:
    """Every parameter and the routing biases (:class:`meshtrain.models.family.Source`); a tied head reads the
    embedding."""
    out = {"tok_emb.weight": Source("model.embed_tokens.weight"), "norm.weight": Source("model.norm.weight"),
           "lm_head.weight": Source("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")}
    fused = _fused(m, present)
    for i in range(m.n_layer):
        out.update(_block_sources(m, i, f"blocks.{i}", fused))
    for k in range(m.num_nextn_predict_layers):
        out.update(_block_sources(m, m.n_layer + k, f"mtp.{k}.block", fused))
    return {**out, **mtp_sources(m)}


def mtp_sources(m: Any) -> dict[str, Source]:
    """The sources of each multi-token prediction depth's own tensors (:data:`MTP`: ``mtp.{k-1}.eh_proj.weight`` from
    ``model.layers.{n_layer + k - 1}.eh_proj.weight``, ...), without its block's."""
    out = {}
    for k in range(m.num_nextn_predict_layers):
        layer = f"model.layers.{m.n_layer + k}"
        out.update({f"mtp.{k}.{ours}.weight": Source(f"{layer}.{theirs}.weight") for ours, theirs in MTP})
    return out


def _block_sources(m: Any, i: int, ours: str, fused: bool) -> dict[str, Source]:
    """The sources of block ``i`` (``model.layers.{i}``) held by meshtrain's module ``ours``."""
    layer = f"model.layers.{i}"
    out = {f"{ours}.{mine}.weight": Source(f"{layer}.{theirs}.weight") for mine, theirs in _pairs(m, i)}
    if i >= m.first_k_dense_replace:
        experts = moe.expert_sources(f"{layer}.mlp", EXPERT_NAMES, f"{layer}.mlp" if fused else None,
                                     llama.ffn_hidden(m), m.num_experts)
        experts["mlp.expert_bias"] = Source(f"{layer}.mlp.gate.e_score_correction_bias")
        out.update({f"{ours}.{k}": v for k, v in experts.items()})
    return out


def copies(m: Any) -> dict[str, str]:
    """{tensor: the tensor it repeats}: each multi-token prediction layer's ``embed_tokens`` and ``shared_head.head``
    (DeepSeek-V3's checkpoint layout; the modules share the main model's)."""
    head = "model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight"
    out = {}
    for k in range(m.num_nextn_predict_layers):
        layer = f"model.layers.{m.n_layer + k}"
        out.update({f"{layer}.embed_tokens.weight": "model.embed_tokens.weight", f"{layer}.shared_head.head.weight": head})
    return out


def block_shapes(m: Any, i: int) -> dict[str, tuple[int, ...]]:
    """{name in ``model.layers.{i}``: shape} of the one-to-one tensors of block ``i``."""
    C, nh, rq, rkv, dr = m.n_embd, m.n_head, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    D, S = dense_ffn_hidden(m), m.n_shared_experts * llama.ffn_hidden(m)
    shapes = {"input_layernorm": (C,), "post_attention_layernorm": (C,), "self_attn.kv_a_proj_with_mqa": (rkv + dr, C),
              "self_attn.kv_a_layernorm": (rkv,), "self_attn.kv_b_proj": (nh * (m.qk_nope_head_dim + m.v_head_dim), rkv),
              "self_attn.o_proj": (C, nh * m.v_head_dim), "self_attn.q_proj": (nh * qk_head_dim(m), C),
              "self_attn.q_a_proj": (rq, C), "self_attn.q_a_layernorm": (rq,),
              "self_attn.q_b_proj": (nh * qk_head_dim(m), rq), "mlp.gate_proj": (D, C), "mlp.up_proj": (D, C),
              "mlp.down_proj": (C, D), "mlp.shared_experts.gate_proj": (S, C), "mlp.shared_experts.up_proj": (S, C),
              "mlp.shared_experts.down_proj": (C, S)}
    return {f"{theirs}.weight": shapes[theirs] for _, theirs in _pairs(m, i)}


def shapes(m: Any, vocab_size: int, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`sources`' tensors (a tied head not listed: ``transformers`` saves it once)."""
    out = {"model.embed_tokens.weight": (vocab_size, m.n_embd), "model.norm.weight": (m.n_embd,)}
    if not m.tie_embeddings:
        out["lm_head.weight"] = (vocab_size, m.n_embd)
    fused = _fused(m, present)
    for i in range(m.n_layer + m.num_nextn_predict_layers):
        layer = f"model.layers.{i}"
        out.update({f"{layer}.{name}": shape for name, shape in block_shapes(m, i).items()})
        if i >= m.first_k_dense_replace:
            out.update(moe.expert_shapes(f"{layer}.mlp", EXPERT_NAMES, f"{layer}.mlp" if fused else None, m,
                                         llama.ffn_hidden(m)))
            out[f"{layer}.mlp.gate.e_score_correction_bias"] = (m.num_experts,)
    return {**out, **mtp_shapes(m, vocab_size, m.num_nextn_predict_layers)}


def mtp_shapes(m: Any, vocab_size: int, depths: int) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the own tensors of multi-token prediction layers ``model.layers.{n_layer} ..
    {n_layer + depths - 1}`` and of their copies of the embedding and head (:func:`copies`); their blocks' tensors
    are any layer's of that index."""
    C, out = m.n_embd, {}
    for layer in (f"model.layers.{i}" for i in range(m.n_layer, m.n_layer + depths)):
        out.update({f"{layer}.enorm.weight": (C,), f"{layer}.hnorm.weight": (C,), f"{layer}.eh_proj.weight": (C, 2 * C),
                    f"{layer}.shared_head.norm.weight": (C,), f"{layer}.embed_tokens.weight": (vocab_size, C),
                    f"{layer}.shared_head.head.weight": (vocab_size, C)})
    return out


FORMAT = HFFormat(architectures=(ARCHITECTURE,), model_type="deepseek_v3", read=read, write=write, sources=sources,
                  shapes=shapes, defaults=HF_DEFAULTS, aliases=ALIASES, training=llama.TRAINING, copies=copies)
