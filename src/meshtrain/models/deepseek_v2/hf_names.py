"""DeepSeek-V2's Hugging Face format without torch: ``transformers``' ``DeepseekV2ForCausalLM`` ``config.json`` and
tensor names (``transformers`` 5.24, ``models/deepseek_v2/modeling_deepseek_v2.py``).

The tensors are DeepSeek-V3's (:mod:`meshtrain.models.deepseek_v3.hf_names`) without the routers' selection bias
``e_score_correction_bias`` (V2 has none: an import leaves meshtrain's at 0, an export writes none) and without
multi-token prediction layers. The ``config.json`` is V3's without ``rope_interleave`` (V2 always rotates adjacent
pairs, through complex numbers) and ``num_nextn_predict_layers``, with ``topk_method``, and ``n_group`` /
``topk_group`` null where the routing is not group-limited.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from meshtrain.models.deepseek_v2.keys import TOPK_METHODS
from meshtrain.models.deepseek_v3 import hf_names as v3
from meshtrain.models.family import HFFormat, Source
from meshtrain.models.hf_io import HFFormatError, refuse, with_defaults
from meshtrain.models.moe import spec as moe

ARCHITECTURE = "DeepseekV2ForCausalLM"
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "moe_intermediate_size": 1407,
    "num_hidden_layers": 32, "num_attention_heads": 32, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": None, "topk_group": None, "topk_method": "greedy",
    "num_experts_per_tok": None, "first_k_dense_replace": 0, "norm_topk_prob": False, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None,
    "rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0}
"""``DeepseekV2Config``'s defaults (``transformers`` 5.24, ``models/deepseek_v2/configuration_deepseek_v2.py``) of every
key :func:`read` reads; ``rope_theta`` is the class's ``default_theta``."""
ALIASES = {"num_experts": "n_routed_experts"}
"""``DeepseekV2Config.attribute_map`` (of the keys read)."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """``[model]`` keys of a ``DeepseekV2ForCausalLM`` ``config.json`` (a key it lacks at ``DeepseekV2Config``'s
    default), through DeepSeek-V3's reader.

    Raises:
        HFFormatError: an option meshtrain does not build (a ``topk_method`` but :data:`TOPK_METHODS`,
            ``norm_topk_prob``, which ``transformers``' V2 router ignores, attention biases, a rope type but default
            and YaRN), or a missing or ill-typed key.
    """
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    refuse(hf, "topk_method", TOPK_METHODS, where, "DeepSeek-V2's softmax routers")
    refuse(hf, "norm_topk_prob", (False,), where, "transformers' DeepSeek-V2 router weighs experts by their softmax "
                                                  "scores, not renormalised")
    if hf["num_experts_per_tok"] is None:
        raise HFFormatError(f"'{where}': num_experts_per_tok is missing (DeepseekV2Config has no default): give it "
                            f"(V2-Lite: 6)")
    limited = hf["topk_method"] == "group_limited_greedy"
    groups = {key: hf[key] if limited else 1 for key in ("n_group", "topk_group")}
    plain = {**{k: hf[k] for k in HF_DEFAULTS if k not in ("topk_method",)}, **groups, "rope_interleave": True,
             "num_nextn_predict_layers": 0}
    keys = v3.read(plain, where)
    keys.update(type="deepseek_v2", topk_method=hf["topk_method"])
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    """``config.json`` of ``DeepseekV2ForCausalLM`` for the model ``m``.

    Raises:
        HFFormatError: routing biases trained (``router_bias_update_rate`` > 0), which V2 has no tensor for.
    """
    moe.check_exportable(m)
    config = {k: v for k, v in v3.write(m, vocab_size).items() if k not in ("rope_interleave",
                                                                             "num_nextn_predict_layers")}
    limited = m.topk_method == "group_limited_greedy"
    config.update(architectures=[ARCHITECTURE], model_type="deepseek_v2", topk_method=m.topk_method,
                  n_group=m.n_group if limited else None, topk_group=m.topk_group if limited else None)
    return config


def sources(m: Any, present: Collection[str]) -> dict[str, Source]:
    """DeepSeek-V3's sources, the routing biases held by no tensor (:data:`meshtrain.models.moe.spec.NO_SOURCE`)."""
    return {k: moe.NO_SOURCE if k.endswith("mlp.expert_bias") else v for k, v in v3.sources(m, present).items()}


def shapes(m: Any, vocab_size: int, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The shapes of :func:`sources`' tensors."""
    return {k: v for k, v in v3.shapes(m, vocab_size, present).items() if not k.endswith("e_score_correction_bias")}


FORMAT = HFFormat(architectures=(ARCHITECTURE,), model_type="deepseek_v2", read=read, write=write, sources=sources,
                  shapes=shapes, defaults=HF_DEFAULTS, aliases=ALIASES, training=v3.FORMAT.training)
