"""GLM-4.5's ``[model]`` keys without torch (read by ``spec.py``, ``hf_names.py`` and ``model.py``).

GLM-4.5 (``Glm4MoeForCausalLM``; GLM-4.5 Team 2025, arXiv:2508.06471, Sec. 2.1) is a Llama-style decoder with
grouped-query attention, partial RoPE and optional q/k norms, whose MLPs are DeepSeek-V3's: dense first layers, then
DeepSeekMoE (shared experts beside sigmoid-routed, group-limited ones with the selection bias). The DeepSeekMoE keys are
DeepSeek-V3's own fields (:class:`meshtrain.models.deepseek_v3.keys.DeepseekV3Keys`: the same names, defaults and
docstrings), so one ``[model]`` key means one thing in both families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshtrain.models.deepseek_v3.keys import DeepseekV3Keys
from meshtrain.models.llama.spec import head_dim
from meshtrain.models.moe import spec as moe

SHARED_KEYS = ("dense_ffn_hidden", "first_k_dense_replace", "n_shared_experts", "n_group", "topk_group",
               "routed_scaling_factor", "num_nextn_predict_layers", "mtp_loss_weight")
"""DeepSeek-V3's keys that GLM-4.5 reads: its MoE part (dense first layers, shared experts, group-limited routing) and
multi-token prediction (GLM-4.5's and GLM-4.5-Air's one MTP layer, V3's module with GLM's block)."""


@dataclass
class Glm4MoeOwnKeys:
    """The keys of GLM-4.5's attention."""

    partial_rotary_factor: float = 0.5
    """glm4_moe: fraction of each head's features RoPE rotates, the first ``int(head size * factor)`` (even; the rest
    pass unrotated; GLM-4.5: 0.5, ``transformers``' default for ``Glm4MoeConfig``)."""
    attention_bias: bool = False
    """glm4_moe: biases on the q, k and v projections (GLM-4.5: true; its output projection has none)."""
    qk_norm: bool = False
    """glm4_moe: RMSNorm over each head's features of q and k before RoPE (``use_qk_norm``; GLM-4.5: false)."""


Glm4MoeKeys = dataclasses.make_dataclass(
    "Glm4MoeKeys",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(DeepseekV3Keys)
     if f.name in SHARED_KEYS],
    bases=(Glm4MoeOwnKeys, moe.MoELlamaKeys))
Glm4MoeKeys.__module__ = __name__
Glm4MoeKeys.__doc__ = """The ``[model]`` keys of glm4_moe: the MoE Llamas' (``ffn_hidden`` is each routed expert's
width), :class:`Glm4MoeOwnKeys` and DeepSeek-V3's :data:`SHARED_KEYS`."""


def rotary_dim(m: Any) -> int:
    """Features per head RoPE rotates: ``int(head size * partial_rotary_factor)`` (``transformers``'
    ``Glm4MoeRotaryEmbedding.compute_default_rope_parameters``)."""
    return int(head_dim(m) * m.partial_rotary_factor)
