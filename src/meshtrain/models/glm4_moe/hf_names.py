"""GLM-4.5's Hugging Face format without torch: ``transformers``' ``Glm4MoeForCausalLM`` ``config.json`` and tensor
names (``transformers`` 5.24, ``models/glm4_moe/modeling_glm4_moe.py``).

Block ``i`` is ``model.layers.{i}``: the Llama's attention tensors (``self_attn.q_proj``/``k_proj``/``v_proj``, their
biases with ``attention_bias``, ``q_norm``/``k_norm`` (hd,) with ``use_qk_norm``, ``o_proj``) and DeepSeek-V3's MLP
tensors (:mod:`meshtrain.models.deepseek_v3.hf_names`): a dense layer's ``mlp.gate_proj``/``up_proj``/``down_proj``, a
MoE layer's router ``mlp.gate.weight`` (E, C) and selection bias ``mlp.gate.e_score_correction_bias`` (E,), its
experts per expert (``save_pretrained``) or fused (``transformers``' memory), and ``mlp.shared_experts.*``.

Multi-token prediction depth k (``num_nextn_predict_layers``; GLM-4.5's layer 92, GLM-4.5-Air's 46) is
``model.layers.{n_layer + k - 1}`` in DeepSeek-V3's scheme (:mod:`meshtrain.models.deepseek_v3.hf_names`): ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, copies of ``embed_tokens`` and ``shared_head.head``, and a block's
tensors as any layer of that index (GLM's attention, a MoE layer's MLP); the names vLLM's GLM-4.5 MTP model reads
(``vllm/model_executor/models/glm4_moe_mtp.py``, ``Glm4MoeMultiTokenPredictorLayer`` and its
``_rewrite_spec_layer_name``). An import reads them into meshtrain's MTP modules and an export writes them back;
``transformers``, which has no MTP module, drops them (``_keys_to_ignore_on_load_unexpected``). A run that sets
``model.num_nextn_predict_layers = 0`` drops them too: the layers are checked, not read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

from meshtrain.models.deepseek_v3 import hf_names as deepseek
from meshtrain.models.deepseek_v3.keys import dense_ffn_hidden
from meshtrain.models.family import HFFormat, Source
from meshtrain.models.hf_io import Derived, HFFormatError, number, refuse, with_defaults
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe

ARCHITECTURE = "Glm4MoeForCausalLM"
PARTIAL = Derived(lambda c: (c.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5),
                  "rope_parameters' partial_rotary_factor, else 0.5")
"""``partial_rotary_factor``: ``transformers`` 5 keeps it in ``rope_parameters`` (``Glm4MoeConfig.__post_init__`` sets
0.5 where absent) and writes a top-level null; a GLM-4.5 ``config.json`` has it at the top level."""
ROPE = Derived(lambda c: {"rope_type": "default", "rope_theta": c.get("rope_theta") or 10000.0,
                          "partial_rotary_factor": c.get("partial_rotary_factor") or 0.5},
               "default RoPE of the top-level rope_theta and partial_rotary_factor")
"""``rope_parameters``, which ``transformers`` 5 builds from the top-level keys where a file lacks it."""
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": llama.HEAD_DIM, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_parameters": ROPE,
    "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL, "attention_bias": False, "attention_dropout": 0.0,
    "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "use_qk_norm": False, "num_nextn_predict_layers": 1}
"""``Glm4MoeConfig``'s defaults (``transformers`` 5.24, ``models/glm4_moe/configuration_glm4_moe.py``) of every key
:func:`read` reads: ``rope_theta`` is the class's ``default_theta``, ``partial_rotary_factor`` its
``__post_init__``'s (:data:`PARTIAL`); ``head_dim`` as the
attention derives it where absent."""
ALIASES = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}
"""``Glm4MoeConfig.attribute_map`` (of the keys read)."""
TRAINING = {**llama.TRAINING, "num_nextn_predict_layers": ("num_nextn_predict_layers",)}
"""The Llama's training keys and the multi-token prediction depths: the folder's unless the run sets them, to 0 (train
without the layers, as ``transformers`` builds the model) or to the folder's count (:func:`mtp_depths`)."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """``[model]`` keys of a ``Glm4MoeForCausalLM`` ``config.json`` (a key it lacks at ``Glm4MoeConfig``'s default);
    ``num_nextn_predict_layers`` as the folder holds them (:func:`meshtrain.models.deepseek_v3.hf_names.mtp_layers`).

    Raises:
        HFFormatError: an option meshtrain does not build (not SwiGLU, a rope type but "default"), a missing or
            ill-typed key, or multi-token prediction layers that do not match ``num_nextn_predict_layers``.
    """
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key) or {}
        if isinstance(rope, dict):
            refuse({"rope_type": rope.get("rope_type", rope.get("type", "default"))}, "rope_type", ("default",), where,
                   "GLM-4.5's plain partial RoPE")
    keys = llama.read(hf, where, kind="glm4_moe")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    partial = 0.5 if partial is None else partial
    flags = {}
    for theirs, ours in (("norm_topk_prob", "norm_topk_prob"), ("attention_bias", "attention_bias"),
                         ("use_qk_norm", "qk_norm")):
        if not isinstance(hf.get(theirs), bool):
            raise HFFormatError(f"'{where}': {theirs} = {hf.get(theirs)!r} must be true or false")
        flags[ours] = hf[theirs]
    keys.update(flags, ffn_hidden=number(hf, "moe_intermediate_size", where, int),
                dense_ffn_hidden=number(hf, "intermediate_size", where, int),
                num_experts=number(hf, "n_routed_experts", where, int),
                num_experts_per_tok=number(hf, "num_experts_per_tok", where, int),
                partial_rotary_factor=float(number({"partial_rotary_factor": partial}, "partial_rotary_factor", where,
                                                   (int, float))),
                routed_scaling_factor=float(number(hf, "routed_scaling_factor", where, (int, float))),
                n_shared_experts=deepseek._count(hf, "n_shared_experts", where),
                first_k_dense_replace=deepseek._count(hf, "first_k_dense_replace", where),
                n_group=number(hf, "n_group", where, int), topk_group=number(hf, "topk_group", where, int))
    keys["num_nextn_predict_layers"] = deepseek.mtp_layers(hf, where, keys["n_layer"])
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    """``config.json`` of ``Glm4MoeForCausalLM`` for the model ``m`` (its multi-token prediction depths included, which
    ``transformers`` reads and does not build)."""
    config = llama.write(m, vocab_size, ARCHITECTURE, "glm4_moe")
    del config["mlp_bias"], config["rope_scaling"], config["rope_theta"]
    config.update(rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta,
                                   "partial_rotary_factor": m.partial_rotary_factor},
                  intermediate_size=dense_ffn_hidden(m), moe_intermediate_size=llama.ffn_hidden(m),
                  attention_bias=m.attention_bias, use_qk_norm=m.qk_norm, n_shared_experts=m.n_shared_experts,
                  n_routed_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                  routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group, topk_group=m.topk_group,
                  first_k_dense_replace=m.first_k_dense_replace, norm_topk_prob=m.norm_topk_prob,
                  num_nextn_predict_layers=m.num_nextn_predict_layers, output_router_logits=False)
    return config


def _attention(m: Any, present: Collection[str]) -> dict[str, Source]:
    """The Llama's sources without its MLPs (the embedding, the head and each block's norms and attention)."""
    out = llama.sources(m, present, qkv_bias=m.attention_bias, qk_norm=m.qk_norm)
    return {k: v for k, v in out.items() if ".mlp." not in k}


def _with_mtp_blocks(m: Any, depths: int) -> Any:
    """``m`` with its ``depths`` multi-token prediction blocks counted as main layers ``n_layer ..``: their tensors are
    named as those layers' (GLM-4.5's layer 92 is a MoE layer as its layer 91)."""
    return dataclasses.replace(m, n_layer=m.n_layer + depths, num_nextn_predict_layers=0)


def sources(m: Any, present: Collection[str]) -> dict[str, Source]:
    """Every parameter and the routing biases (:class:`meshtrain.models.family.Source`); a tied head reads the
    embedding; multi-token prediction depth k's block ``mtp.{k-1}.block`` reads layer ``n_layer + k - 1``."""
    out = _sources(_with_mtp_blocks(m, m.num_nextn_predict_layers), present)
    for k in range(m.num_nextn_predict_layers):
        block = f"blocks.{m.n_layer + k}."
        for name in [n for n in out if n.startswith(block)]:
            out[f"mtp.{k}.block.{name[len(block):]}"] = out.pop(name)
    return {**out, **deepseek.mtp_sources(m)}


