"""Qwen2 / Qwen2.5: the Llama (:mod:`meshtrain.models.llama.model`) with biases on the q, k and v projections
(Yang et al. 2024, arXiv:2407.10671, Sec. 2.2.1). The biases start at 0 (the decoders' init), are column-parallel
with their weights under tp (each rank its heads' biases) and load from ``self_attn.{q,k,v}_proj.bias``."""

from __future__ import annotations

from meshtrain.models.llama.model import Llama


class Qwen2(Llama):
    """A Llama whose q, k and v projections have biases."""

    QKV_BIAS = True
