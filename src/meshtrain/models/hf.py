"""Hugging Face ``transformers`` names for meshtrain's parameters: one table per architecture.

``LlamaForCausalLM`` (``transformers/models/llama``) names its tensors ``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``model.layers.{i}.mlp.{gate,up,down}_proj``, the two norms
``input_layernorm`` / ``post_attention_layernorm``, ``model.norm`` and ``lm_head``. meshtrain's Llama rotates
the halves of each head as ``transformers`` does, so the tensors map one to one, with no permutation.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LLAMA_BLOCK = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"), ("attn.q", "self_attn.q_proj"),
               ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"), ("attn.proj", "self_attn.o_proj"),
               ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))
"""(meshtrain's module in ``blocks.{i}``, ``transformers``' module in ``model.layers.{i}``) of a Llama block."""
LLAMA_ENDS = (("tok_emb", "model.embed_tokens"), ("norm", "model.norm"), ("lm_head", "lm_head"))


def llama_names(n_layer: int) -> dict[str, str]:
    """{meshtrain parameter name: ``LlamaForCausalLM`` parameter name} for an ``n_layer`` Llama."""
    names = {f"{ours}.weight": f"{theirs}.weight" for ours, theirs in LLAMA_ENDS}
    for i in range(n_layer):
        names.update({f"blocks.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight" for ours, theirs in LLAMA_BLOCK})
    return names


def to_hf_state_dict(state: Mapping[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """meshtrain Llama ``state`` (its ``state_dict()``) under ``transformers``' names. A tied head is one
    tensor in ``state`` (``lm_head.weight`` is ``tok_emb.weight``); it is kept under both names.

    Raises:
        KeyError: a tensor the table does not name (not a Llama state dict).
    """
    names = llama_names(n_layer)
    return {names[k]: v for k, v in state.items()}