def _sources(m: Any, present: Collection[str]) -> dict[str, Source]:
    """:func:`sources` of the main blocks."""
    out = _attention(m, present)
    fused = deepseek._fused(m, present)
    for i in range(m.n_layer):
        layer = f"model.layers.{i}"
        if i < m.first_k_dense_replace:
            pairs = deepseek.DENSE
        else:
            pairs = deepseek.SHARED if m.n_shared_experts else ()
            experts = moe.expert_sources(f"{layer}.mlp", deepseek.EXPERT_NAMES, f"{layer}.mlp" if fused else None,
                                         llama.ffn_hidden(m), m.num_experts)
            experts["mlp.expert_bias"] = Source(f"{layer}.mlp.gate.e_score_correction_bias")
            out.update({f"blocks.{i}.{k}": v for k, v in experts.items()})
        out.update({f"blocks.{i}.{ours}.weight": Source(f"{layer}.{theirs}.weight") for ours, theirs in pairs})
    return out


def mtp_depths(m: Any, present: Collection[str]) -> int:
    """The multi-token prediction layers a checkpoint of tensors ``present`` must hold: ``num_nextn_predict_layers``,
    or, where the run sets it to 0, those it holds past the ``n_layer`` main ones (checked, not read).

    Raises:
        HFFormatError: a run's nonzero ``num_nextn_predict_layers`` that is not the count the folder holds."""
    depths = m.num_nextn_predict_layers
    held = len({int(g[1]) for name in present if (g := deepseek.LAYER.match(name)) and int(g[1]) >= m.n_layer})
    if present and depths and held != depths:
        raise HFFormatError(f"model.num_nextn_predict_layers = {depths} but the checkpoint's multi-token prediction "
                            f"layers past its {m.n_layer} main ones number {held}: use {held}, or 0 to train without "
                            f"them")
    return depths or held


