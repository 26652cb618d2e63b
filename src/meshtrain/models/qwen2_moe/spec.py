"""Qwen2-MoE without torch: Qwen2's keys, rules and tensor names (:mod:`meshtrain.models.qwen2.spec`: a Llama with
q, k, v biases) with routed experts and a shared expert (:mod:`meshtrain.models.moe.spec`) in every block and
``transformers``' ``Qwen2MoeForCausalLM`` format.

Each block's router is ``model.layers.{i}.mlp.gate.weight`` (E, C), each expert's SwiGLU
``...mlp.experts.{e}.gate_proj``/``up_proj`` (F, C) and ``down_proj`` (C, F), F = ``moe_intermediate_size``
(meshtrain's ``ffn_hidden``); the shared expert ``...mlp.shared_expert.gate_proj``/``up_proj``/``down_proj`` of width
``shared_expert_intermediate_size`` (``shared_expert_ffn``) and its gate ``...mlp.shared_expert_gate.weight`` (1, C).
``transformers`` 5's fused ``...mlp.experts.gate_up_proj`` / ``down_proj`` are read too. Dense layers among the
sparse ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``) and sliding-window attention are not built;
``norm_topk_prob`` is false in the released configs (the top-k weights are the softmax's, not renormalised).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.errors import require
from meshtrain.models.family import HFFormat
from meshtrain.models.hf_io import number, refuse, with_defaults
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe
from meshtrain.models.qwen2 import spec as qwen2

PUBLISHED = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


HF_DEFAULTS: dict[str, Any] = {
    **qwen2.HF_DEFAULTS, **moe.QWEN_MOE_DEFAULTS, "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True}
"""``Qwen2MoeConfig``'s defaults (``transformers`` 5.24, ``models/qwen2_moe/configuration_qwen2_moe.py``) of every key
:func:`read` reads: Qwen2's with these sizes and the experts' keys."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS)
    experts = moe.qwen_moe_keys(hf, where)
    refuse(hf, "use_sliding_window", (False,), where, "full causal attention in every layer")
    refuse(hf, "qkv_bias", (True,), where, "Qwen2's q, k and v biases")
    keys = llama.read(hf, where, kind="qwen2_moe")
    keys.update(**experts, shared_expert_ffn=number(hf, "shared_expert_intermediate_size", where, int))
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    moe.check_exportable(m, shared=True)
    config = llama.write(m, vocab_size, "Qwen2MoeForCausalLM", "qwen2_moe", use_sliding_window=False)
    for key in ("attention_bias", "mlp_bias"):  # fixed by the architecture
        config.pop(key)
    config.update(**moe.qwen_moe_config(m, config["intermediate_size"]),
                  shared_expert_intermediate_size=m.shared_expert_ffn, qkv_bias=True)
    return moe.without_dense_width(config)


def check(m: Any) -> None:
    require(m.shared_expert_ffn >= 1, f"model.shared_expert_ffn = {m.shared_expert_ffn}: Qwen2-MoE has a shared expert "
                                      f"in every block; give its width (>= 1), or use model.type = 'qwen3_moe'")


FAMILY = moe.moe_family(
    "qwen2_moe", "Qwen2-MoE (Qwen2 attention, top-k routed SwiGLU experts and a gated shared expert in every block)",
    "meshtrain.models.qwen2_moe.model:Qwen2MoE",
    HFFormat(architectures=("Qwen2MoeForCausalLM",), model_type="qwen2_moe", read=read, write=write,
             sources=partial(moe.moe_sources, published=PUBLISHED, names=EXPERT_NAMES, qkv_bias=True),
             shapes=partial(moe.moe_shapes, published=PUBLISHED, names=EXPERT_NAMES, qkv_bias=True),
             defaults=HF_DEFAULTS, training=moe.TRAINING),
    qkv_bias=True, check_family=check)
