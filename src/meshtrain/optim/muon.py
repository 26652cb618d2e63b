"""Muon on the blocks' matrices and AdamW on the rest, for plain and sharded (DTensor) parameters.

The update of a matrix W with gradient G (Jordan et al. 2024; ``torch.optim.Muon``'s form)::

    buf <- m buf + (1 - m) G                       momentum (an exponential average)
    U   <- (1 - m) G + m buf   (Nesterov)  or buf
    O   <- NS_k(U)                                 k quintic Newton-Schulz steps: ~ the orthogonal factor of U
    W   <- (1 - lr wd) W - lr * ratio(A, B) * O    decoupled weight decay; ratio: meshtrain.optim.table.muon_lr_ratio

Newton-Schulz needs the whole (A, B) matrix, while FSDP2 and tensor parallelism hold shards of it. With
``exchange = "owner"`` each matrix whose two matrix dimensions are sharded is orthogonalized on one rank, its
*owner*, among those that hold its shards (owners dealt out by Newton-Schulz FLOPs, largest first, to the least
loaded rank): one ``all_to_all_single`` sends every shard of U to its matrix's owner, the owners assemble and
orthogonalize their matrices, and a second ``all_to_all_single`` returns each rank its shard of O. Each rank sends
and receives its shards once (the traffic of one reduce-scatter and one all-gather), and the Newton-Schulz FLOPs
are split across the ranks, not repeated. ``exchange = "gather"`` is the naive way: every rank all-gathers every
matrix and orthogonalizes all of them. A 3-D stack of experts' matrices is sharded by experts under ep and FSDP2
(dim 0): its local experts are whole, orthogonalized where they are, one batched Newton-Schulz per stack. Plain
parameters (one process, DDP, pp) are whole on every rank that holds them; under DDP every rank orthogonalizes
them all (no communication), and ``parallel.zero_stage = 1`` deals them out as it deals out the states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshtrain.optim.table import NS_COEFFICIENTS, muon_lr_ratio, newton_schulz_flops

NS_EPS = 1e-7
"""Floor of the Frobenius norm Newton-Schulz divides by (``torch.optim.Muon``'s ``eps``)."""
BUCKET_BYTES = 256 * 2**20
"""Whole matrices (counted at 4 bytes an element) orthogonalized per owner exchange: the step's temporaries (the
updates, the pieces sent and received, the assembled matrices) are those of one bucket, about ``BUCKET_BYTES / n``
per rank of n sharing a matrix, not of every Muon parameter at once; a larger matrix is a bucket of its own."""


def newton_schulz(u: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``steps`` quintic Newton-Schulz iterations on each matrix of ``u`` (A, B), or (E, A, B) for a stack: X is U
    divided by its Frobenius norm (so its spectral norm is <= 1), transposed to be wide, then
    ``X <- a X + (b S + c S^2) X`` with ``S = X X^T`` and (a, b, c) of :data:`NS_COEFFICIENTS`; returns X in
    ``dtype``, of ``u``'s shape, its singular values near 1 (Jordan et al. 2024: in about (0.7, 1.2), not exactly
    1). In ``dtype`` throughout, as ``torch.optim.Muon`` computes it in bfloat16."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = u.size(-2) > u.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=NS_EPS)
        mm = torch.addmm
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        mm = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def shard_indices(p: DTensor, coordinate: list[int]) -> list[Tensor]:
    """Per tensor dimension, the global indices of the rows/columns the rank at mesh ``coordinate`` holds of ``p``:
    its local shard is ``full[i0][:, i1]...``. Shards are applied mesh dimension by mesh dimension, left to right,
    as DTensor applies them (a ``_StridedShard`` first, then the ``Shard`` it was split for: FSDP2 over tp)."""
    lists = [torch.arange(n) for n in p.shape]
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, _StridedShard):
            on_1d = _StridedShard(0, split_factor=placement.split_factor)
        elif isinstance(placement, Shard):
            on_1d = Shard(0)
        else:
            continue
        chunks, _ = on_1d._split_tensor(lists[placement.dim], p.device_mesh.size(mesh_dim), with_padding=False)
        lists[placement.dim] = chunks[coordinate[mesh_dim]]
    return lists


def _take(full: Tensor, lists: list[Tensor]) -> Tensor:
    """The sub-tensor of ``full`` at the outer product of ``lists`` (one index list per dimension)."""
    for dim, index in enumerate(lists):
        full = full.index_select(dim, index)
    return full


def _put(full: Tensor, lists: list[Tensor], piece: Tensor, dim: int = 0) -> None:
    """Write ``piece`` into ``full`` at the outer product of ``lists`` (the inverse of :func:`_take`)."""
    if dim == len(lists) - 1:
        full.index_copy_(dim, lists[dim], piece)
        return
    sub = full.index_select(dim, lists[dim])
    _put(sub, lists, piece, dim + 1)
    full.index_copy_(dim, lists[dim], sub)


