"""``meshtrain plan --calibrate``: measure this machine and save a hardware profile (TOML).

Measured, per process, while ``ranks`` processes (one per core, one thread each, as torchrun runs them)
work at the same time:

- GEMM, attention and element-wise rates, and the host time per operator (:func:`measure_compute`);
- gloo collectives between the processes, every one that dp, tp and sp issue (:data:`COLLECTIVES`:
  all-reduce, all-gather, reduce-scatter, all-to-all, p2p and ring attention's send-recv), each the
  median of several calls after a barrier at a few sizes, fitted to ``t = alpha*steps + bytes*factor/B``
  with the ring factors of :func:`cost.ring_time`; the cost model charges each kind at its own rate;
- host time that kernels cannot hide: per layer and per micro-step of the trainer's GPT, per parameter
  tensor of the optimizer step, plain and FSDP2-sharded, per FSDP2 unit collective and per DDP
  gradient bucket (both measured with real compute beside them, which gloo's thread competes with);
- runtime memory: peak RSS of a rank after importing the trainer's modules (:data:`TRAINER_MODULES`,
  not ``meshtrain.train`` itself), joining the process group and
  training a tiny GPT for a few steps (the fixed ``framework_overhead_bytes``), and the RSS the
  trainer's corpus loading adds per character of text.

One process using all cores is measured too (``cpu-<n>threads``, for a single-rank run). torch is
imported only here, so ``meshtrain plan`` itself stays fast.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from meshtrain.planner.hardware import DEFAULT_PROFILE, HOST_KEYS

GEMM_SIZES = (32, 64, 128, 256, 384, 512, 768, 1024)
ATTENTION_LENGTHS = (32, 64, 128, 256, 512, 1024)
COLLECTIVE_BYTES = (4 * 2**10, 256 * 2**10, 2**20, 8 * 2**20, 32 * 2**20)
COLLECTIVE_REPEATS = 9
HOST_REPEATS = 25
"""Calls per point of the host-time measurements (a difference of two timings of ms-long steps), and of
collectives of up to :data:`SMALL_COLLECTIVE_BYTES` (their latency): with 9, three calibrations on one 2-core
VM gave 0.19-1.45 ms for the gloo all-reduce's latency per ring step and 0-13 ms for tp's host time per layer."""
SMALL_COLLECTIVE_BYTES = 2**20
PASSES = 3
"""Full passes over the compute measurements; each number is their median (see measure_compute_passes)."""
SLOW_POINT_S = 0.25
"""A GEMM or attention point slower than this per call ends its table: the larger sizes get its rate.
Rates are flat by then (the kernel is compute-bound), and on a CPU without bf16 instructions the
largest bf16 points take seconds per call (~25 min of calibration instead of ~2)."""


def _timed(fn, min_time: float, repeats: int | None = None, sync=None) -> float:
    """Seconds of one call of ``fn``: the median over as many calls as last ``min_time`` (at least 3),
    or, for collectives (every rank must make the same number of calls), over ``repeats`` calls, each
    after ``sync()`` (a barrier). In training every collective follows compute that ends at different
    times on different ranks, so it pays the wait and the wake-up of the ranks as well as the wire; a
    barrier before each call reproduces that, and the median keeps it (the fastest call would hide it:
    on this 2-core VM the median is 1.3-1.7x the fastest for 1-32 MiB all-reduces, and 6x for 4 KiB)."""
    if repeats:
        return _timed_alternating([fn], repeats, sync)[0]
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 3:
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed_alternating(fns: list, repeats: int, sync=None) -> list[float]:
    """Seconds of one call of each of ``fns``: the median over ``repeats`` calls, the functions called in
    turn (A B C A B C ...), each after ``sync()``, so that a machine that slows down or speeds up during the
    measurement shifts them all alike (their differences are what the host terms are made of)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure_compute_passes(min_time: float, gemm_sizes: tuple[int, ...], attention_lengths: tuple[int, ...],
                           passes: int = PASSES, sync=None, agree=None) -> dict:
    """:func:`measure_compute` ``passes`` times, one full pass after another, and the median of every
    number over the passes: a shared or virtual machine slows down for seconds at a time, and
    spreading each point over the whole calibration keeps one slow moment from setting it."""
    runs = [measure_compute(min_time, gemm_sizes, attention_lengths, sync, agree) for _ in range(passes)]
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):  # tables: {dtype: [[size, rate], ...]}
            out[key] = {dtype: [[size, statistics.median(r[key][dtype][i][1] for r in runs)]
                                for i, (size, _) in enumerate(rows)] for dtype, rows in value.items()}
        else:
            out[key] = statistics.median(r[key] for r in runs)
    return out


