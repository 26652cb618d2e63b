"""Reductions by mesh axis, each in one place (docs/architecture.md, "Layers").

- the loss: cross-entropy over this rank's tokens (on vocab-sharded logits under tp), then the mean
  over the ``"dp_sp"`` ranks, which hold equally many different tokens of the global batch: the
  mean over every token of the global batch;
- the gradient norm: every distinct parameter shard counted once -- a ``DTensor`` gradient is
  summed over the mesh axes it is sharded on and not over those it is replicated on; a plain
  tensor gradient (replicated everywhere, e.g. after DDP's all-reduce) is counted as it is.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshtrain.mesh import BATCH_MESH, WORKER_MESH, ParallelDims


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, inside_loss_parallel: bool = False) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) over this rank's B*T tokens.

    Logits that are a ``DTensor`` sharded on V (tensor parallelism) go through PyTorch's
    ``loss_parallel``: each rank computes the softmax terms of its vocabulary slice and only (B, T)
    scalars are all-reduced (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, Sec. 3).
    Call ``backward`` on the result inside :func:`backward_context`. ``inside_loss_parallel``: the caller
    already entered ``loss_parallel`` (entering it again would end it on exit: it does not nest).
    """
    with contextlib.nullcontext() if inside_loss_parallel else backward_context(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def backward_context(value: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a loss must be computed and ``backward()``-ed in: ``loss_parallel`` for a DTensor."""
    return loss_parallel() if isinstance(value, DTensor) else contextlib.nullcontext()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``value`` (a replicated DTensor's local copy)."""
    return value.to_local() if isinstance(value, DTensor) else value


def batch_mean(value: torch.Tensor, dims: ParallelDims) -> float:
    """Mean of a per-rank scalar over the ``"dp_sp"`` ranks (gloo has no AVG, so SUM / (dp*sp)); with DiLoCo's
    workers, over this worker's (:func:`worker_mean` then averages over workers).

    With pp > 1 only the last stage has a loss: the other stages pass 0 and the value is first summed
    over the pipeline, so that every rank (the logging one included) gets the last stage's."""
    value = local_value(value).detach().clone().float().cpu()
    if dims.pp > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.get_mesh("pp").get_group())
    if dims.batch_degree > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.get_mesh(BATCH_MESH).get_group())
    return float(value) / dims.batch_degree


def worker_mean(value: float, dims: ParallelDims) -> float:
    """Mean of a per-worker value over DiLoCo's workers (``value`` itself without them)."""
    if dims.workers == 1:
        return value
    group = dims.get_mesh(WORKER_MESH)
    total = torch.tensor(value, dtype=torch.float64, device=group.device_type)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group.get_group())
    return float(total) / dims.workers


def grad_norm(params: Iterable[torch.nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients of ``params``, each distinct shard counted once (fp32 scalar).

    Squares are summed locally per group of gradients that share a mesh and the mesh axes they are
    sharded on, then all-reduced over each of those axes (a sum over axis a, then over axis b, is the
    sum over the a x b ranks). With a ``pp_group`` the stages' sums are added up (each pipeline stage
    holds different parameters; pass each parameter on one stage only). The local sums run as a few
    foreach kernels (``torch.nn.utils.get_total_norm``), not one per gradient: on a GPU the per-gradient
    loop cost a kernel launch per tensor (docs/benchmarks.md).
    """
    local: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    meshes = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"gradient with a pending reduction {g.placements}: call reduce_partial_grads first")
            axes = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())  # Shard, _StridedShard
            key = (id(g.device_mesh), axes)
            meshes[key] = g.device_mesh
            g = g.to_local()
        else:
            key = (None, ())
        local[key].append(g.detach())
    sums = {key: torch.nn.utils.get_total_norm(grads, 2.0).float() ** 2 for key, grads in local.items()}
    norm_sq = 0.0
    for (mesh_id, axes), value in sums.items():
        for axis in axes:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=meshes[(mesh_id, axes)].get_group(axis))
        norm_sq += float(value)
    if pp_group is not None:
        total = torch.tensor(norm_sq, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        norm_sq = float(total)
    return torch.tensor(math.sqrt(norm_sq))


def reduce_partial_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Finish pending sums: a replicated parameter used on sharded activations (a norm weight under
    Megatron sequence parallelism) gets a ``Partial`` gradient, one term per tp rank's tokens; sum it
    into the parameter's own layout (an all-reduce over tp, Korthikanti et al. 2022, Sec. 4.2.2)."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None,
                    uncounted: torch.nn.Parameter | None = None) -> float:
    """Scale all gradients by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``);
    ``max_norm = 0`` disables clipping. Returns the norm before clipping (:func:`grad_norm` over every
    pipeline stage of ``pp_group``, leaving out ``uncounted``: a pipeline's second copy of a tied
    weight), after :func:`reduce_partial_grads`."""
    params = [p for p in params if p.grad is not None]
    reduce_partial_grads(params)
    norm = float(grad_norm([p for p in params if p is not uncounted], pp_group))
    if max_norm > 0 and max_norm / (norm + 1e-6) < 1:
        kinds: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:  # foreach kernels take one kind: plain tensors, or DTensors of one mesh
            kinds[getattr(p.grad, "device_mesh", None)].append(p)
        for same in kinds.values():
            torch.nn.utils.clip_grads_with_norm_(same, max_norm, torch.tensor(norm, dtype=torch.float64))  # x max_norm / (norm + 1e-6)
    return norm
