"""Dropout randomness under tensor parallelism (meshtrain.parallel.rng).

- the per-tp-rank stream neither disturbs nor is disturbed by the default stream;
- with tp = 2 and dropout, activations replicated across the tp group stay identical on both ranks
  (the default stream is seeded without the tp coordinate), which a per-rank seed would break;
- a resumed run with dropout draws exactly the masks of the uninterrupted run;
- LoRA's dropout under tp: the same mask on every tp rank where a column-parallel base's input is whole, independent
  masks where a row-parallel base's input is split.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import free_port, losses, train_here
from meshtrain.parallel.rng import TPRegionRNG, seed_step


def test_tp_region_stream_is_separate_from_the_default_stream():
    rng = TPRegionRNG(torch.device("cpu"))
    drop = nn.Dropout(0.5)
    rng.attach(drop)
    rng.seed(5)
    torch.manual_seed(1)
    mask = drop(torch.ones(64)) > 0
    after = torch.rand(3)  # the default stream, as if the hooked module had drawn nothing
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(3))
    torch.manual_seed(5)
    assert torch.equal(mask, nn.functional.dropout(torch.ones(64), 0.5) > 0)  # drawn from the tp stream


@contextlib.contextmanager
def _tp2(rank: int, port: int):
    """A 2-rank gloo group on loopback with its tp = 2 mesh (the ``ParallelDims``), torn down on exit after a barrier
    (no rank leaves gloo while its peer is still in a collective: SIGABRT otherwise)."""
    from meshtrain.mesh import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        dims = ParallelDims(pp=1, dp=1, sp=1, tp=2, world_size=2)
        dims.build_mesh("cpu")
        yield dims
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _worker(rank: int, port: int, out_dir: str, per_rank_seed: bool) -> None:
    from meshtrain.config.sections import ParallelConfig
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.gpt.model import GPT
    from meshtrain.parallel.compose import parallelize_model

    with _tp2(rank, port) as dims:
        torch.manual_seed(0)
        model = parallelize_model(GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=0.3), 11),
                            dims, ParallelConfig(tp=2))
        seen = []
        model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
        seed_step(model, 7, 1, rank, 1 if per_rank_seed else 2)  # tp=1 here gives every rank its own seed
        model(torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(3)))
        both = [torch.empty_like(seen[0]) for _ in range(2)]
        dist.all_gather(both, seen[0])
        torch.save(both, Path(out_dir) / f"rank{rank}.pt")


CASES = {"shared-seed": (False, False), "per-rank-seed": (False, True), "lora": (True, False),
         "lora-seqpar": (True, True)}
"""The 2-rank cases, name -> (a LoRA model?, per-rank seed or tp sequence parallelism): all in one spawn
(:func:`spawned`), each in a process group of its own."""


def _every_case(rank: int, ports: list[int], out_dir: str) -> None:
    for (name, (lora, flag)), port in zip(CASES.items(), ports):
        folder = Path(out_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        (_lora_worker if lora else _worker)(rank, port, str(folder), flag)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """A folder holding each case of :data:`CASES` (``NAME/rank0.pt``), from one spawn of 2 processes: a spawn
    costs both processes torch's import (seconds), the cases themselves milliseconds."""
    root = tmp_path_factory.mktemp("rng")
    ports: set[int] = set()
    while len(ports) < len(CASES):  # a port for each case's group: none reuses one an earlier group just closed
        ports.add(free_port())
    mp.spawn(_every_case, args=(sorted(ports), str(root)), nprocs=2)
    return root


def test_replicated_activations_get_the_same_mask_on_every_tp_rank(spawned):
    a, b = torch.load(spawned / "shared-seed" / "rank0.pt")
    assert torch.equal(a, b)  # the residual stream entering the final norm, on tp ranks 0 and 1


def test_a_per_rank_seed_would_desynchronise_the_tp_replicas(spawned):
    """The check above can fail: seeding the default stream per rank makes the replicas differ."""
    a, b = torch.load(spawned / "per-rank-seed" / "rank0.pt")
    assert not torch.equal(a, b)


def test_resume_with_dropout_draws_the_same_masks(tmp_path):
    run = {"model.dropout": "0.2", "batch.micro_batch_size": "4", "checkpoint.interval": "3", "train.steps": "6"}
    full = losses(train_here(tmp_path / "full", **run))
    resumed = losses(train_here(tmp_path / "resumed", **run,
                                **{"checkpoint.resume": str(tmp_path / "full" / "checkpoints" / "step_000003")}))
    assert resumed == {s: full[s] for s in range(4, 7)}  # bit-exact: same process, same masks


def _lora_worker(rank: int, port: int, out_dir: str, sequence_parallel: bool) -> None:
    from meshtrain.adapters.apply import adapt
    from meshtrain.config.sections import AdapterConfig, ParallelConfig
    from meshtrain.models.llama.model import Llama
    from meshtrain.models.registry import ModelConfig
    from meshtrain.parallel.compose import parallelize_model
    from torch.distributed.tensor import DTensor

    with _tp2(rank, port) as dims:
        cfg = ModelConfig(type="llama", n_layer=1, n_head=2, n_kv_head=2, n_embd=16, block_size=8, multiple_of=16)
        adapter = AdapterConfig(lora_rank=2, lora_dropout=0.5, lora_targets=["all-linear"])
        torch.manual_seed(0)
        model = parallelize_model(Llama(cfg, 11), dims, ParallelConfig(tp=2, tp_sequence_parallel=sequence_parallel),
                                  adapt=lambda part: adapt(part, adapter, cfg))
        masks = {}

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        for name, module in model.named_modules():
            if name.endswith("lora_dropout"):
                module.register_forward_hook(lambda m, args, out, n=name: masks.__setitem__(
                    n, ((local(out) == 0) & (local(args[0]) != 0)).flatten()))
        model.train()
        seed_step(model, 7, 1, rank, 2)
        model(torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(3)))
        gathered = {}
        for name in sorted(masks):
            both = [torch.empty_like(masks[name]) for _ in range(2)]
            dist.all_gather(both, masks[name])
            gathered[name] = both
        torch.save(gathered, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_lora_dropout_under_tp_follows_its_base(spawned, sequence_parallel):
    """Column-parallel bases (q, k, v, gate, up): their input is whole on both tp ranks (all-gathered from sequence
    shards with sequence parallelism), so both draw one mask, as one process would. Row-parallel bases (proj,
    down): each rank holds half of the input's features, and draws its half of the mask independently (the same
    stream on both would give both halves the same pattern). Every mask drops about half (0.5 +- 0.2: >= 32
    entries each)."""
    masks = torch.load(spawned / ("lora-seqpar" if sequence_parallel else "lora") / "rank0.pt")
    row_parallel = ("attn.proj.lora_dropout", "mlp.down.lora_dropout")
    assert len(masks) == 7  # all-linear: q, k, v, proj, gate, up, down
    for name, (a, b) in masks.items():
        assert a.numel() >= 32 and 0.3 < float(a.float().mean()) < 0.7, name
        assert torch.equal(a, b) != name.endswith(row_parallel), name
