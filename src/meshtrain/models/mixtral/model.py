"""Mixtral (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088): the Llama (:mod:`meshtrain.models.llama.model`)
with every block's SwiGLU replaced by a sparse mixture of SwiGLU experts, top-2 of 8 in the released models, the
two routing weights renormalised to sum to 1 (Sec. 2.1, Eq. 1-2; :class:`meshtrain.models.moe.layer.MoE`)."""

from __future__ import annotations

from meshtrain.models.llama.model import Llama


class Mixtral(Llama):
    """A Llama whose MLPs are routed experts."""

    MOE = True
