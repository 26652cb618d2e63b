"""Qwen3 (dense) without torch: a Llama with an RMSNorm over each head's features of q and of k before RoPE
("QK-Norm", Yang et al. 2025, "Qwen3 Technical Report", arXiv:2505.09388, Sec. 2, replacing Qwen2's QKV bias) and a
head size decoupled from the width (``head_dim``: 128 in every released size, e.g. 16 heads at width 1024). Its keys,
checks and costs are the Llama family's (:mod:`meshtrain.models.llama.spec`) with ``qk_norm``;
``transformers``' ``Qwen3ForCausalLM`` names its tensors as the Llama does, plus ``self_attn.{q,k}_norm.weight``.
Attention biases (``attention_bias``) and sliding-window attention, both off in the released configs, are not built.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.models.family import HFFormat
from meshtrain.models.hf_io import refuse, with_defaults
from meshtrain.models.llama import spec as llama


HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in llama.HF_DEFAULTS.items() if k != "mlp_bias"}, "vocab_size": 151936, "intermediate_size": 22016,
    "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False}
"""``Qwen3Config``'s defaults (``transformers`` 5.24, ``models/qwen3/configuration_qwen3.py``) of every key
:func:`read` reads: the Llama's but these (``head_dim`` a constant 128, not derived from the width), and no
``mlp_bias`` key."""


def read(hf: dict[str, Any], where: Path, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """``[model]`` keys of a ``Qwen3ForCausalLM`` ``config.json``; ``defaults``: another class's (Qwen3-MoE's)."""
    hf = with_defaults(hf, HF_DEFAULTS if defaults is None else defaults)
    refuse(hf, "attention_bias", (False,), where, "Qwen3's projections have no biases")
    refuse(hf, "use_sliding_window", (False,), where, "full causal attention in every layer")
    return llama.read(hf, where, kind="qwen3")


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    config = llama.write(m, vocab_size, "Qwen3ForCausalLM", "qwen3", use_sliding_window=False)
    config.pop("mlp_bias")
    return config


FAMILY = llama.family(
    "qwen3", "Qwen3 dense (a Llama with q/k RMSNorm per head and a decoupled head_dim)",
    "meshtrain.models.qwen3.model:Qwen3",
    HFFormat(architectures=("Qwen3ForCausalLM",), model_type="qwen3", read=read, write=write,
             sources=partial(llama.sources, qk_norm=True), shapes=partial(llama.shapes, qk_norm=True),
             defaults=HF_DEFAULTS, training=llama.TRAINING),
    qk_norm=True)
