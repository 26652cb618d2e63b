"""Sequence parallelism: "inner attention" modules that attend over a sequence split across sp ranks.

The model calls ``inner_attention(q, k, v)`` with q, k, v of shape (B, nh, T/sp, hs) (this rank's
heads and tokens) and gets (B, nh, T/sp, hs): causal attention with scale 1/sqrt(hs) over the
*global* sequence. The single-rank default is ``F.scaled_dot_product_attention(is_causal=True)``;
the modules here replace it:

- :class:`UlyssesAttention`: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): all-to-all to
  head shards, full-sequence attention, all-to-all back. Tokens in contiguous chunks; needs nh % sp == 0.
- :class:`RingAttention`: ring attention (Liu et al. 2023, arXiv:2310.01889) on the load-balanced
  "zigzag" layout (the load balancing of striped attention, Brandon et al. 2023, in the form of
  Llama 3's context parallelism): any nh.

:func:`apply_sp` swaps them into a model; everything else in a transformer is per token, so only
attention communicates. :func:`shard_sequence` and :func:`sequence_positions` give each rank its
tokens and their global positions in the layout each module expects. The collectives are in
``sp_comm.py``.

PyTorch's ``context_parallel`` needs a CUDA SDPA kernel (flash, efficient or cuDNN): on CPU, SDPA
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding
rule in torch 2.13 (NotImplementedError), so this is written here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.parallel.sp_comm import head_to_seq, ring_shift, seq_to_head

SP_MODES = ("ulysses", "ring")


def apply_sp(model: nn.Module, sp_mesh: DeviceMesh, sp_mode: str) -> nn.Module:
    """Replace every ``inner_attention`` submodule of ``model`` by the ``sp_mode`` module on the 1-D ``sp_mesh``.

    The model's inputs must then be this rank's tokens (:func:`shard_sequence` along T, positions
    from :func:`sequence_positions`). Ulysses keeps the replaced module's ``dropout`` (0 if it has
    none); ring attention has no attention dropout. Returns ``model``, changed in place.

    Raises:
        ValueError: ``sp_mode`` is not "ulysses" or "ring".
    """
    if sp_mode not in SP_MODES:
        raise ValueError(f"sequence-parallel mode = {sp_mode!r} is not known: use one of {SP_MODES}")
    group = sp_mesh.get_group()
    for parent in [m for m in model.modules() if hasattr(m, "inner_attention")]:
        dropout = getattr(parent.inner_attention, "dropout", 0.0)
        parent.inner_attention = UlyssesAttention(group, dropout) if sp_mode == "ulysses" else RingAttention(group)
    return model


def shard_sequence(x: torch.Tensor, dim: int, sp_rank: int, sp: int, mode: str) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim``: length T -> T/sp.

    - ``"ulysses"``: the contiguous chunk ``sp_rank`` of ``sp``.
    - ``"ring"``: zigzag: the sequence is cut into 2*sp chunks and rank i holds chunks i and
      2*sp-1-i, concatenated; under a causal mask every rank then has the same amount of work
      (the causal load-balancing problem of Brandon et al. 2023, arXiv:2311.09431, solved as in
      Llama 3's context parallelism, arXiv:2407.21783, Sec. 3.3.2).

    Raises:
        ValueError: unknown ``mode``, ``sp_rank`` outside [0, sp), or the length is not divisible
            by sp ("ulysses") or 2*sp ("ring").
    """
    if mode not in SP_MODES:
        raise ValueError(f"sequence-parallel mode = {mode!r} is not known: use one of {SP_MODES}")
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank = {sp_rank} is outside [0, sp = {sp})")
    n_chunks = sp if mode == "ulysses" else 2 * sp
    T = x.size(dim)
    if T % n_chunks:
        raise ValueError(f"sequence length {T} (tensor dim {dim}) is not divisible by {n_chunks}: "
                         f"mode {mode!r} with sp = {sp} cuts it into {n_chunks} equal chunks")
    chunks = x.chunk(n_chunks, dim)  # n_chunks x (..., T/n_chunks, ...)
    if mode == "ulysses":
        return chunks[sp_rank]
    return torch.cat([chunks[sp_rank], chunks[2 * sp - 1 - sp_rank]], dim)  # (..., T/sp, ...)


