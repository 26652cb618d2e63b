"""DeepSeek-V2 without torch: DeepSeek-V3's family (:mod:`meshtrain.models.deepseek_v3.spec`: MLA, shared experts,
dense first layers, their costs and tensor-parallel plan) with V2's softmax router (``model.py``) and
``transformers``' ``DeepseekV2ForCausalLM`` format (:mod:`meshtrain.models.deepseek_v2.hf_names`).

DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434, Sec. 2.1.2): each token's experts are the k of largest softmax score
(V2-Lite) or, "device-limited", the k best in the ``topk_group`` of ``n_group`` groups of largest best score (V2);
no selection bias, no multi-token prediction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshtrain.errors import require
from meshtrain.models.deepseek_v2 import hf_names
from meshtrain.models.deepseek_v2.keys import TOPK_METHODS, DeepseekV2Keys
from meshtrain.models.deepseek_v3 import spec as v3


def check(m: Any) -> None:
    """DeepSeek-V3's rules, then V2's: a known ``topk_method``, groups only with "group_limited_greedy", and none of
    V3's selection bias, multi-token prediction or sequence-wise balance loss.

    Raises:
        ConfigError: the first broken rule, in one line naming the key.
    """
    v3.check(m)
    require(m.topk_method in TOPK_METHODS, f"model.topk_method = {m.topk_method!r} is not valid: use one of "
                                           f"{', '.join(TOPK_METHODS)}")
    require(m.topk_method == "group_limited_greedy" or m.n_group == 1,
            f"model.n_group = {m.n_group} needs model.topk_method = 'group_limited_greedy' (greedy routing has no "
            f"groups): use 1")
    for key, why in (("router_bias_update_rate", "V2 routes by softmax scores without a selection bias"),
                     ("num_nextn_predict_layers", "V2 has no multi-token prediction"),
                     ("seq_aux_loss_alpha", "V3's sequence-wise balance loss of sigmoid affinities")):
        require(not getattr(m, key), f"model.{key} = {getattr(m, key)} is not supported by model.type = "
                                     f"'deepseek_v2' ({why}): use 0")


FAMILY = replace(v3.FAMILY, name="deepseek_v2", keys=DeepseekV2Keys, check=check,
                 summary="DeepSeek-V2 (multi-head latent attention, shared and softmax-routed experts, greedy or "
                         "group-limited)",
                 model="meshtrain.models.deepseek_v2.model:DeepseekV2", hf=hf_names.FORMAT)
"""DeepSeek-V3's family with V2's router and format; DeepSeek-V3's planner numbers (:func:`meshtrain.models.deepseek_v3.
spec.planner`: the router's kind changes no parameter, FLOP or activation the planner counts; V2 has no MTP block)."""