def _matrix_sharded(p: Tensor) -> bool:
    """Whether a parameter is a DTensor whose matrix dimensions (the last two) are split across ranks: then no rank
    holds a whole matrix of it."""
    if not isinstance(p, DTensor):
        return False
    return any(isinstance(q, (Shard, _StridedShard)) and q.dim % p.dim() >= p.dim() - 2 for q in p.placements)


@dataclass(eq=False)
class _Sharded:
    """A matrix orthogonalized by the owner exchange: ``ranks`` hold its shards, ``owner`` orthogonalizes it;
    ``lists[rank]``: that rank's :func:`shard_indices` (every holder's on the owner, its own elsewhere)."""

    param: DTensor
    ranks: tuple[int, ...]
    owner: int
    lists: dict[int, list[Tensor]]

    def size_on(self, rank: int) -> int:
        return _size(self.lists[rank])


def _size(lists: list[Tensor]) -> int:
    n = 1
    for index in lists:
        n *= len(index)
    return n


def _plan(params: list[DTensor], me: int, steps: int) -> list[_Sharded]:
    """Owners of the matrix-sharded ``params``, in one order every rank agrees on (by the ranks that hold a
    parameter, then its place among them): per group of ranks, matrices by Newton-Schulz FLOPs, largest first, each
    to the least loaded rank (ties to the lowest)."""
    groups: dict[tuple[int, ...], list[DTensor]] = {}
    for p in params:
        groups.setdefault(tuple(p.device_mesh.mesh.flatten().tolist()), []).append(p)
    planned = []
    for ranks in sorted(groups):
        load = dict.fromkeys(ranks, 0.0)
        members = groups[ranks]
        owners = {}
        for i in sorted(range(len(members)), key=lambda i: -newton_schulz_flops(tuple(members[i].shape), steps)):
            owners[i] = min(ranks, key=lambda r: (load[r], r))
            load[owners[i]] += newton_schulz_flops(tuple(members[i].shape), steps)
        for i, p in enumerate(members):
            mesh = p.device_mesh.mesh
            holders = ranks if owners[i] == me else (me,)
            lists = {r: shard_indices(p, [int(c) for c in (mesh == r).nonzero()[0]]) for r in holders}
            planned.append(_Sharded(p, ranks, owners[i], lists))
    return planned


