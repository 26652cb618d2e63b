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
``sequence/comm.py``.

PyTorch's ``context_parallel`` needs a CUDA SDPA kernel (flash, efficient or cuDNN): on CPU, SDPA
dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding
rule in torch 2.13 (NotImplementedError), so this is written here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.models.gpt import causal_attention
from meshtrain.parallel.sequence.comm import head_to_seq, ring_pass, seq_to_head

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
        y = causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)  # (B, nh/sp, T, hs)
        return head_to_seq(y, self.group)  # (B, nh, T/sp, hs)


class RingAttention(nn.Module):
    """Causal ring attention (Liu et al. 2023, arXiv:2310.01889) on the zigzag layout.

    forward(q, k, v): each (B, nh, T/sp, hs), tokens in the "ring" layout of :func:`shard_sequence`
    (this rank's two chunks of length c = T/(2sp)) -> (B, nh, T/sp, hs).

    K and V, stacked into one (2, B, nh, T/sp, hs) tensor, travel around the sp ring: at step s
    this rank holds the K/V of group rank (rank - s) mod sp. Each local query chunk attends to each
    held K/V chunk by global chunk index: a later chunk is skipped, the same chunk gets the causal
    mask, an earlier chunk is attended in full. Partial results are merged with the online softmax
    (Milakov & Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022, arXiv:2205.14135,
    Sec. 3.1): new = logaddexp(lse, blk_lse), out = out*exp(lse - new) + blk*exp(blk_lse - new).

    The backward is FlashAttention-2's (Dao 2023, arXiv:2307.08691, Algorithm 2) run around the same
    ring: each block's probabilities are recomputed from q, k and the final log-sum-exp,
    ``dS = P * (dO V^T - rowsum(dO * O))``, and the K/V gradients travel with K/V, arriving at their
    owner after a full turn. On a CPU each block runs PyTorch's fused flash kernel (which returns the
    log-sum-exp, and whose backward takes the final output and log-sum-exp); elsewhere the same math
    in plain matmuls. So only q, k, v, the output and the log-sum-exp are kept for backward
    (O(T/sp) per rank), and one (c, c) block of scores exists at a time. Communication: sp-1 passes
    of K/V forward, sp-1 of K/V and sp of their gradients backward, 2*B*nh*(T/sp)*hs elements each,
    not overlapped with compute. No dropout: attention dropout is not supported here (the model's
    other dropouts are unaffected).
    """

    def __init__(self, group: ProcessGroup | None):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.size(2) % 2:
            raise ValueError(f"ring attention holds two chunks per rank: local length {q.size(2)} must be even")
        # the blocks' softmax statistics and merges run in at least fp32 (as fused attention kernels
        # accumulate in fp32 under bf16 autocast); the output returns in the input's dtype
        dtype = torch.promote_types(q.dtype, torch.float32)
        out = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), self.group)  # (B, nh, T/sp, hs)
        return out.to(q.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        outs: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, hs)
        lses: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, 1)
        kv = torch.stack([k, v])  # (2, B, nh, T/sp, hs)
        for step in range(sp):
            for n, j, causal, q_c, kv_c in _block_pairs(q, kv, rank, (rank - step) % sp, sp):
                blk, blk_lse = _block_forward(q_c, kv_c[0], kv_c[1], causal, scale)
                outs[n], lses[n] = _merge(outs[n], lses[n], blk, blk_lse)
            if step < sp - 1:
                kv = ring_pass(kv, group)  # (2, B, nh, T/sp, hs) of group rank (rank - step - 1)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, nh, T/sp, hs), (B, nh, T/sp, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.size(-1))
        delta = (dout * out).sum(-1, keepdim=True)  # (B, nh, T/sp, 1): rowsum(dO * O)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])  # (2, B, nh, T/sp, hs)
        dkv = torch.zeros_like(kv)  # gradients of the K/V this rank holds, travelling with them
        for step in range(sp):
            for n, j, causal, q_c, kv_c in _block_pairs(q, kv, rank, (rank - step) % sp, sp):
                rows = slice(n * q_c.size(2), (n + 1) * q_c.size(2))
                dq_c, dk_c, dv_c = _block_backward(q_c, kv_c[0], kv_c[1], dout[:, :, rows], out[:, :, rows],
                                                   lse[:, :, rows], delta[:, :, rows], causal, scale)
                dq[:, :, rows] += dq_c
                cols = slice(j * kv_c.size(3), (j + 1) * kv_c.size(3))
                dkv[0, :, :, cols] += dk_c
                dkv[1, :, :, cols] += dv_c
            if step < sp - 1:
                kv = ring_pass(kv, group)
            dkv = ring_pass(dkv, group)  # after sp passes the gradients are back with their K/V's owner
        return dq, dkv[0], dkv[1], None


def _block_pairs(q: torch.Tensor, kv: torch.Tensor, rank: int, src: int, sp: int):
    """(query chunk n, K/V chunk j, causal, q chunk (B, nh, c, hs), K/V chunk (2, B, nh, c, hs)) for each
    pair of this rank's query chunks and group rank ``src``'s K/V chunks that has unmasked entries."""
    for j, (kv_c, kv_idx) in enumerate(zip(kv.chunk(2, dim=3), _zigzag(src, sp))):
        for n, (q_c, q_idx) in enumerate(zip(q.chunk(2, dim=2), _zigzag(rank, sp))):
            if kv_idx <= q_idx:  # a later K/V chunk is entirely in these queries' future
                yield n, j, kv_idx == q_idx, q_c, kv_c


def _zigzag(sp_rank: int, sp: int) -> tuple[int, int]:
    """Global chunk indices (of 2*sp) that group rank ``sp_rank`` holds in the "ring" layout."""
    return sp_rank, 2 * sp - 1 - sp_rank


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q, k (B, nh, c, hs) -> scaled scores (B, nh, c, c); ``causal``: query i sees keys 0..i only."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, c, c)
    if causal:
        c = scores.size(-1)
        scores.masked_fill_(torch.ones(c, c, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v (B, nh, c, hs) -> out (B, nh, c, hs) and its log-sum-exp (B, nh, c, 1).

    Every row keeps at least one key (the diagonal when ``causal``), so the log-sum-exp is finite.
    """
    if q.device.type == "cpu":  # PyTorch's fused CPU flash kernel returns the log-sum-exp too
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.unsqueeze(-1)  # (B, nh, c, hs), (B, nh, c, 1)
    scores = _scores(q, k, causal, scale)  # (B, nh, c, c)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, nh, c, 1)
    return scores.sub_(lse).exp_() @ v, lse


def _block_backward(q, k, v, dout, out, lse, delta, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, each (B, nh, c, hs), from the *final* lse and delta (B, nh, c, 1)."""
    if q.device.type == "cpu":  # the fused kernel's backward, given the final output and log-sum-exp
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, causal, scale=scale)
    p = _scores(q, k, causal, scale).sub_(lse).exp_()  # (B, nh, c, c): this block's share of the softmax
    dv = p.transpose(-2, -1) @ dout  # (B, nh, c, hs)
    ds = p.mul_((dout @ v.transpose(-2, -1)).sub_(delta))  # (B, nh, c, c): P * (dP - delta)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, blk: torch.Tensor,
           blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint keys (out (B, nh, c, hs), lse (B, nh, c, 1))."""
    if out is None:
        return blk, blk_lse
    new = torch.logaddexp(lse, blk_lse)  # (B, nh, c, 1)
    return out * torch.exp(lse - new) + blk * torch.exp(blk_lse - new), new
