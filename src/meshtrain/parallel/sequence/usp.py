"""USP: two-dimensional sequence parallelism, DeepSpeed-Ulysses inside and ring attention across.

Shapes (B, nh, T, hs) = (batch, heads, tokens, head size); ``U`` = ranks of the Ulysses group (``sp_ulysses``),
``R = sp / U`` ranks of the ring group; ``nh`` is this tp rank's heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.parallel.sequence.comm import head_to_seq, seq_to_head
from meshtrain.parallel.sequence.ring import RingAttention


class USPAttention(nn.Module):
    """Unified sequence parallelism (Fang and Zhao 2024, arXiv:2405.07719): Ulysses' all-to-all of heads over
    ``ulysses_group`` (U consecutive sp ranks), ring attention over ``ring_group`` (the R = sp/U ranks at the same
    place of each Ulysses group).

    forward(q, k, v): q (B, nh, T/sp, hs), k and v (B, nkv, T/sp, hs), tokens in the "usp" layout of
    :func:`~meshtrain.parallel.sequence.shard.shard_sequence` (this rank holds piece u of ring chunks r and 2R-1-r)
    -> (B, nh, T/sp, hs). Three steps:

    1. :func:`~meshtrain.parallel.sequence.comm.seq_to_head` over the U ranks: (B, nh, T/sp, hs) -> (B, nh/U, T/R,
       hs), the pieces of Ulysses rank j at [j*T/sp, (j+1)*T/sp); reordered (:func:`_pieces_to_chunks`) to
       [chunk r; chunk 2R-1-r], the ring rank's two whole zigzag chunks;
    2. :class:`~meshtrain.parallel.sequence.ring.RingAttention` over the R ranks on nh/U heads (grouped-query kv heads
       repeated there, after the all-to-all: nkv/U of them travel);
    3. the reorder and the all-to-all backwards: (B, nh/U, T/R, hs) -> (B, nh, T/sp, hs).

    Communication per layer: Ulysses' 4 all-to-alls of a (B, nh, T/sp, hs)-sized buffer over U ranks forward (and 4
    backward), plus ring attention's R-1 K/V passes forward and R-1 K/V plus R K/V-gradient passes backward, each
    buffer (2, B, nh/U, T/R, hs). ``U = sp`` is Ulysses with ring's zigzag token order, ``U = 1`` ring attention.
    No attention dropout (ring attention has none).

    With document packing, ``mask`` is the (B, 1, T, T) document mask of the whole window in natural order, handed
    to ring attention unchanged: after step 1 the ring rank holds whole chunks, which it slices by global chunk index.

    Raises (in forward, from :func:`seq_to_head`, before any communication):
        ValueError: nh or nkv is not divisible by U.
    """

    def __init__(self, ulysses_group: ProcessGroup, ring_group: ProcessGroup):
        super().__init__()
        self.ulysses_group = ulysses_group
        self.ulysses = dist.get_world_size(ulysses_group)
        self.ring = RingAttention(ring_group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (self._to_ring(t) for t in (q, k, v))  # (B, nh/U, T/R, hs), k and v (B, nkv/U, T/R, hs)
        y = self.ring(q, k, v, mask)  # (B, nh/U, T/R, hs)
        if self.ulysses == 1:
            return y
        return head_to_seq(_pieces_to_chunks(y, 2, self.ulysses), self.ulysses_group)  # (B, nh, T/sp, hs)

    def _to_ring(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, T/sp, hs) of this rank's two pieces -> (B, n/U, T/R, hs) of the ring rank's two chunks."""
        if self.ulysses == 1:
            return x
        return _pieces_to_chunks(seq_to_head(x, self.ulysses_group), self.ulysses, 2)


def _pieces_to_chunks(x: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
    """Reorder (B, n, L, hs) held as ``outer`` x ``inner`` equal pieces along L into ``inner`` x ``outer``.

    After the all-to-all, ``outer = U`` (one block per Ulysses rank), ``inner = 2`` (its pieces of the two chunks):
    the result is the U pieces of chunk r, then those of chunk 2R-1-r. ``outer = 2, inner = U`` is the inverse.
    """
    B, n, L, hs = x.shape
    # (B, n, L, hs) -> (B, n, outer, inner, L/(outer*inner), hs) -> (B, n, inner, outer, ..., hs) -> (B, n, L, hs)
    return x.reshape(B, n, outer, inner, L // (outer * inner), hs).transpose(2, 3).reshape(B, n, L, hs)
