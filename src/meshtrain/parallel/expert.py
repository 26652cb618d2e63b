"""Expert parallelism: a mixture of experts' experts split across ``ep`` ranks borrowed from ``dp x sp``.

The ``ep`` ranks are ``ep`` consecutive ranks of the batch mesh (:class:`meshtrain.mesh.ParallelDims`, the ``"ep"``
mesh): the attention runs as dp and sp lay it out, and the MoE layers of the same ranks split the experts instead of
replicating them (torchtitan's and Megatron-Core's "parallel folding", Liu et al. 2025, arXiv:2504.14960), so ep
does not multiply the world size. Each stack ``w_gate, w_up, w_down`` (E, ., .) becomes a ``DTensor`` sharded on
dim 0 over ``"ep"``: a rank holds E/ep whole experts (checkpoints reshard across ep like every other ``DTensor``).

A MoE layer's forward (:class:`meshtrain.models.moe.layer.MoE`) routes this rank's tokens and sorts the N*k
(token, expert) rows by expert; :class:`ExpertDispatch` then sends each rank the rows of its experts and brings the
results back (GShard, Lepikhin et al. 2020, arXiv:2006.16668, Sec. 2.2: dispatch and combine as two all-to-alls):

1. ``counts`` (E,) -> all-to-all -> ``received`` (ep, E/ep): the rows each rank will send for each of my experts;
2. the rows, all-to-all with uneven splits (``all_to_all_single_autograd``: its backward is the reverse exchange);
3. the received rows sorted by local expert (stable: by source rank, then the source's order) and run through my
   experts as one grouped GEMM each;
4. the reverse all-to-all; the MoE weighs and sums each token's k results as without ep.

Dropless: every row is sent, so a token's experts, weights and outputs are those of one process (up to the
order of the rows inside a GEMM).

Gradients: an expert's gradient on its rank sums the contributions of the tokens of all ``ep`` ranks, so it is
scaled by 1/ep there (``GroupedExperts.grad_scale``); the ``dp*sp/ep`` ranks that hold the same experts (the
``"edp"`` mesh) then average theirs (:func:`sync_expert_gradients`, or FSDP2's reduce-scatter when the experts are
FSDP2-sharded over ``"edp"``, :func:`meshtrain.parallel.data_parallel.apply_dp`): in all, the sum over the ``dp*sp``
batch ranks divided by ``dp*sp``, the gradient of their mean loss, as the rest of the model's, averaged over
``dp x sp`` as before. (FSDP2's own divide factor would do it in one place, but gloo has no ``PREMUL_SUM``.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of ``model``: modules with a ``dispatch`` slot and an ``experts`` module
    (:class:`meshtrain.models.moe.layer.MoE`)."""
    return [m for m in model.modules() if hasattr(m, "dispatch") and isinstance(getattr(m, "experts", None), nn.Module)]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """Each MoE layer's ``experts`` module (:class:`meshtrain.models.moe.layer.GroupedExperts`) in ``model``."""
    return [m.experts for m in moe_layers(model)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts of ``model`` (built whole, the same on every rank) over the 1-D ``ep_mesh``:
    each stack becomes a ``DTensor`` ``Shard(0)`` (E/ep whole experts here), and the layer dispatches its rows with
    :class:`ExpertDispatch`. Returns ``model``.

    Raises:
        ValueError: a layer's expert count is not divisible by ``ep_mesh.size()`` (config validation refuses it first).
    """
    dispatch = ExpertDispatch(ep_mesh.get_group(), ep_mesh.size())
    for layer in moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] % ep_mesh.size():
                raise ValueError(f"{param.shape[0]} experts cannot be split over ep = {ep_mesh.size()} ranks")
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), ep_mesh, [Shard(0)])))
        experts.grad_scale = 1.0 / ep_mesh.size()
        layer.dispatch = dispatch
    return model


class ExpertDispatch:
    """Send each (token, expert) row to the ``ep`` rank that holds its expert, run the experts there, bring the
    results back (module docstring, steps 1-4). ``group``: the ``"ep"`` mesh's process group of ``size`` ranks."""

    def __init__(self, group: dist.ProcessGroup, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` (M, C) sorted by expert, ``counts`` (E,) rows per expert (all E) -> (M, C) each row's expert
        output, in ``rows``' order."""
        ep = self.size
        local = counts.numel() // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (E,) = (ep sources, local experts)
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()  # rows to each rank
        recv = received.sum(1).tolist()  # rows from each rank
        gathered = all_to_all_single_autograd(rows, recv, send, self.group)  # (sum recv, C), by source rank
        expert_of_row = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep),
                                                received.reshape(-1))  # (sum recv,) local expert of each row
        order = torch.argsort(expert_of_row, stable=True)
        out = experts(gathered[order], received.sum(0))  # (sum recv, C), by local expert
        back = torch.empty_like(out).index_copy_(0, order, out)  # by source rank again
        return all_to_all_single_autograd(back, send, recv, self.group)  # (M, C)


def sync_expert_gradients(experts: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Average each expert gradient over ``group`` (the ``"edp"`` ranks holding the same experts; module docstring),
    in one all-reduce. For experts that FSDP2 does not shard; called once per step, after the last micro-batch's
    backward."""
    grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
             for m in experts for p in m.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
