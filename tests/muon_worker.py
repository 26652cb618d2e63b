"""Muon on sharded matrices equals Muon on whole ones: ``torchrun --nproc-per-node 4 tests/muon_worker.py OUT.json``.

Every rank builds the same matrices (2-D of even and uneven sizes, a 3-D stack of experts' matrices) and the same
gradients for 3 steps, then steps :class:`meshtrain.optim.muon.Muon` on them (a) whole, in this process, and (b)
sharded as each layout shards them: FSDP2 over 4 ranks and over 2 (dim-0 shards, uneven ones included), tp over 2
(column and row shards), FSDP2 x tp on a 2 x 2 mesh (``_StridedShard`` rows), experts sharded by expert (dim 0) and
by matrix rows (dim 1), with each exchange ("owner", "gather") and Newton-Schulz in each precision. Rank 0 writes, per case, the largest difference
between the sharded result (``full_tensor()``) and the whole one, the all-to-all calls counted, and each rank's
Newton-Schulz FLOPs per step.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshtrain.optim import muon
from meshtrain.optim.muon import Muon
from meshtrain.optim.table import newton_schulz_flops

SHAPES = {"up": (40, 24), "down": (24, 40), "odd": (10, 7)}
EXPERTS = (4, 12, 16)
STEPS = 3
NS_DTYPES = ("float32", "bfloat16")
HYPER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "lr_adjust": "match_rms_adamw"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = nn.Linear(*reversed(SHAPES["up"]), bias=False)
        self.down = nn.Linear(*reversed(SHAPES["down"]), bias=False)
        self.odd = nn.Linear(*reversed(SHAPES["odd"]), bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, generator=g))
        for name in SHAPES:
            getattr(self, name).weight.data = torch.randn(SHAPES[name], generator=g)


def gradients() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{**{f"{n}.weight": torch.randn(s, generator=g) for n, s in SHAPES.items()},
             "experts": torch.randn(EXPERTS, generator=g)} for _ in range(STEPS)]


def train(block: nn.Module, exchange: str, ns_dtype: str) -> dict[str, torch.Tensor]:
    """Three Muon steps on ``block`` with :func:`gradients` (sharded as its parameters are); the whole results."""
    named = dict(block.named_parameters())
    optimizer = Muon([{"params": list(named.values())}], exchange=exchange, ns_dtype=ns_dtype, **HYPER)
    for grads in gradients():
        for name, p in named.items():
            full = grads[name]
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if hasattr(
                p, "placements") else full.clone()
        optimizer.step()
    return {n: (p.full_tensor() if hasattr(p, "placements") else p).detach().clone() for n, p in named.items()}


def layouts():
    """name -> a function sharding a fresh :class:`Block` (every rank takes part in each)."""
    mesh2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "odd": ColwiseParallel()}

    def experts(block, mesh, dim):
        block.experts = nn.Parameter(distribute_tensor(block.experts.data, mesh, [Shard(dim)]))
        return block

    return {
        "fsdp2-dp4": lambda b: fully_shard(b, mesh=mesh4),
        "fsdp2-dp2": lambda b: fully_shard(b, mesh=mesh2x2["dp"]),
        "tp2": lambda b: experts(parallelize_module(b, mesh2x2["tp"], tp_plan), mesh2x2["tp"], 0),
        "fsdp2-tp2": lambda b: fully_shard(experts(parallelize_module(b, mesh2x2["tp"], tp_plan), mesh2x2["tp"], 1),
                                           mesh=mesh2x2["dp"]),
        "experts-by-rows": lambda b: experts(b, mesh4, 1),
    }


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    whole = {dtype: train(Block(), "owner", dtype) for dtype in NS_DTYPES}
    calls = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    flops = []
    real_ns = muon.newton_schulz

    def counted_ns(u, steps, dtype=torch.bfloat16):
        flops.append(newton_schulz_flops(tuple(u.shape), steps))
        return real_ns(u, steps, dtype)

    muon.newton_schulz = counted_ns
    out = {}
    for name, shard in layouts().items():
        for exchange in ("owner", "gather"):
            for dtype in NS_DTYPES:
                calls.clear()
                flops.clear()
                got = train(shard(Block()), exchange, dtype)
                diff = max(float((got[k] - whole[dtype][k]).abs().max()) for k in got)
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, sum(flops) / STEPS)
                out[f"{name}/{exchange}/{dtype}"] = {"max_abs_diff": diff, "all_to_all_calls": len(calls),
                                                     "ns_flops_per_rank": per_rank}
    muon.BUCKET_BYTES, bucket = 4096, muon.BUCKET_BYTES  # up, down and odd (3,840, 3,840, 280 bytes): 3 buckets
    calls.clear()
    got = train(layouts()["fsdp2-dp4"](Block()), "owner", "float32")
    out["fsdp2-dp4/owner/float32/buckets"] = {"max_abs_diff": max(float((got[k] - whole["float32"][k]).abs().max())
                                                                  for k in got), "all_to_all_calls": len(calls)}
    muon.BUCKET_BYTES = bucket
    flops.clear()
    train(Block(), "owner", "float32")
    out["whole_ns_flops"] = sum(flops) / STEPS
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
