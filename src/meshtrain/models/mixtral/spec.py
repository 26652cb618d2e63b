"""Mixtral without torch: the Llama's keys, rules and tensor names (:mod:`meshtrain.models.llama.spec`) with routed
experts (:mod:`meshtrain.models.moe.spec`) and ``transformers``' ``MixtralForCausalLM`` format.

Its published checkpoints hold each block's router as ``model.layers.{i}.block_sparse_moe.gate.weight`` (E, C) and
each expert's SwiGLU as ``...block_sparse_moe.experts.{e}.w1`` (gate, (F, C)), ``w3`` (up) and ``w2`` (down, (C, F));
``transformers`` 5 keeps them fused in memory (``model.layers.{i}.mlp.experts.gate_up_proj`` (E, 2F, C),
``down_proj`` (E, C, F)) and saves the published form, which is what an export writes; both are read. Sliding-window
attention (Mistral's, off in Mixtral's configs) and router jitter noise are not built.
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

PUBLISHED = "block_sparse_moe"
EXPERT_NAMES = ("w1", "w3", "w2")
"""Mixtral's per-expert tensors: gate, up, down."""


HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in llama.HF_DEFAULTS.items() if k not in ("attention_bias", "mlp_bias")},
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}
"""``MixtralConfig``'s defaults (``transformers`` 5.24, ``models/mixtral/configuration_mixtral.py``) of every key
:func:`read` reads: the Llama's but these -- 8 kv heads (not ``num_attention_heads``), RMSNorm epsilon 1e-5, RoPE
base 1e6 (its ``default_theta``) -- and no ``attention_bias``/``mlp_bias`` keys (its projections have no biases;
a checkpoint holding some is refused for its tensors, :func:`meshtrain.models.hf_io.check_weights`)."""
ALIASES = {"num_experts": "num_local_experts"}
"""``MixtralConfig.attribute_map``."""


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    refuse(hf, "sliding_window", (None,), where, "full causal attention in every layer")
    refuse(hf, "router_jitter_noise", (0, 0.0), where, "routing without jitter noise")
    keys = llama.read(hf, where, kind="mixtral")
    keys.update(num_experts=number(hf, "num_local_experts", where, int),
                num_experts_per_tok=number(hf, "num_experts_per_tok", where, int), norm_topk_prob=True,
                router_aux_loss_coef=moe.aux_loss_coef(hf, where))
    return keys


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    moe.check_exportable(m)
    config = llama.write(m, vocab_size, "MixtralForCausalLM", "mixtral", num_local_experts=m.num_experts,
                         num_experts_per_tok=m.num_experts_per_tok, router_aux_loss_coef=m.router_aux_loss_coef,
                         router_jitter_noise=0.0, sliding_window=None, output_router_logits=False)
    for key in ("mlp_bias", "attention_bias"):
        config.pop(key)
    return config


def check(m: Any) -> None:
    require(m.norm_topk_prob, "model.norm_topk_prob = false is not Mixtral's routing (it always renormalises the "
                              "top-k weights): use true, or model.type = 'qwen3_moe'")


FAMILY = moe.moe_family(
    "mixtral", "Mixtral (a Llama whose MLPs are top-k routed SwiGLU experts)", "meshtrain.models.mixtral.model:Mixtral",
    HFFormat(architectures=("MixtralForCausalLM",), model_type="mixtral", read=read, write=write,
             sources=partial(moe.moe_sources, published=PUBLISHED, names=EXPERT_NAMES),
             shapes=partial(moe.moe_shapes, published=PUBLISHED, names=EXPERT_NAMES), defaults=HF_DEFAULTS,
             aliases=ALIASES, training=moe.TRAINING),
    check_family=check)
