"""Sequence parallelism: "inner attention" modules that attend over a sequence split across sp ranks.

The model calls ``inner_attention(q, k, v)`` with q, k, v of shape (B, nh, T/sp, hs) (this rank's
heads and tokens) and gets (B, nh, T/sp, hs): causal attention with scale 1/sqrt(hs) over the
*global* sequence. The single-rank default is ``F.scaled_dot_product_attention(is_causal=True)``;
the modules here replace it. With document packing the model also passes ``mask=``, the (B, 1, T, T)
document mask of the whole sequence (:func:`meshtrain.models.attention.document_causal_mask`): Ulysses applies
it after its all-to-all, ring attention slices each block's part of it (and skips the blocks it forbids whole).

- :class:`UlyssesAttention` (``ulysses.py``): DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509):
  all-to-all to head shards, full-sequence attention, all-to-all back. Tokens in contiguous chunks;
  needs nh % sp == 0.
- :class:`RingAttention` (``ring.py``): ring attention (Liu et al. 2023, arXiv:2310.01889) on the
  load-balanced "zigzag" layout (the load balancing of striped attention, Brandon et al. 2023, in the
  form of Llama 3's context parallelism): any nh.
- :class:`USPAttention` (``usp.py``): USP (Fang and Zhao 2024, arXiv:2405.07719): Ulysses' all-to-all over
  ``sp_ulysses`` ranks, then ring attention over the ``sp / sp_ulysses`` ring ranks on the zigzag layout whose
  chunks are cut further into ``sp_ulysses`` pieces; needs nh % sp_ulysses == 0.

:func:`apply_sp` (``apply.py``) swaps them into a model; everything else in a transformer is per token,
so only attention communicates. :func:`shard_sequence` and :func:`sequence_positions` (``shard.py``)
give each rank its tokens and their global positions in the layout each module expects. The
collectives are in ``comm.py``.

PyTorch's ``context_parallel`` needs a CUDA SDPA kernel (flash, efficient or cuDNN): on CPU, SDPA
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding
rule in torch 2.13 (NotImplementedError), so this is written here.
"""

from __future__ import annotations

from meshtrain.parallel.sequence.apply import apply_sp
from meshtrain.parallel.sequence.ring import RingAttention
from meshtrain.parallel.sequence.shard import SP_MODES, sequence_positions, shard_sequence
from meshtrain.parallel.sequence.ulysses import UlyssesAttention
from meshtrain.parallel.sequence.usp import USPAttention

__all__ = ["SP_MODES", "RingAttention", "USPAttention", "UlyssesAttention", "apply_sp", "sequence_positions",
           "shard_sequence"]
