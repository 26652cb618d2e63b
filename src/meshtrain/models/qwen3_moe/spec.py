"""Qwen3-MoE without torch: Qwen3's keys, rules and tensor names (:mod:`meshtrain.models.qwen3.spec`) with routed
experts (:mod:`meshtrain.models.moe.spec`) in every block and ``transformers``' ``Qwen3MoeForCausalLM`` format.

Each block's router is ``model.layers.{i}.mlp.gate.weight`` (E, C), each expert's SwiGLU
``...mlp.experts.{e}.gate_proj``/``up_proj`` (F, C) and ``down_proj`` (C, F), F = ``moe_intermediate_size``
(meshtrain's ``ffn_hidden``), E = ``num_experts`` (``num_local_experts`` in the configs ``transformers`` 5 writes);
``transformers`` 5's fused ``...mlp.experts.gate_up_proj`` / ``down_proj`` are read
too. Dense layers among the sparse ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``; none in the released
models) are not built.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.models.family import HFFormat
from meshtrain.models.hf_io import with_defaults
from meshtrain.models.llama import spec as llama
from meshtrain.models.moe import spec as moe
from meshtrain.models.qwen3 import spec as qwen3

PUBLISHED = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


HF_DEFAULTS: dict[str, Any] = {
    **qwen3.HF_DEFAULTS, **moe.QWEN_MOE_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": llama.HEAD_DIM,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128}
"""``Qwen3MoeConfig``'s defaults (``transformers`` 5.24, ``models/qwen3_moe/configuration_qwen3_moe.py``) of every key
:func:`read` reads: Qwen3's with these sizes and the experts' keys; unlike Qwen3's, its config class has no
``head_dim``, which its attention derives from the width (:data:`meshtrain.models.llama.spec.HEAD_DIM`)."""
ALIASES = {"num_local_experts": "num_experts"}
"""``Qwen3MoeConfig.attribute_map`` (``transformers`` 5 writes ``num_local_experts``)."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    experts = moe.qwen_moe_keys(hf, where)
    keys = qwen3.read(hf, where, HF_DEFAULTS)
    keys.update(type="qwen3_moe", **experts)
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    moe.check_exportable(m)
    config = qwen3.write(m, vocab_size)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  **moe.qwen_moe_config(m, config["intermediate_size"]))
    return moe.without_dense_width(config)


FAMILY = moe.moe_family(
    "qwen3_moe", "Qwen3-MoE (Qwen3 attention, top-k routed SwiGLU experts in every block)",
    "meshtrain.models.qwen3_moe.model:Qwen3MoE",
    HFFormat(architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe", read=read, write=write,
             sources=partial(moe.moe_sources, published=PUBLISHED, names=EXPERT_NAMES, qk_norm=True),
             shapes=partial(moe.moe_shapes, published=PUBLISHED, names=EXPERT_NAMES, qk_norm=True),
             defaults=HF_DEFAULTS, aliases=ALIASES, training=moe.TRAINING),
    qk_norm=True)
