"""Causal ring attention over a sequence split across sp ranks, on the zigzag "ring" layout.

:class:`RingAttention` is the module; :class:`_RingAttention` its autograd function, whose forward and
backward each run one turn of the ring (:func:`meshtrain.parallel.sequence.comm.ring_pass`) over the
blocks of query and K/V chunks that have unmasked entries (:func:`_block_pairs`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from meshtrain.models.attention import DocumentMask, repeat_kv
from meshtrain.parallel.sequence.comm import ring_pass
from meshtrain.parallel.sequence.shard import zigzag_chunks


class RingAttention(nn.Module):
    """Causal ring attention (Liu et al. 2023, arXiv:2310.01889) on the zigzag layout.

    forward(q, k, v): each (B, nh, T/sp, hs), tokens in the "ring" layout of
    :func:`~meshtrain.parallel.sequence.shard.shard_sequence` (this rank's two chunks of length
    c = T/(2sp)) -> (B, nh, T/sp, hs). v may be narrower or wider than q and k (latent attention, DeepSeek-V2
    report Sec. 2.1: q and k of dn+dr features, v of dv): the narrower side is zero-padded to the wider width, which
    changes no score ``q.k`` nor any kept output feature, and the scale stays ``1/sqrt(q's own width)``.

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

    Packed documents (``data.packing = "document"``): ``mask`` is the document mask of the whole sequence in its
    natural order, as the document ids (:class:`meshtrain.models.attention.DocumentMask`, (B, T): the T x T mask is
    never built) or as the (B, 1, T, T) mask itself. The block of query chunk i and K/V chunk j is its (c, c) part
    at rows i*c.., columns j*c.. (:meth:`~meshtrain.models.attention.DocumentMask.block`): a block
    with no allowed entry (the keys all in earlier documents) is skipped, forward and backward alike; one that is
    all allowed, or exactly causal, runs the fused kernel as without documents; any other is computed with its
    mask, a query row with no allowed key in it contributing nothing (its block log-sum-exp is -inf). Every row
    keeps its own diagonal, so its final log-sum-exp is finite. The zigzag layout, and so the load balance, is
    the same as without documents.
    """

    def __init__(self, group: ProcessGroup | None):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | DocumentMask | None = None) -> torch.Tensor:
        if q.size(2) % 2:
            raise ValueError(f"ring attention holds two chunks per rank: local length {q.size(2)} must be even")
        # the blocks' softmax statistics and merges run in at least fp32 (as fused attention kernels
        # accumulate in fp32 under bf16 autocast); the output returns in the input's dtype
        dtype = torch.promote_types(q.dtype, torch.float32)
        k, v = repeat_kv(q, k), repeat_kv(q, v)  # grouped-query kv (B, nkv, T/sp, hs) -> (B, nh, T/sp, hs)
        scale = 1.0 / math.sqrt(q.size(-1))  # of the real q width, before any padding below
        hs, hv = q.size(-1), v.size(-1)  # unequal in latent attention (MLA's dn+dr and dv)
        if hv < hs:  # zero features of v give zero output features, cut off after
            v = F.pad(v, (0, hs - hv))  # (B, nh, T/sp, hs)
        elif hv > hs:  # zero features of q and k leave every score q.k unchanged
            q, k = F.pad(q, (0, hv - hs)), F.pad(k, (0, hv - hs))  # (B, nh, T/sp, hv)
        out = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), self.group, mask, scale)  # (B, nh, T/sp, .)
        return out[..., :hv].to(q.dtype)  # (B, nh, T/sp, hv)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup | None,
                mask: torch.Tensor | DocumentMask | None = None, scale: float | None = None) -> torch.Tensor:
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        outs: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, hs)
        lses: list[torch.Tensor | None] = [None, None]  # per query chunk: (B, nh, c, 1)
        kv = torch.stack([k, v])  # (2, B, nh, T/sp, hs)
        for step in range(sp):
            for n, j, causal, q_c, kv_c in _block_pairs(q, kv, rank, (rank - step) % sp, sp, mask):
                blk, blk_lse = _block_forward(q_c, kv_c[0], kv_c[1], causal, scale)
                outs[n], lses[n] = _merge(outs[n], lses[n], blk, blk_lse)
            if step < sp - 1:
                kv = ring_pass(kv, group)  # (2, B, nh, T/sp, hs) of group rank (rank - step - 1)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, nh, T/sp, hs), (B, nh, T/sp, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.mask, ctx.scale = group, mask, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = ctx.scale
        delta = (dout * out).sum(-1, keepdim=True)  # (B, nh, T/sp, 1): rowsum(dO * O)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])  # (2, B, nh, T/sp, hs)
        dkv = torch.zeros_like(kv)  # gradients of the K/V this rank holds, travelling with them
        for step in range(sp):
            for n, j, causal, q_c, kv_c in _block_pairs(q, kv, rank, (rank - step) % sp, sp, ctx.mask):
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
        return dq, dkv[0], dkv[1], None, None, None


def _block_pairs(q: torch.Tensor, kv: torch.Tensor, rank: int, src: int, sp: int,
                 mask: torch.Tensor | DocumentMask | None = None):
    """(query chunk n, K/V chunk j, its mask, q chunk (B, nh, c, hs), K/V chunk (2, B, nh, c, hs)) for each
    pair of this rank's query chunks and group rank ``src``'s K/V chunks that has unmasked entries. The mask is
    True (full), "causal", or a (B, 1, c, c) bool block of the document ``mask`` (:class:`RingAttention`)."""
    c = q.size(2) // 2
    for j, (kv_c, kv_idx) in enumerate(zip(kv.chunk(2, dim=3), zigzag_chunks(src, sp))):
        for n, (q_c, q_idx) in enumerate(zip(q.chunk(2, dim=2), zigzag_chunks(rank, sp))):
            if kv_idx > q_idx:  # a later K/V chunk is entirely in these queries' future
                continue
            if mask is None:
                yield n, j, "causal" if kv_idx == q_idx else True, q_c, kv_c
                continue
            rows, cols = slice(q_idx * c, (q_idx + 1) * c), slice(kv_idx * c, (kv_idx + 1) * c)
            block = mask.block(rows, cols) if isinstance(mask, DocumentMask) else mask[:, :, rows, cols]  # (B, 1, c, c)
            if not bool(block.any()):  # these keys are all in earlier documents than these queries
                continue
            if bool(block.all()):
                yield n, j, True, q_c, kv_c
            elif kv_idx == q_idx and torch.equal(block, torch.ones_like(block).tril()):  # one document throughout
                yield n, j, "causal", q_c, kv_c
            else:
                yield n, j, block, q_c, kv_c


def _scores(q: torch.Tensor, k: torch.Tensor, mask: bool | str | torch.Tensor, scale: float) -> torch.Tensor:
    """q, k (B, nh, c, hs) -> scaled scores (B, nh, c, c), -inf where ``mask`` forbids: True (none), "causal"
    (query i sees keys 0..i only) or a (B, 1, c, c) bool block, True where allowed."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, c, c)
    if isinstance(mask, torch.Tensor):
        scores.masked_fill_(~mask, float("-inf"))
    elif mask == "causal":
        c = scores.size(-1)
        scores.masked_fill_(torch.ones(c, c, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: bool | str | torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v (B, nh, c, hs) -> out (B, nh, c, hs) and its log-sum-exp (B, nh, c, 1), ``mask`` as
    :func:`_scores`. A row with no allowed key (a document's, in a block of earlier documents' keys) gets out 0
    and log-sum-exp -inf, which :func:`_merge` then ignores."""
    if q.device.type == "cpu" and not isinstance(mask, torch.Tensor):  # PyTorch's fused CPU flash kernel: + lse
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mask == "causal",
                                                                             scale=scale)
        return out, lse.unsqueeze(-1)  # (B, nh, c, hs), (B, nh, c, 1)
    scores = _scores(q, k, mask, scale)  # (B, nh, c, c)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, nh, c, 1)
    return scores.sub_(_finite(lse)).exp_() @ v, lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a row with no allowed key so far) as 0: subtracting it leaves exp(-inf) = 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_backward(q, k, v, dout, out, lse, delta, mask: bool | str | torch.Tensor, scale: float):
    """Gradients (dq, dk, dv) of one block, each (B, nh, c, hs), from the *final* lse and delta (B, nh, c, 1)
    (finite: every row has its diagonal somewhere)."""
    if q.device.type == "cpu" and not isinstance(mask, torch.Tensor):  # the fused kernel's backward
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.squeeze(-1), 0.0, mask == "causal", scale=scale)
    p = _scores(q, k, mask, scale).sub_(lse).exp_()  # (B, nh, c, c): this block's share of the softmax
    dv = p.transpose(-2, -1) @ dout  # (B, nh, c, hs)
    ds = p.mul_((dout @ v.transpose(-2, -1)).sub_(delta))  # (B, nh, c, c): P * (dP - delta)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, blk: torch.Tensor,
           blk_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint keys (out (B, nh, c, hs), lse (B, nh, c, 1))."""
    if out is None:
        return blk, blk_lse
    new = torch.logaddexp(lse, blk_lse)  # (B, nh, c, 1); -inf where neither has an allowed key yet
    safe = _finite(new)
    return out * torch.exp(lse - safe) + blk * torch.exp(blk_lse - safe), new
