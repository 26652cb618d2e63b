"""DeepSpeed-Ulysses attention over a sequence split across sp ranks (contiguous "ulysses" layout)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.models.attention import causal_attention
from meshtrain.parallel.sequence.comm import head_to_seq, seq_to_head


class UlyssesAttention(nn.Module):
    """DeepSpeed-Ulysses attention (Jacobs et al. 2023, arXiv:2309.14509, Sec. 3).

    forward(q, k, v): each (B, nh, T/sp, hs), tokens in the "ulysses" layout (contiguous chunks)
    -> (B, nh, T/sp, hs). An all-to-all turns q, k, v into (B, nh/sp, T, hs) head shards over the
    whole sequence, causal SDPA runs there, and an all-to-all turns the result back. Communication
    per layer: 4 all-to-alls of (B, nh, T/sp, hs) each (3 in, 1 out); memory: full-sequence
    attention for nh/sp heads. Dropout (``dropout`` when training) is applied by SDPA; its masks
    differ from a single-process run's, so parity holds with dropout 0 only.

    With document packing, ``mask`` is the (B, 1, T, T) document mask of the *whole* sequence
    (:func:`meshtrain.models.attention.document_causal_mask` of every rank's tokens): after the all-to-all this
    rank attends over all T tokens of its heads, and the mask is the same for every head.

    Raises (in forward, from :func:`seq_to_head`, before any communication):
        ValueError: nh is not divisible by sp.
    """

    def __init__(self, group: ProcessGroup | None, dropout: float = 0.0):
        super().__init__()
        self.group = group
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (seq_to_head(t, self.group) for t in (q, k, v))  # (B, nh/sp, T, hs)
        y = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                             mask=mask)  # (B, nh/sp, T, hs)
        return head_to_seq(y, self.group)  # (B, nh, T/sp, hs)
