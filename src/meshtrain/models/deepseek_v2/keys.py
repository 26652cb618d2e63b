"""DeepSeek-V2's ``[model]`` keys without torch: DeepSeek-V3's (:class:`meshtrain.models.deepseek_v3.keys.
DeepseekV3Keys`, the same names, defaults and meanings) and the choice of its softmax router."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.models.deepseek_v3.keys import DeepseekV3Keys

TOPK_METHODS = ("greedy", "group_limited_greedy")
"""``model.topk_method`` of DeepSeek-V2's router (``transformers``' ``DeepseekV2TopkRouter``)."""


@dataclass
class DeepseekV2Keys(DeepseekV3Keys):
    """The ``[model]`` keys of deepseek_v2: DeepSeek-V3's and ``topk_method``."""

    topk_method: str = "greedy"
    """deepseek_v2: "greedy" (the k experts of largest softmax score; V2-Lite) or "group_limited_greedy" (first the
    ``topk_group`` of ``n_group`` groups of largest best score, then the k best experts in them; V2, Sec. 2.1.2 of
    the V2 report, arXiv:2405.04434, "device-limited routing")."""