def shapes(m: Any, vocab_size: int, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`sources`' tensors (a tied head not listed: ``transformers`` saves it once) and of the
    :func:`mtp_depths` multi-token prediction layers' (:func:`meshtrain.models.deepseek_v3.hf_names.mtp_shapes`)."""
    depths = mtp_depths(m, present)
    return {**_shapes(_with_mtp_blocks(m, depths), vocab_size, present), **deepseek.mtp_shapes(m, vocab_size, depths)}


def _shapes(m: Any, vocab_size: int, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """:func:`shapes` of the main blocks."""
    out = {k: v for k, v in llama.shapes(m, vocab_size, present, qkv_bias=m.attention_bias, qk_norm=m.qk_norm).items()
           if ".mlp." not in k}
    fused = deepseek._fused(m, present)
    C, D, S = m.n_embd, dense_ffn_hidden(m), m.n_shared_experts * llama.ffn_hidden(m)
    for i in range(m.n_layer):
        layer = f"model.layers.{i}.mlp"
        if i < m.first_k_dense_replace:
            out.update({f"{layer}.gate_proj.weight": (D, C), f"{layer}.up_proj.weight": (D, C),
                        f"{layer}.down_proj.weight": (C, D)})
            continue
        out.update(moe.expert_shapes(layer, deepseek.EXPERT_NAMES, layer if fused else None, m, llama.ffn_hidden(m)))
        out[f"{layer}.gate.e_score_correction_bias"] = (m.num_experts,)
        if S:
            out.update({f"{layer}.shared_experts.gate_proj.weight": (S, C), f"{layer}.shared_experts.up_proj.weight":
                        (S, C), f"{layer}.shared_experts.down_proj.weight": (C, S)})
    return out


FORMAT = HFFormat(architectures=(ARCHITECTURE,), model_type="glm4_moe", read=read, write=write, sources=sources,
                  shapes=shapes, defaults=HF_DEFAULTS, aliases=ALIASES, training=TRAINING, copies=deepseek.copies)