class Muon(torch.optim.AdamW):
    """Muon on the parameter groups marked ``muon = True`` (2-D matrices and 3-D stacks of experts' matrices), and
    torch's own AdamW on the others (their ``lr``, ``betas``, ``weight_decay``, kernels): one optimizer, so the
    learning-rate schedule, ZeRO-1's ``ZeroRedundancyOptimizer`` and DCP's state dicts take it as they take AdamW.

    Muon's state per parameter is ``momentum_buffer`` (of the parameter's shape and placements) and, as AdamW's,
    ``step`` (a scalar: the steps taken). Keys of a Muon
    group: ``momentum``, ``nesterov``, ``ns_steps``, ``ns_dtype`` ("bfloat16" or "float32"), ``lr_adjust``
    (:func:`meshtrain.optim.table.muon_lr_ratio`), ``exchange`` ("owner" or "gather", module docstring).

    Raises ValueError for a Muon parameter that is not 2-D or 3-D."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: str = "bfloat16",
                 lr_adjust: str = "match_rms_adamw", exchange: str = "owner", muon: bool = True, **adamw) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, **adamw)
        for group in self.param_groups:
            for key, value in (("momentum", momentum), ("nesterov", nesterov), ("ns_steps", ns_steps),
                               ("ns_dtype", ns_dtype), ("lr_adjust", lr_adjust), ("exchange", exchange),
                               ("muon", muon)):
                group.setdefault(key, value)
            if group["muon"] and any(p.dim() not in (2, 3) for p in group["params"]):
                raise ValueError("Muon takes 2-D matrices and 3-D stacks of them only: "
                                 f"got shapes {[tuple(p.shape) for p in group['params'] if p.dim() not in (2, 3)]}")
        self._plans: dict[tuple[int, ...], list[list[_Sharded]]] = {}
        """The owner exchange's plan per set of matrix-sharded parameters (:func:`_plan`) in buckets (:func:`_buckets`),
        made at the first step."""

    @torch.no_grad()
    def step(self, closure=None):
        """One step: AdamW on the AdamW groups (torch's kernels), then Muon on the Muon groups."""
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            loss = super().step(closure)
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        """Momentum for every parameter, then each update orthogonalized and applied: whole matrices one at a time,
        matrix-sharded ones by the exchange, bucket by bucket (:data:`BUCKET_BYTES`), so that the step's temporaries
        are one bucket's, not one per parameter."""
        m, steps = group["momentum"], group["ns_steps"]
        dtype = getattr(torch, group["ns_dtype"])
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] = torch.tensor(0.0)  # AdamW's (its __setstate__ reads a step in every state)
            state["step"] += 1
            _local(state["momentum_buffer"]).lerp_(_local(p.grad), 1 - m)

        def update(p: Tensor) -> Tensor:  # U: the Nesterov look-ahead, or the buffer itself
            g, buf = _local(p.grad), _local(self.state[p]["momentum_buffer"])
            return g.lerp(buf, m) if group["nesterov"] else buf

        sharded = [p for p in params if _matrix_sharded(p)]
        for p in params:
            if not _matrix_sharded(p):
                self._apply(group, p, newton_schulz(update(p), steps, dtype))
        if group["exchange"] == "owner":
            self._owner_exchange(group, sharded, update, dtype)
        else:
            for p in sharded:
                self._apply(group, p, self._gathered(p, update(p), steps, dtype))

    @staticmethod
    def _apply(group: dict, p: Tensor, o: Tensor) -> None:
        """Decoupled decay, then the step ``-lr * ratio * O`` on this rank's part of ``p`` (``o`` its part of O)."""
        w, lr = _local(p), group["lr"]
        w.mul_(1 - lr * group["weight_decay"])
        w.add_(o, alpha=-lr * muon_lr_ratio(group["lr_adjust"], tuple(p.shape)))

    @staticmethod
    def _gathered(p: DTensor, update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
        """The naive way: every rank all-gathers the whole update, orthogonalizes it and keeps its shard."""
        whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        return _take(newton_schulz(whole, steps, dtype), shard_indices(p, p.device_mesh.get_coordinate()))

    def _owner_exchange(self, group: dict, sharded: list[DTensor], update, dtype: torch.dtype) -> None:
        """Orthogonalize the matrix-sharded parameters on their owners and apply the results (module docstring):
        per bucket of the plan, two ``all_to_all_single`` over the world group, in the Newton-Schulz dtype (its
        first operation casts to it anyway). Every rank runs as many buckets (the most any rank has: an empty one
        sends nothing), so the collectives pair up across pipeline stages."""
        if not sharded:  # a layout without matrix shards (every rank alike): nothing to exchange
            return
        me = dist.get_rank()
        key = tuple(id(p) for p in sharded)
        if key not in self._plans:
            plan = _plan(sharded, me, group["ns_steps"])
            count = torch.tensor(float(len(_buckets(plan))))
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # once: every rank the same number of exchanges
            self._plans[key] = _buckets(plan) + [[]] * (int(count) - len(_buckets(plan)))
        for bucket in self._plans[key]:
            for p, o in self._exchange(bucket, update, group["ns_steps"], dtype).items():
                self._apply(group, p, o)

    @staticmethod
    def _exchange(plan: list[_Sharded], update, steps: int, dtype: torch.dtype) -> dict[Tensor, Tensor]:
        """One bucket's exchange: {parameter: this rank's part of its orthogonalized update}."""
        me, world = dist.get_rank(), dist.get_world_size()
        send = [[update(s.param).to(dtype).reshape(-1) for s in plan if s.owner == d] for d in range(world)]
        received = _all_to_all(send, [[s.size_on(r) for s in plan if s.owner == me and r in s.ranks]
                                      for r in range(world)], dtype)
        whole = {}
        for s in (s for s in plan if s.owner == me):
            whole[s] = torch.empty(s.param.shape, dtype=dtype)
            for r in s.ranks:
                _put(whole[s], s.lists[r], received[r].pop(0).view([len(i) for i in s.lists[r]]))
            whole[s] = newton_schulz(whole[s], steps, dtype)
        back = [[_take(whole[s], s.lists[r]).reshape(-1) for s in plan if s.owner == me and r in s.ranks]
                for r in range(world)]
        mine = _all_to_all(back, [[s.size_on(me) for s in plan if s.owner == d] for d in range(world)], dtype)
        return {s.param: mine[s.owner].pop(0).view([len(i) for i in s.lists[me]]) for s in plan}


def _buckets(plan: list[_Sharded]) -> list[list[_Sharded]]:
    """``plan`` cut, in order, into buckets of whole matrices of at most :data:`BUCKET_BYTES` together in fp32 terms
    (one larger matrix makes a bucket of its own); the same cuts on every rank that shares a plan."""
    buckets: list[list[_Sharded]] = [[]]
    held = 0
    for s in plan:
        size = 4 * s.param.numel()
        if buckets[-1] and held + size > BUCKET_BYTES:
            buckets.append([])
            held = 0
        buckets[-1].append(s)
        held += size
    return buckets if plan else []


def _all_to_all(send: list[list[Tensor]], sizes: list[list[int]], dtype: torch.dtype) -> list[list[Tensor]]:
    """Send ``send[d]`` (tensors, flattened) to rank ``d``; receive from each rank ``r`` tensors of ``sizes[r]``
    elements; one ``all_to_all_single`` over the world group."""
    world = len(send)
    flat = torch.cat([t for pieces in send for t in pieces]) if any(send) else torch.empty(0, dtype=dtype)
    out = torch.empty(sum(map(sum, sizes)), dtype=dtype)
    dist.all_to_all_single(out, flat, [sum(sizes[r]) for r in range(world)],
                           [sum(t.numel() for t in send[d]) for d in range(world)])
    pieces, at = [], 0
    for r in range(world):
        pieces.append([])
        for n in sizes[r]:
            pieces[-1].append(out[at:at + n])
            at += n
    return pieces
