"""The collectives of sequence parallelism; the attention math lives in ``meshtrain.parallel.sequence``.

Shapes (B, nh, T, hs) = (batch, heads, tokens, head size); ``sp`` is the size of the sp process
group, ``T/sp`` the tokens one rank holds, ``nh/sp`` the heads one rank holds.

- :func:`seq_to_head` / :func:`head_to_seq`: the all-to-all pair of DeepSpeed-Ulysses (Jacobs et al.
  2023, arXiv:2309.14509, Sec. 3.1) that trades a sequence shard of every head for every token of a
  head shard, and back. Each moves 1/sp of the rank's activations to each of the other ranks.
- :func:`ring_pass`: one step of the ring of ring attention (Liu et al. 2023, arXiv:2310.01889,
  Sec. 3): send to the next rank, receive from the previous one.

All work with gloo on CPU and with NCCL on GPU; ``group`` may be any process group (peers are
mapped to global ranks with ``dist.get_global_rank``). The all-to-alls are PyTorch's differentiable functional
collective (``torch.distributed.nn.functional.all_to_all_single``, used before, is deprecated in its
favour).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup


def seq_to_head(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, nh, T/sp, hs) sequence shard -> (B, nh/sp, T, hs) head shard, tokens in global order.

    Rank r receives heads [r*nh/sp, (r+1)*nh/sp) of every rank's tokens; rank j's tokens (the
    contiguous chunk j of the sequence) land at [j*T/sp, (j+1)*T/sp). Differentiable: the backward
    is the inverse all-to-all.

    Raises:
        ValueError: ``nh`` is not divisible by ``sp``.
    """
    sp = dist.get_world_size(group)
    B, nh, T_loc, hs = x.shape
    _check_heads(nh, sp)
    # (B, nh, T/sp, hs) -> (B, sp, nh/sp, T/sp, hs) -> (sp, B, nh/sp, T/sp, hs): slice j goes to rank j
    send = x.reshape(B, sp, nh // sp, T_loc, hs).transpose(0, 1).contiguous()
    # (sp, B, nh/sp, T/sp, hs): slice j came from rank j, i.e. holds sequence chunk j of our heads
    recv = _all_to_all(send, group)
    # (sp, B, nh/sp, T/sp, hs) -> (B, nh/sp, sp, T/sp, hs) -> (B, nh/sp, T, hs)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, nh // sp, sp * T_loc, hs)


def head_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, nh/sp, T, hs) head shard -> (B, nh, T/sp, hs) sequence shard: the inverse of :func:`seq_to_head`."""
    sp = dist.get_world_size(group)
    B, nh_loc, T, hs = x.shape
    if T % sp:
        raise ValueError(f"head_to_seq: sequence length T = {T} is not divisible by sp = {sp}")
    # (B, nh/sp, T, hs) -> (B, nh/sp, sp, T/sp, hs) -> (sp, B, nh/sp, T/sp, hs): chunk j goes to rank j
    send = x.reshape(B, nh_loc, sp, T // sp, hs).permute(2, 0, 1, 3, 4).contiguous()
    # (sp, B, nh/sp, T/sp, hs): slice j came from rank j, i.e. holds head group j of our tokens
    recv = _all_to_all(send, group)
    # (sp, B, nh/sp, T/sp, hs) -> (B, sp, nh/sp, T/sp, hs) -> (B, nh, T/sp, hs)
    return recv.transpose(0, 1).reshape(B, sp * nh_loc, T // sp, hs)


def _all_to_all(send: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Slice j of ``send`` (dim 0, ``sp`` equal slices) to rank j of ``group``; slice j of the result came
    from rank j. Differentiable (the backward is the reverse all-to-all); waits for the result, so a plain
    tensor is returned."""
    recv = funcol.all_to_all_single(send, None, None, group or dist.group.WORLD)
    return recv.wait() if isinstance(recv, funcol.AsyncCollectiveTensor) else recv


def _check_heads(nh: int, sp: int) -> None:
    if nh % sp:
        raise ValueError(f"Ulysses sequence parallelism splits heads across the sp ranks: nh = {nh} heads "
                         f"is not divisible by sp = {sp}; use a head count that is a multiple of sp, "
                         f"or ring attention")


def ring_pass(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Send ``x`` to the next rank of ``group``; return what the previous rank sent (same shape).

    Group rank i receives group rank i-1's tensor (rank 0 receives the last rank's); the send and the
    receive are posted together (``batch_isend_irecv``), so the ring cannot deadlock. Not autograd-aware:
    ring attention's backward runs its own ring (:class:`meshtrain.parallel.sequence.RingAttention`).
    Every rank of the group must call it, in the same order. With a group of one rank it returns ``x``.
    """
    group = group if group is not None else dist.group.WORLD
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    if sp == 1:
        return x
    dst = dist.get_global_rank(group, (rank + 1) % sp)  # P2POp takes global ranks
    src = dist.get_global_rank(group, (rank - 1) % sp)
    send, recv = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv
