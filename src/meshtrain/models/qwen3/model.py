"""Qwen3 (dense): the Llama (:mod:`meshtrain.models.llama.model`) with an RMSNorm over each head's features of q
and of k before RoPE (Yang et al. 2025, arXiv:2505.09388, Sec. 2) and ``model.head_dim`` decoupled from the width.
The norms' weights, (hd,), start at 1; under tp every rank holds them whole and their gradients, partial sums over
each rank's heads, are all-reduced (the plan's ``head_norms``, :mod:`meshtrain.models.tp_plan`)."""

from __future__ import annotations

from meshtrain.models.llama.model import Llama


class Qwen3(Llama):
    """A Llama whose q and k are RMS-normalised per head."""

    QK_NORM = True
