"""Reductions by mesh axis, each in one place (docs/architecture.md, "Layers").

- the loss: cross-entropy summed over this rank's supervised tokens (on vocab-sharded logits under tp) and
  divided by the count of supervised tokens of the whole global batch (every micro-batch, every ``"dp_sp"``
  rank, every pipeline micro-batch), never a mean of per-micro-batch or per-rank means (:func:`loss_scale`);
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

from meshtrain.cross_entropy import DEFAULT_CHUNK_MB, IGNORE_INDEX, token_nll
from meshtrain.mesh import BATCH_MESH, WORKER_MESH, ParallelDims



def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, inside_loss_parallel: bool = False,
                  reduction: str = "mean", chunk_mb: float = DEFAULT_CHUNK_MB) -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) against targets (B, T) over this rank's tokens whose target is not
    :data:`IGNORE_INDEX`: their mean (``reduction = "mean"``; NaN when there is none) or their sum (``"sum"``;
    0 when there is none).

    Logits that are a ``DTensor`` sharded on V (tensor parallelism) go through PyTorch's
    ``loss_parallel``: each rank computes the softmax terms of its vocabulary slice and only (B, T)
    scalars are all-reduced (Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, Sec. 3).
    Call ``backward`` on the result inside :func:`backward_context`. ``inside_loss_parallel``: the caller
    already entered ``loss_parallel`` (entering it again would end it on exit: it does not nest).

    Plain logits go through :func:`meshtrain.cross_entropy.token_nll` in chunks of ``chunk_mb`` fp32 MiB
    (``train.loss_chunk_mb``), which never holds them all in fp32; ``chunk_mb = 0``: ``F.cross_entropy`` on the
    fp32 logits at once.
    """
    if chunk_mb > 0 and not isinstance(logits, DTensor):
        nll = token_nll(logits, targets, chunk_mb)  # (B*T,), 0 where ignored
        summed = nll.sum()
        return summed if reduction == "sum" else summed / supervised_count(targets)
    with contextlib.nullcontext() if inside_loss_parallel else backward_context(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)


def supervised_count(targets: torch.Tensor) -> torch.Tensor:
    """Tokens of ``targets`` (any shape) that are in the loss: an int64 scalar."""
    return (targets != IGNORE_INDEX).sum()


def loss_scale(local_count: int, micro_batches: int, dims: ParallelDims, masked: bool = True) -> tuple[float, int]:
    """``(scale, N)``: what one micro-batch's summed cross-entropy on this rank is multiplied by, and N, the
    supervised tokens of the whole global batch (this worker's, under DiLoCo).

    ``local_count``: the supervised targets of this rank's ``micro_batches`` micro-batches, whole windows (every sp
    rank of a group holds the same ones). Every gradient path (DDP's and FSDP2's average over the ``"dp_sp"`` ranks,
    the pipeline schedule's over its ``micro_batches``, the loop's ``loss / micro_batches``) divides by
    ``dp * sp * micro_batches``; so a loss of ``sum * dp * sp * micro_batches / N`` per micro-batch gives every
    layout the gradient of ``sum over the global batch / N``, one process's on the whole batch at once. The
    classic bug this avoids: a mean per micro-batch (or per rank) weighs a token of a micro-batch with few
    supervised tokens more (transformers' gradient accumulation until 4.46, "num_items_in_batch").

    N is known before the backward: from the masks, with one all-reduce over the batch mesh; ``masked = False``
    (every target supervised, as in pretraining: every rank holds equally many) skips it. N = 0 (nothing
    supervised in the whole batch) gives scale 0: no loss, no gradient."""
    if not masked:
        total = local_count * (dims.batch_degree // dims.sp)
    elif dims.batch_degree > 1:
        count = torch.tensor(local_count, dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dims.get_mesh(BATCH_MESH).get_group())
        total = int(count) // dims.sp  # each sp rank counted its group's whole windows
    else:
        total = local_count
    return (dims.batch_degree * micro_batches / total if total else 0.0), total


def row_logps(logits: torch.Tensor, targets: torch.Tensor, sp_group: dist.ProcessGroup | None = None,
              inside_loss_parallel: bool = False, chunk_mb: float = DEFAULT_CHUNK_MB) -> torch.Tensor:
    """Each row's log-probability of its supervised targets: logits (B, T', V) (vocab-sharded under tp), targets
    (B, T') of this rank's sequence shard -> (B,) float32 nats, summed over the sp group's shards of each row.

    The sum over ``sp_group`` is differentiable (``torch.distributed.nn.functional.all_reduce``): its backward sums
    the gradients of the sp ranks, so each rank's tokens get sp times the gradient of a loss every rank computes
    alike; :func:`pair_scale` divides it out. Under tp, compute the loss from it and run its backward inside
    ``loss_parallel`` (:func:`backward_context` of the logits). ``chunk_mb``: as :func:`cross_entropy`."""
    if chunk_mb > 0 and not isinstance(logits, DTensor):
        nll = token_nll(logits, targets, chunk_mb)  # (B*T',), 0 where ignored
    else:
        with contextlib.nullcontext() if inside_loss_parallel else backward_context(logits):
            nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                  reduction="none")  # (B*T',), 0 where ignored
    rows = -local_value(nll).view(targets.shape).sum(dim=1)  # (B,)
    if sp_group is not None:
        from torch.distributed.nn.functional import all_reduce

        rows = all_reduce(rows, group=sp_group)
    return rows


def row_counts(targets: torch.Tensor, sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Each row's supervised targets: targets (B, T') of this rank's sequence shard -> (B,) float32, summed over the
    sp group's shards of each row (no gradient)."""
    counts = (targets != IGNORE_INDEX).sum(dim=1).float()  # (B,)
    if sp_group is not None:
        dist.all_reduce(counts, group=sp_group)
    return counts


def pair_scale(local_pairs: int, micro_batches: int, dims: ParallelDims) -> tuple[float, int]:
    """``(scale, P)``: what the summed DPO loss of one micro-batch's pairs on this rank is multiplied by, and P, the
    pairs of the whole global batch. As :func:`loss_scale`, with the pair as the unit: every gradient path divides
    by ``dp * sp * micro_batches`` and the sp sum of :func:`row_logps` multiplies by sp, so ``dp * micro_batches /
    P`` gives every layout the gradient of the mean DPO loss over the global batch's pairs. ``local_pairs``: the
    pairs of this rank's micro-batches (each sp rank of a group holds the same)."""
    dp = dims.batch_degree // dims.sp
    total = local_pairs * dp  # every dp rank holds micro_batch_size pairs per micro-batch
    return dp * micro_batches / total, total


def batch_sum(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Sum of a per-rank tensor over the pipeline (stages without it pass zeros) and the ``"dp_sp"`` ranks:
    a float64 CPU tensor of its shape."""
    value = local_value(value).detach().to("cpu", torch.float64).clone()
    if dims.pp > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.get_mesh("pp").get_group())
    if dims.batch_degree > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.get_mesh(BATCH_MESH).get_group())
    return value


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