def _autocast(dtype_name: str):
    from meshtrain.runtime.device import autocast

    return autocast(dtype_name, "cpu")


def measure_compute(min_time: float = 0.05, gemm_sizes: tuple[int, ...] = GEMM_SIZES,
                    attention_lengths: tuple[int, ...] = ATTENTION_LENGTHS, sync=None, agree=None) -> dict:
    """This process's rates, measured the way the trainer runs (fp32 weights, bf16 under autocast;
    ``sync``, e.g. ``dist.barrier``, is called before each point so that all ranks run the same kernel
    at the same time and share the caches and memory bandwidth as in training):

    - ``matmul_table``: FLOP/s of a Linear ``(1024 x k) -> (1024 x 4k)`` forward + backward (6*M*K*N FLOPs);
    - ``attention_table``: FLOP/s of the trainer's causal attention
      (:func:`meshtrain.models.attention.causal_attention`: the fp32 kernel for bf16 on the CPU) forward +
      backward, batch 8 x 4 heads x head size 32, by sequence length T (6*T^2*d FLOPs per head: causal half);
    - ``bandwidth``: bytes/s of LayerNorm + residual add on (1024 x 256) and GELU on (1024 x 1024),
      forward + backward, counted as the cost model counts element-wise work: 3 x the forward bytes;
    and the host times of :func:`measure_host`. A point slower than :data:`SLOW_POINT_S` per call ends
    its table (larger sizes get its rate); ``agree(flag) -> bool`` makes that decision the same on
    every rank (e.g. any rank's flag), since each point starts with ``sync``.
    """
    import torch
    import torch.nn.functional as F

    from meshtrain.models.attention import causal_attention

    sync = sync or (lambda: None)
    agree = agree or bool

    def train_step(fn, *leaves):
        sync()

        def run():
            for leaf in leaves:
                leaf.grad = None
            fn().sum().backward()
        return run

    matmul, attention = {}, {}
    for name in ("float32", "bfloat16"):
        def gemm(k: int) -> float:
            x, w = torch.randn(1024, k, requires_grad=True), torch.randn(4 * k, k, requires_grad=True)
            with _autocast(name):
                return _timed(train_step(lambda: F.linear(x, w), x, w), min_time)

        def sdpa(T: int) -> float:  # q, k, v in the dtype the projections hand over under autocast
            q, k_, v = (torch.randn(8, 4, T, 32, dtype=getattr(torch, name), requires_grad=True) for _ in range(3))
            with _autocast(name):
                return _timed(train_step(lambda: causal_attention(q, k_, v), q, k_, v), min_time)

        matmul[name] = _rate_table(gemm_sizes, gemm, lambda k: 6.0 * 1024 * k * 4 * k, agree)
        attention[name] = _rate_table(attention_lengths, sdpa, lambda T: 6.0 * T * T * 32 * 8 * 4, agree)
    x, h = torch.randn(1024, 256, requires_grad=True), torch.randn(1024, 1024, requires_grad=True)
    seconds = _timed(train_step(lambda: (F.layer_norm(x, (256,)) + x).sum() + F.gelu(h).sum(), x, h), min_time)
    forward_bytes = (2 + 3 + 8) * 1024 * 256 * 4  # norm read+write, add 2 reads + write, GELU on 4x the width
    return {"matmul_table": matmul, "attention_table": attention, "bandwidth": 3 * forward_bytes / seconds,
            **measure_host(min_time, sync)}