def sequence_positions(seq_len: int, sp_rank: int, sp: int, mode: str,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """LongTensor (seq_len/sp,): global positions of this rank's tokens, in local order (as :func:`shard_sequence`)."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, sp_rank, sp, mode)


class UlyssesAttention(nn.Module):
    """DeepSpeed-Ulysses attention (Jacobs et al. 2023, arXiv:2309.14509, Sec. 3).

    forward(q, k, v): each (B, nh, T/sp, hs), tokens in the "ulysses" layout (contiguous chunks)
    -> (B, nh, T/sp, hs). An all-to-all turns q, k, v into (B, nh/sp, T, hs) head shards over the
    whole sequence, causal SDPA runs there, and an all-to-all turns the result back. Communication
    per layer: 4 all-to-alls of (B, nh, T/sp, hs) each (3 in, 1 out); memory: full-sequence
    attention for nh/sp heads. Dropout (``dropout`` when training) is applied by SDPA; its masks
    differ from a single-process run's, so parity holds with dropout 0 only.

    Raises (in forward, from :func:`seq_to_head`, before any communication):
        ValueError: nh is not divisible by sp.
    """

    def __init__(self, group: ProcessGroup | None, dropout: float = 0.0):
        super().__init__()
        self.group = group
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (seq_to_head(t, self.group) for t in (q, k, v))  # (B, nh/sp, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)  # (B, nh/sp, T, hs)
        return head_to_seq(y, self.group)  # (B, nh, T/sp, hs)


class RingAttention(nn.Module):
    """Causal ring attention (Liu et al. 2023, arXiv:2310.01889) on the zigzag layout.

    forward(q, k, v): each (B, nh, T/sp, hs), tokens in the "ring" layout of :func:`shard_sequence`
    (this rank's two chunks of length c = T/(2sp)) -> (B, nh, T/sp, hs).

    K and V, stacked into one (2, B, nh, T/sp, hs) tensor, travel around the sp ring: at step s
    this rank holds the K/V of group rank (rank - s) mod sp. Each local query chunk attends to each
    held K/V chunk by global chunk index: a later chunk is skipped, the same chunk gets the causal
    mask, an earlier chunk is attended in full. The partial results are merged with the online
    softmax (Milakov & Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022,
    arXiv:2205.14135, Sec. 3.1): new = logaddexp(lse, blk_lse),
    out = out*exp(lse - new) + blk*exp(blk_lse - new).

    The block math is plain differentiable torch, so autograd gives the backward; the only custom
    backward is that of :func:`ring_shift` (gradients of K/V travel the ring the other way).
    Communication: sp-1 shifts of 2*B*nh*(T/sp)*hs elements, not overlapped with compute.
    Memory: one (c, c) chunk pair's scores are formed at a time, but autograd saves every pair's
    probabilities for backward: 2*sp+1 pairs per rank, about (T^2 / (2*sp)) per (batch, head) in
    all, 1/sp of the causal half of the full score matrix (a flash kernel would recompute them).
    No dropout: attention dropout is not supported here (the model's other dropouts are unaffected).
    """

    def __init__(self, group: ProcessGroup | None):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.size(2) % 2:
            raise ValueError(f"ring attention holds two chunks per rank: local length {q.size(2)} must be even")
        sp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        scale = 1.0 / math.sqrt(q.size(-1))
        q_chunks = q.chunk(2, dim=2)  # 2 x (B, nh, c, hs), global chunks _zigzag(rank, sp)
        outs: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, hs)
        lses: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, 1)
        kv = torch.stack([k, v])  # (2, B, nh, T/sp, hs)
        for step in range(sp):
            src = (rank - step) % sp  # the group rank whose K/V we hold
            for kv_c, kv_idx in zip(kv.chunk(2, dim=3), _zigzag(src, sp)):  # kv_c: (2, B, nh, c, hs)
                for n, (q_c, q_idx) in enumerate(zip(q_chunks, _zigzag(rank, sp))):
                    if kv_idx > q_idx:
                        continue  # all of these keys come after all of these queries
                    blk, blk_lse = _block_attention(q_c, kv_c[0], kv_c[1], kv_idx == q_idx, scale)
                    outs[n], lses[n] = _merge(outs[n], lses[n], blk, blk_lse)
            if step < sp - 1:
                kv = ring_shift(kv, self.group)  # (2, B, nh, T/sp, hs) of group rank src - 1
        return torch.cat(outs, dim=2)  # (B, nh, T/sp, hs)


def _zigzag(sp_rank: int, sp: int) -> tuple[int, int]:
    """Global chunk indices (of 2*sp) that group rank ``sp_rank`` holds in the "ring" layout."""
    return sp_rank, 2 * sp - 1 - sp_rank


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v (B, nh, c, hs) -> out (B, nh, c, hs) and its log-sum-exp (B, nh, c, 1).

    ``causal``: q and k are the same chunk, so query i sees keys 0..i. Every row keeps at least
    one key (the diagonal), so the log-sum-exp is finite.
    """
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, c, c)
    if causal:
        c = scores.size(-1)
        future = torch.ones(c, c, dtype=torch.bool, device=scores.device).triu(1)  # (c, c)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, nh, c, 1)
    return torch.exp(scores - lse) @ v, lse


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, blk: torch.Tensor,
           blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint keys (out (B, nh, c, hs), lse (B, nh, c, 1))."""
    if out is None:
        return blk, blk_lse
    new = torch.logaddexp(lse, blk_lse)  # (B, nh, c, 1)
    return out * torch.exp(lse - new) + blk * torch.exp(blk_lse - new), new
