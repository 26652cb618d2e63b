"""Hierarchical all-reduce (``parallel.hierarchical_allreduce = true``): DDP's gradient all-reduce done
in three steps, so that each gradient crosses the network between nodes once per node instead of once
per rank.

1. reduce inside each node to its leader (the node's first rank of the dp group);
2. all-reduce between the leaders, one per node;
3. broadcast from each leader to the ranks of its node.

This is the two-level scheme of Jia et al. 2018 ("Highly Scalable Deep Learning Training System with
Mixed-Precision", arXiv:1807.11205, Sec. 3.3, hierarchical all-reduce) and of Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``. Bytes that cross node boundaries per all-reduce of S bytes, with L
nodes and N ranks in the group, ranks ordered by node (:func:`inter_node_bytes`): a flat ring
crosses L links, each carrying ``2(N-1)/N * S``; the leaders' ring carries ``2(L-1)/L * S`` on each
of its L links. Takeaway: it pays off when the nodes' link is the bottleneck and shared by the node's
ranks (one NIC per node); with one NIC per GPU a flat ring already uses them all.

It is a DDP communication hook (``DistributedDataParallel.register_comm_hook``) on sub-groups built
from the mesh: the dp group (dp x sp, the ranks averaging a gradient) split by node. A rank's node is
torchrun's ``GROUP_RANK`` (the agent that started it), exchanged once with ``all_gather_object``.
"""

import os  # no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from meshtrain.runtime.distributed import collective_timeout


def inter_node_bytes(nbytes: float, ranks: int, nodes: int, hierarchical: bool) -> float:
    """Bytes crossing node boundaries for one ring all-reduce of ``nbytes`` over ``ranks`` ranks spread
    evenly, in order, over ``nodes`` nodes: ``2L(N-1)/N * S`` flat, ``2(L-1) * S`` hierarchical
    (Patarasuk & Yuan 2009: a ring all-reduce sends ``2(n-1)/n * S`` over each of its n links)."""
    if nodes <= 1:
        return 0.0
    if hierarchical:
        return 2 * (nodes - 1) * nbytes
    return 2 * nodes * (ranks - 1) / ranks * nbytes


def node_ids() -> list[int]:
    """Node index of every global rank (torchrun's ``GROUP_RANK``; 0 without torchrun). Collective."""
    ids: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(ids, int(os.environ.get("GROUP_RANK", "0")))
    return ids


def split_by_node(groups: list[list[int]], node_of: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node groups, leader groups) of every group of ``groups`` (lists of global ranks): each group
    split into its ranks on each node, and the first rank on each node (its leader) of each group."""
    intra, leaders = [], []
    for group in groups:
        by_node: dict[int, list[int]] = {}
        for rank in group:
            by_node.setdefault(node_of[rank], []).append(rank)
        intra += list(by_node.values())
        leaders.append([ranks[0] for ranks in by_node.values()])
    return intra, leaders


@dataclass
class HierarchicalState:
    """This rank's sub-groups: its node's ranks of its dp group, and (on a leader) the leaders' group."""

    intra: dist.ProcessGroup
    leader: int
    """Global rank of this node's leader."""
    inter: dist.ProcessGroup | None
    """The leaders' group on a leader, None elsewhere."""
    world: int
    """Ranks of the whole dp group (the gradient is divided by it, as DDP's own all-reduce)."""
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "hierarchical-allreduce"))
    """One thread that runs every bucket's three steps in bucket order: collectives of one group must be
    issued in the same order on every rank, and backward goes on meanwhile (overlap, as DDP's own)."""


def hierarchical_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean of ``bucket`` over the dp group by reduce -> all-reduce -> broadcast,
    run on the state's thread; DDP waits for the returned future at the end of backward."""
    grad = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def run() -> None:
        try:
            grad.div_(state.world)
            dist.reduce(grad, dst=state.leader, group=state.intra)
            if state.inter is not None:
                dist.all_reduce(grad, group=state.inter)
            dist.broadcast(grad, src=state.leader, group=state.intra)
            future.set_result(grad)
        except Exception as e:  # surfaces in backward, where DDP waits for the future
            future.set_exception(e)

    state.executor.submit(run)
    return future


def hierarchical_state(groups: list[list[int]]) -> HierarchicalState:
    """Build the sub-groups for every dp group of the mesh (``groups``: global ranks of each); every
    rank calls this (group creation is collective). Returns this rank's state."""
    intra_lists, leader_lists = split_by_node(groups, node_ids())
    intra, _ = dist.new_subgroups_by_enumeration(intra_lists, timeout=collective_timeout())
    spanning = [ranks for ranks in leader_lists if len(ranks) > 1]  # the same on every rank
    inter = dist.new_subgroups_by_enumeration(spanning, timeout=collective_timeout())[0] if spanning else None  # None off the leaders
    rank = dist.get_rank()
    mine = next(ranks for ranks in intra_lists if rank in ranks)
    group = next(g for g in groups if rank in g)
    return HierarchicalState(intra=intra, leader=mine[0], inter=inter, world=len(group))


def apply_hierarchical_allreduce(models: list[DDP], groups: list[list[int]]) -> HierarchicalState:
    """Register :func:`hierarchical_hook` on each DDP module (one per local pipeline chunk)."""
    state = hierarchical_state(groups)
    for model in models:
        model.register_comm_hook(state, hierarchical_hook)
    return state