def _rate_table(sizes: tuple[int, ...], seconds_of, flops_of, agree) -> list[list[float]]:
    """``[[size, FLOP/s], ...]``; once a point takes over :data:`SLOW_POINT_S` (on any rank, by ``agree``),
    the larger sizes get its rate without being run."""
    rows: list[list[float]] = []
    saturated = False
    for size in sizes:
        if saturated:
            rows.append([size, rows[-1][1]])
            continue
        seconds = seconds_of(size)
        rows.append([size, flops_of(size) / seconds])
        saturated = agree(seconds > SLOW_POINT_S)
    return rows


def _tiny_model(n_layer: int, width: int = 8):
    """The trainer's GPT at a tiny width (or, without it, a stand-in of the same structure)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    try:
        from meshtrain.models.registry import ModelConfig
        from meshtrain.models.gpt.model import GPT
        return GPT(ModelConfig(n_layer=n_layer, n_head=1, n_embd=width, block_size=8), 65)
    except ImportError:
        blocks = [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                  for _ in range(n_layer)]
        return nn.Sequential(nn.Embedding(65, width), *blocks, nn.Linear(width, 65))


def measure_host(min_time: float = 0.05, sync=None) -> dict:
    """Host seconds that kernels cannot hide, from runs whose arithmetic is negligible:

    - ``layer_host_s`` and ``microstep_host_s``: forward + backward of the trainer's GPT at width 8 with
      1 and 5 layers (per layer = the difference / 4, per micro-step = the rest);
    - ``tensor_update_host_s``: gradient-norm clipping + AdamW step over 32 tiny tensors, per tensor.
    """
    import torch
    import torch.nn.functional as F

    sync = sync or (lambda: None)

    def micro_step(n_layer: int) -> float:
        model = _tiny_model(n_layer)
        x = torch.randint(0, 65, (1, 8))
        sync()
        return _timed(lambda: F.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward(), min_time)

    one, five = micro_step(1), micro_step(5)
    layer = max(0.0, (five - one) / 4)
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(32)]
    for p in params:
        p.grad = torch.randn(8, 8)
    sync()
    return {"layer_host_s": layer, "microstep_host_s": max(0.0, one - layer),
            "tensor_update_host_s": _update_time(params, min_time) / len(params)}


def _update_time(params: list, min_time: float) -> float:
    """Seconds of one gradient-norm clip + AdamW step over ``params`` (their gradients already set), with
    the kernels the trainer picks for them (:func:`meshtrain.optim.adamw_kernels`)."""
    import torch

    from meshtrain.config.sections import OptimConfig
    from meshtrain.optim.build import adamw_kernels

    optimizer = torch.optim.AdamW(params, **adamw_kernels(params, OptimConfig()))

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    return _timed(update, min_time)


def _fit(sizes: list[float], times: list[float], factor: float, steps: float) -> tuple[float, float]:
    """``t = steps*alpha + factor*S/B`` -> (B bytes/s, alpha s): alpha from the smallest message, B from
    the largest (a least-squares line lets the large sizes swamp the latency)."""
    alpha = times[0] / max(steps, 1)
    transfer = max(times[-1] - steps * alpha, 1e-9)
    return factor * sizes[-1] / transfer, alpha


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p", "send-recv")
"""What the trainer's axes issue: dp all-reduce (DDP) or all-gather + reduce-scatter (FSDP2); tp
all-reduce, or all-gather + reduce-scatter with ``tp_sequence_parallel``; sp all-to-all (Ulysses) or
send-recv (ring attention's ``ring_pass``: every rank sends to the next and receives from the previous
at once); p2p is one send between two ranks (pipeline stages)."""


def _collective_call(kind: str, rank: int, world: int, n: int):
    """A zero-argument call running one ``kind`` collective on ``n`` fp32 elements (the full buffer),
    with the single-tensor APIs FSDP2 and DTensor use (``all_gather_single``, ``reduce_scatter_single``),
    and for send-recv the batched isend/irecv of the trainer's ``ring_pass``."""
    import torch
    import torch.distributed as dist

    full, shard = torch.ones(n), torch.ones(n // world)
    if kind == "all-reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all-gather":
        return lambda: dist.all_gather_single(full, shard)
    if kind == "reduce-scatter":
        return lambda: dist.reduce_scatter_single(shard, full)
    if kind == "all-to-all":
        out = torch.empty(n)
        return lambda: dist.all_to_all_single(out, full)
    if kind == "send-recv":
        received = torch.empty(n)
        return lambda: send_recv(full, received, rank, world)
    return lambda: (dist.send(full, 1) if rank == 0 else dist.recv(full, 0)) if rank < 2 else None


def send_recv(send, received, rank: int, world: int) -> None:
    """Send ``send`` to rank ``rank+1`` and receive ``received`` from ``rank-1`` (mod ``world``) at once,
    batched, as the trainer's ``ring_pass`` does every step of ring attention."""
    import torch.distributed as dist

    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _collectives(rank: int, world: int, sizes: tuple[int, ...]) -> dict:
    """(bandwidth bytes/s, latency s per ring step) of each collective, fitted with the ring factors."""
    import torch.distributed as dist

    out = {}
    for kind in COLLECTIVES:
        times = []
        for nbytes in sizes:
            fn = _collective_call(kind, rank, world, nbytes // 4 // world * world)
            repeats = HOST_REPEATS if nbytes <= SMALL_COLLECTIVE_BYTES else COLLECTIVE_REPEATS
            times.append(_timed(fn, 0.0, repeats=repeats, sync=dist.barrier))
        factor = {"all-reduce": 2 * (world - 1) / world, "p2p": 1.0, "send-recv": 1.0}.get(kind, (world - 1) / world)
        steps = {"all-reduce": 2 * (world - 1), "p2p": 1, "send-recv": 1}.get(kind, world - 1)
        out[kind] = _fit([float(s) for s in sizes], times, factor, steps)
    return out


def _tiny_training_step() -> None:
    """Train a tiny GPT for a few steps: the first use of the CPU kernels, autograd and AdamW allocates
    runtime memory that every training process carries."""
    import torch
    import torch.nn.functional as F

    model = _tiny_model(1, width=32)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 65, (4, 8))
    for _ in range(3):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _block_stack(units: int, width: int):
    """``units`` blocks shaped like a transformer block's parameters (two norms, four matrices), run one
    after another; held in ``blocks`` as the trainer's models hold theirs (for FSDP2's units)."""
    import torch
    from torch import nn

    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(width, bias=False), nn.Linear(width, 3 * width, bias=False),
                             nn.Linear(3 * width, width, bias=False), nn.LayerNorm(width, bias=False),
                             nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict({str(i): block() for i in range(units)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks.values():
                x = b(x)
            return x

    torch.manual_seed(0)
    return Stack()


def _dp_host(world: int, comm: dict, units: int = 8, width: int = 64, tokens: int = 768) -> dict:
    """Data-parallel costs beyond the wire, from forward + backward of :func:`_block_stack` on ``tokens``
    rows (real compute, so the measurement includes gloo's thread taking the core from it), plain and
    wrapped timed in turn, minus the modeled ring time of the wrapper's collectives:

    - DDP -> ``ddp_bucket_overhead_s`` per gradient bucket (DDP's buckets: 1 MiB first, then 25 MiB);
    - FSDP2 as the trainer wraps it at zero_stage 3 with one block per unit
      (:func:`meshtrain.parallel.data_parallel.apply_dp`, ``fsdp_unit_mb = 0``): a gather before each block's
      forward and, but for the last block's, before its backward, and a reduce-scatter, ``3 * units - 1``
      collectives -> ``fsdp_unit_overhead_s`` per unit collective; and the clip + AdamW step over the
      sharded parameters -> ``sharded_tensor_update_host_s`` per parameter tensor.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from meshtrain.parallel.data_parallel import apply_dp
    from meshtrain.planner.cost import ring_time
    from meshtrain.planner.layout import FRAMEWORKS

    x = torch.randn(tokens, width)
    plain = _block_stack(units, width)
    ddp = DDP(_block_stack(units, width))
    sharded = apply_dp(_block_stack(units, width), init_device_mesh("cpu", (world,)), zero_stage=3, unit_mb=0.0)
    base, ddp_time, sharded_time = _timed_alternating(
        [lambda m=m: m(x).sum().backward() for m in (plain, ddp, sharded)], HOST_REPEATS, sync=dist.barrier)

    grads = 4.0 * sum(p.numel() for p in plain.parameters())
    buckets = FRAMEWORKS["meshtrain"].grad_buckets(grads)
    wire = buckets * ring_time("all-reduce", world, grads / buckets, *comm["all-reduce"])
    ddp_extra = ddp_time - base - wire

    unit_bytes = 4 * (14 * width * width + 2 * width)
    gathers = 2 * units - 1
    wire = (gathers * ring_time("all-gather", world, unit_bytes, *comm["all-gather"])
            + units * ring_time("reduce-scatter", world, unit_bytes, *comm["reduce-scatter"]))
    fsdp_extra = sharded_time - base - wire
    params = list(sharded.parameters())
    return {"ddp_bucket_overhead_s": max(0.0, ddp_extra / buckets),
            "fsdp_unit_overhead_s": max(0.0, fsdp_extra / (gathers + units)),
            "sharded_tensor_update_host_s": _update_time(params, 0.0) / len(params)}


PARALLEL_HOST = {  # profile key: the trainer's parallel config on the calibration's ranks
    "tp_layer_host_s": {"tp": "world"},
    "tp_seqpar_layer_host_s": {"tp": "world", "tp_sequence_parallel": True},
    "ulysses_layer_host_s": {"sp": "world", "sp_mode": "ulysses"},
    "ring_layer_host_s": {"sp": "world", "sp_mode": "ring"},
}


def _parallel_host(world: int, comm: dict) -> dict:
    """Host seconds per layer and micro-step that tp and sp add beyond their collectives' modeled ring
    time: the trainer's GPT at width 4*world (``n_head = world``, 16 tokens, so the arithmetic is
    negligible) parallelized by :func:`meshtrain.parallel.compose.parallelize_model` over all ranks, forward +
    backward at 1 and 5 layers; per layer = the difference / 4, minus the plain model's per layer,
    minus :func:`~meshtrain.planner.cost.layer_collectives` at the measured gloo rates. This is
    DTensor's dispatch of every sharded operator, the autograd functions of Ulysses and ring attention,
    and the collectives' host work; 0 when it cannot be told from noise."""
    import torch
    import torch.distributed as dist

    from meshtrain.config.sections import Config, ParallelConfig
    from meshtrain.models.registry import ModelConfig
    from meshtrain.mesh import Axis, ParallelDims
    from meshtrain.models.gpt.model import GPT
    from meshtrain.parallel.compose import local_batch, parallelize_model
    from meshtrain.parallel.reduce import backward_context, cross_entropy
    from meshtrain.parallel.rng import seed_step
    from meshtrain.planner.cost import layer_collectives, ring_time
    from meshtrain.planner.layout import Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    def steps(parallel: ParallelConfig) -> list:
        """Forward + backward of the model at 1 and at 5 layers, parallelized by ``parallel``."""
        out = []
        for n_layer in (1, 5):
            dims = ParallelDims(pp=1, dp=world // (parallel.sp * parallel.tp), sp=parallel.sp, tp=parallel.tp,
                                world_size=world)
            dims.build_mesh("cpu")
            torch.manual_seed(0)
            model = GPT(ModelConfig(n_layer=n_layer, n_head=world, n_embd=4 * world, block_size=16), 65)
            model = parallelize_model(model, dims, parallel)
            seed_step(model, 0, 1, dist.get_rank(), parallel.tp)
            x = torch.randint(0, 65, (1, 16), generator=torch.Generator().manual_seed(0))
            x, y, pos, _ = local_batch(x, x, dims, dims.rank_of(Axis.SP), parallel.sp_mode)

            def step(model=model, x=x, y=y, pos=pos) -> None:
                loss = cross_entropy(model(x, pos), y)
                with backward_context(loss):
                    loss.backward()
            out.append(step)
        return out

    configs = {"plain": ParallelConfig(dp=world),  # DDP over the ranks: no collective inside a layer
               **{key: ParallelConfig(**{k: world if v == "world" else v for k, v in spec.items()})
                  for key, spec in PARALLEL_HOST.items()}}
    fns = [fn for parallel in configs.values() for fn in steps(parallel)]
    times = _timed_alternating(fns, HOST_REPEATS, sync=dist.barrier)
    per_layer = {key: (times[2 * i + 1] - times[2 * i]) / 4 for i, key in enumerate(configs)}
    plain = per_layer["plain"]
    out = {}
    for key in PARALLEL_HOST:
        parallel = configs[key]
        cfg = Config(model=ModelConfig(n_layer=1, n_head=world, n_embd=4 * world, block_size=16), parallel=parallel)
        cfg.batch.micro_batch_size = 1
        wire = sum(c.count * ring_time(c.kind, c.ranks, c.nbytes, *comm[c.kind])
                   for c in layer_collectives(from_config(cfg, 65), Layout.from_config(cfg, world), PRECISIONS["fp32"]))
        out[key] = max(0.0, per_layer[key] - plain - wire)
    return out


def _pipeline_host(world: int, comm: dict) -> dict:
    """Host seconds per pipeline action: the trainer's GPT at width 8 (one block per stage, 16 tokens per
    micro-batch, so the arithmetic is negligible) split over all ranks by
    :func:`meshtrain.parallel.compose.parallelize_pipeline` and run by 1F1B with 2 and 10 micro-batches; the
    step grows by one forward and one backward per stage per micro-batch, so per action = (t10 - t2) / 8
    / 2, minus half the plain block's forward + backward and the modeled p2p of its activation (0 when it
    cannot be told from noise)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshtrain.config.sections import ParallelConfig
    from meshtrain.models.registry import ModelConfig
    from meshtrain.mesh import ParallelDims
    from meshtrain.models.gpt.model import GPT
    from meshtrain.parallel.compose import parallelize_pipeline
    from meshtrain.planner.cost import ring_time

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def pipeline_step(m: int):
        dims = ParallelDims(pp=world, dp=1, sp=1, tp=1, world_size=world)
        dims.build_mesh("cpu")
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=world, n_head=2, n_embd=8, block_size=16), 65)
        pipe = parallelize_pipeline(model, dims, ParallelConfig(pp=world, dp=1), m, 16 * m, loss_fn)
        x = torch.randint(0, 65, (m, 16), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(16)
        return lambda: pipe.step(x, x, pos)

    torch.manual_seed(0)
    block = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=8, block_size=16), 65).blocks["0"]
    h = torch.randn(1, 16, 8, requires_grad=True)
    plain = _timed(lambda: block(h).sum().backward(), 0.0, repeats=HOST_REPEATS)
    wire = 2 * ring_time("p2p", 2, 16 * 8 * 4, *comm["p2p"])  # the (1, 16, 8) fp32 activation and its gradient
    two, ten = _timed_alternating([pipeline_step(2), pipeline_step(10)], HOST_REPEATS, sync=dist.barrier)
    per_micro_batch = (ten - two) / 8
    return {"pipeline_action_host_s": max(0.0, (per_micro_batch - plain - wire) / 2),
            "split_backward_factor": _split_backward_factor()}


def _split_backward_factor() -> float:
    """(input-gradient pass + weight-gradient pass) / one fused backward, for a GPT block at width 128 with
    6 x 64 tokens (the main config's micro-batch): what the zero-bubble schedules' I and W cost together
    against 1F1B's B, timed with torch's own ``stage_backward_input`` and ``stage_backward_weight``."""
    import torch

    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.gpt.model import GPT

    torch.manual_seed(0)
    block = GPT(ModelConfig(n_layer=1, n_head=4, n_embd=128, block_size=64), 65).blocks["0"]
    params = list(block.parameters())
    h = torch.randn(6, 64, 128, requires_grad=True)
    grad = torch.randn(6, 64, 128)

    def fused() -> None:
        torch.autograd.backward(block(h), grad)

    def split() -> None:  # what torch's zero-bubble stages run: I, then W from the saved intermediates
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        _, groups = stage_backward_input([block(h)], [grad], [h], iter(params))
        stage_backward_weight(iter(params), groups)

    forward, one, two = _timed_alternating([lambda: block(h), fused, split], HOST_REPEATS)
    one, two = one - forward, two - forward
    return max(1.0, two / one) if one > 0 else 1.0


TRAINER_MODULES = ("meshtrain.checkpoint.store", "meshtrain.config.load", "meshtrain.data.corpus",
                   "meshtrain.data.sampler", "meshtrain.fileio", "meshtrain.preflight", "meshtrain.mesh",
                   "meshtrain.metrics", "meshtrain.models.build", "meshtrain.models.gpt.model", "meshtrain.optim",
                   "meshtrain.parallel.compose", "meshtrain.parallel.data_parallel", "meshtrain.parallel.reduce",
                   "meshtrain.parallel.pipeline.schedule", "meshtrain.parallel.rng",
                   "meshtrain.runtime.device", "meshtrain.runtime.distributed", "meshtrain.runtime.faults",
                   "torch.optim.lr_scheduler")
"""What ``meshtrain.train`` imports (the planner never imports the trainer: docs/architecture.md, "Layers"):
loaded, they hold the same modules and RSS as the trainer's imports (764 of its 767 modules beyond torch,
the rest ``statistics``; 268 MiB peak either way, measured on this 2-core VM)."""


def _import_trainer_modules() -> None:
    """Import :data:`TRAINER_MODULES`, so that the runtime overhead counts what a rank has loaded
    (a module missing from an older tree is skipped). By name, not by import statements: the planner measures what the
    trainer loads without depending on it (no edge from the planner into the run in the import graph)."""
    import importlib

    for name in TRAINER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _worker(rank: int, world: int, store_path: str, min_time: float, sizes: dict, queue) -> None:
    """One calibration rank: 1 thread, trainer imports, gloo group, measurements; rank 0 reports."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _import_trainer_modules()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    _tiny_training_step()
    w = torch.ones(4)
    dist.all_reduce(w)
    overhead = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    per_char = _corpus_bytes_per_char()  # before the big measurement tensors raise the peak
    def any_rank(flag: bool) -> bool:
        value = torch.tensor([float(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    compute = measure_compute_passes(min_time, sizes["gemm"], sizes["attention"], sizes["passes"], dist.barrier,
                                     any_rank)
    comm = _collectives(rank, world, sizes["collective"])
    dp_host = {**_dp_host(world, comm), **_parallel_host(world, comm), **_pipeline_host(world, comm)}
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"compute": compute, "comm": comm, "overhead": overhead, "per_char": per_char, "dp_host": dp_host})


def _corpus_bytes_per_char() -> float:
    """Peak-RSS growth per character while the trainer loads the bundled corpus (0 if unavailable)."""
    try:
        from meshtrain.config.sections import BUNDLED_CORPUS
        from meshtrain.data.corpus import load_corpus
    except ImportError:
        return 0.0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    corpus = load_corpus(BUNDLED_CORPUS, 0.1, 8)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    return grown / (len(corpus.train) + len(corpus.val))


def _total_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_toml(name: str, compute: dict, memory: float, overhead: float, dp_host: dict) -> list[str]:
    peak32 = max(f for _, f in compute["matmul_table"]["float32"])
    peak16 = max(f for _, f in compute["matmul_table"]["bfloat16"])
    lines = ["[[device]]", f'name = "{name}"', f"peak_fp32_flops = {peak32:.6g}", f"peak_bf16_flops = {peak16:.6g}",
             f"memory_bytes = {memory:.6g}", f"memory_bandwidth = {compute['bandwidth']:.6g}",
             "matmul_efficiency = 1.0", "memory_efficiency = 1.0", f"framework_overhead_bytes = {overhead:.6g}",
             "comm_overlap = false", 'peak_source = "measured matmul"']
    lines += [f"{key} = {value:.6g}" for key, value in {**dp_host, **{k: compute[k] for k in HOST_KEYS if k in compute}}.items()]
    for key in ("matmul_table", "attention_table"):
        for dtype, rows in compute[key].items():
            lines.append(f"{key}.{dtype} = [{', '.join(f'[{k}, {f:.6g}]' for k, f in rows)}]")
    return lines + [""]


def _wait(queue, procs) -> dict:
    """Rank 0's result; raises RuntimeError as soon as a calibration process dies without one."""
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a calibration process failed; see its output above") from None


def busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over the next ``seconds``, from ``/proc/stat`` (the 1-minute load
    average would still count work that ended a minute ago); 0.0 where ``/proc/stat`` is absent."""
    def sample() -> tuple[int, int]:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except OSError:
            return 0, 0
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def calibrate(path: Path | None = None, ranks: int | None = None, min_time: float = 0.05,
              gemm_sizes: tuple[int, ...] = GEMM_SIZES, attention_lengths: tuple[int, ...] = ATTENTION_LENGTHS,
              collective_bytes: tuple[int, ...] = COLLECTIVE_BYTES, passes: int = PASSES) -> Path:
    """Measure this machine; write the profile to ``path`` (default :data:`DEFAULT_PROFILE`); return it.

    ``ranks`` processes (default: one per core, at least 2) measure at once; ``min_time`` seconds per
    compute measurement; ``gemm_sizes``, ``attention_lengths`` and ``collective_bytes`` (at least two,
    increasing) choose the points measured; every compute number is the median of ``passes`` passes.

    Raises:
        RuntimeError: a calibration process failed.
    """
    import torch

    path = (path or DEFAULT_PROFILE).expanduser()
    ranks = ranks or max(2, os.cpu_count() or 2)
    busy = busy_fraction(1.0)
    if busy > 0.25:
        print(f"warning: {busy:.0%} of the {os.cpu_count()} cores are busy: other work competes with the "
              "measurement and the profile will be too slow; calibrate on an idle machine", file=sys.stderr)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        sizes = {"gemm": gemm_sizes, "attention": attention_lengths, "collective": collective_bytes,
                 "passes": passes}
        procs = [ctx.Process(target=_worker, args=(r, ranks, store, min_time, sizes, queue)) for r in range(ranks)]
        for p in procs:
            p.start()
        result = _wait(queue, procs)
        for p in procs:
            p.join()
    threads = torch.get_num_threads()
    whole = measure_compute_passes(min_time, gemm_sizes, attention_lengths, passes)
    bw, alpha = result["comm"]["all-reduce"]
    memory = _total_memory()
    lines = ["# meshtrain hardware profile, written by `meshtrain plan --calibrate` on "
             f"{time.strftime('%Y-%m-%d %H:%M')}; {ranks} ranks x 1 thread, and 1 rank x {threads} threads.", ""]
    lines += _device_toml("cpu", result["compute"], memory / ranks, result["overhead"], result["dp_host"])
    lines += _device_toml(f"cpu-{threads}threads", whole, memory, result["overhead"], result["dp_host"])
    lines += ["[network]", f"devices_per_node = {ranks}", f"intra_node_bandwidth = {bw:.6g}",
              f"inter_node_bandwidth = {bw:.6g}", f"intra_node_latency_s = {alpha:.6g}",
              f"inter_node_latency_s = {alpha:.6g}", "intra_node_efficiency = 1.0", "inter_node_efficiency = 1.0",
              "# gloo per collective: [bandwidth bytes/s, latency s per ring step]"]
    lines += [f'collectives."{kind}" = [{b:.6g}, {a:.6g}]' for kind, (b, a) in result["comm"].items()]
    lines += ["", "[trainer]", f"corpus_bytes_per_char = {result['per_char']:.6g}", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text("\n".join(lines))
    os.replace(tmp_path, path)
    return path
