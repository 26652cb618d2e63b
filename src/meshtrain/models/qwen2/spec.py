"""Qwen2 / Qwen2.5 without torch: a Llama with biases on the q, k and v projections (Yang et al. 2024, "Qwen2
Technical Report", arXiv:2407.10671, Sec. 2.2.1: "QKV bias for attention"), RoPE base 1e6 in the released models,
the head tied or not (``tie_word_embeddings``). Its keys, checks and costs are the Llama family's
(:mod:`meshtrain.models.llama.spec`) with ``qkv_bias``; ``transformers``' ``Qwen2ForCausalLM`` names its tensors as
the Llama does, plus ``self_attn.{q,k,v}_proj.bias``. Sliding-window attention (``use_sliding_window``, off in the
released configs) is not built.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.models.family import HFFormat
from meshtrain.models.hf_io import refuse, with_defaults
from meshtrain.models.llama import spec as llama


HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in llama.HF_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
    "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "max_position_embeddings": 32768,
    "use_sliding_window": False}
"""``Qwen2Config``'s defaults (``transformers`` 5.24, ``models/qwen2/configuration_qwen2.py``) of every key
:func:`read` reads: the Llama's but these, and no ``attention_bias``/``mlp_bias`` (Qwen2's q/k/v biases are the
architecture's) nor ``head_dim`` key (its attention derives it, :data:`meshtrain.models.llama.spec.HEAD_DIM`)."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS)
    refuse(hf, "use_sliding_window", (False,), where, "full causal attention in every layer")
    return llama.read(hf, where, kind="qwen2")


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    config = llama.write(m, vocab_size, "Qwen2ForCausalLM", "qwen2", use_sliding_window=False)
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's biases are fixed by the architecture
        config.pop(key)
    return config


FAMILY = llama.family(
    "qwen2", "Qwen2 / Qwen2.5 (a Llama with q, k, v biases)", "meshtrain.models.qwen2.model:Qwen2",
    HFFormat(architectures=("Qwen2ForCausalLM",), model_type="qwen2", read=read, write=write,
             sources=partial(llama.sources, qkv_bias=True), shapes=partial(llama.shapes, qkv_bias=True),
             defaults=HF_DEFAULTS, training=llama.TRAINING),
    qkv_bias=True)
