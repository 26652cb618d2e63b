"""Sequence-parallel attention computes what one process computes (outputs and input gradients).

One gloo launch per world size (2 and 4, CPU) runs every multi-rank check; each rank saves its
(got, want) tensors to ``tmp_path`` and the assertions run here. World size 4 also runs sp = 2 on
the interleaved groups {0, 2} and {1, 3}, where group ranks differ from global ranks, and on the contiguous
groups {0, 1} and {2, 3}, as a 2-rank launch would; that launch itself (sp = 2 on the default group) is in
``make test-slow`` (a spawn costs every rank torch's import: seconds; the checks milliseconds). Validation
tests need no process group.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from conftest import free_port
from meshtrain.parallel.sequence import (RingAttention, UlyssesAttention, apply_sp, sequence_positions,
                                         shard_sequence)
from meshtrain.parallel.sequence.comm import head_to_seq, ring_pass, seq_to_head

B, NH, HS = 2, 4, 8
SEQ_LEN = {2: 16, 4: 32}  # per world size; divisible by 2*sp
MODULES = {"ulysses": UlyssesAttention, "ring": RingAttention}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        groups = {f"sp{world}": dist.group.WORLD if world == 2 else dist.new_group(list(range(world)))}
        if world == 4:
            groups["sp2"], _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
            groups["sp2-contiguous"], _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        results = {name: _checks(group, SEQ_LEN[world]) for name, group in groups.items()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    except BaseException:  # kept for the test process: the peers of a failed rank only see a closed connection
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _checks(group, T: int) -> dict:
    """Every multi-rank check on one sp group: name -> (got, want) or raw values."""
    sp, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)  # the same full tensors on every rank
    x = torch.randn(B, NH, T, HS, dtype=torch.float64)
    heads = seq_to_head(shard_sequence(x, 2, r, sp, "ulysses"), group)  # (B, NH/sp, T, HS)
    res = {"sp": sp, "rank": r,
           "seq_to_head": (heads, x[:, r * NH // sp:(r + 1) * NH // sp]),
           "round_trip": (head_to_seq(heads, group), shard_sequence(x, 2, r, sp, "ulysses"))}
    res["ring_pass"] = ring_pass(torch.full((3,), float(r), dtype=torch.float64), group)
    q, k, v, dout = (torch.randn(B, NH, T, HS, dtype=torch.float64) for _ in range(4))
    q, k, v = (a.requires_grad_() for a in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the single-process reference
    ref.backward(dout)
    ref = ref.detach()
    for mode, cls in MODULES.items():
        shard = lambda a, m=mode: shard_sequence(a.detach(), 2, r, sp, m)  # noqa: E731  (B, NH, T/sp, HS)
        qs, ks, vs = (shard(a).requires_grad_() for a in (q, k, v))
        out = cls(group)(qs, ks, vs)
        out.backward(shard(dout))
        res[mode] = {"out": (out.detach(), shard(ref))}
        res[mode].update({f"d{n}": (a.grad, shard(b.grad)) for n, a, b in zip("qkv", (qs, ks, vs), (q, k, v))})
    return res


@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.slow), 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Per global rank: {group name: results of :func:`_checks`}."""
    world, out = request.param, tmp_path_factory.mktemp(f"world{request.param}")
    failure = None
    try:
        mp.start_processes(_worker, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as exc:  # reported below with every rank's traceback
        failure = "\n".join(f"--- {p.stem}:\n{p.read_text()}" for p in sorted(out.glob("rank*.err"))) or str(exc)
    if failure:
        pytest.fail(f"a rank of world size {world} failed:\n{failure}", pytrace=False)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def _each(ranks: list[dict]):
    for global_rank, groups in enumerate(ranks):
        for name, res in groups.items():
            yield f"rank {global_rank}, {name} (group rank {res['rank']})", res


def test_seq_to_head_gives_the_head_slice_of_the_full_sequence(ranks):
    for where, res in _each(ranks):
        got, want = res["seq_to_head"]
        assert torch.equal(got, want), where  # pure data movement: bitwise


def test_head_to_seq_inverts_seq_to_head(ranks):
    for where, res in _each(ranks):
        got, want = res["round_trip"]
        assert torch.equal(got, want), where


def test_ring_pass_receives_from_the_previous_rank(ranks):
    for where, res in _each(ranks):
        sp, r = res["sp"], res["rank"]
        assert res["ring_pass"].tolist() == [float((r - 1) % sp)] * 3, where


@pytest.mark.parametrize("mode", list(MODULES))
def test_attention_matches_single_process_sdpa(ranks, mode):
    # Bound: float64, u = 2**-53. Each output is a softmax-weighted sum of <= T = 32 values after a
    # dot product of hs = 8 terms, exp/log and the online-softmax merges: n <= 64 rounding steps,
    # |err| <= n*u*sum|terms| ~ 7e-15 * (a few * max|ref|) with randn inputs (weights sum to 1). The
    # backward chains three such sums (dP = dO V^T, dS = P*(dP - D), dQ = dS K): <= ~1e-13 * max|ref|.
    # We assert 1e-12 * max|ref| (absolute), one decade above that bound.
    for where, res in _each(ranks):
        for key, (got, want) in res[mode].items():
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * want.abs().max().item(),
                                       msg=lambda m, k=key, w=where: f"{mode} {k}, {w}: {m}")


def test_shard_sequence_layouts():
    assert sequence_positions(8, 1, 2, "ulysses").tolist() == [4, 5, 6, 7]
    assert sequence_positions(8, 0, 2, "ring").tolist() == [0, 1, 6, 7]  # chunks 0 and 3 of 4
    assert sequence_positions(8, 1, 2, "ring").tolist() == [2, 3, 4, 5]  # chunks 1 and 2
    x = torch.arange(2 * 16).view(2, 16)  # (B, T)
    for mode in MODULES:
        parts = [shard_sequence(x, 1, r, 4, mode) for r in range(4)]  # 4 x (B, T/4)
        pos = torch.cat([sequence_positions(16, r, 4, mode) for r in range(4)])
        assert torch.equal(torch.cat(parts, 1), x[:, pos]), mode
        assert sorted(pos.tolist()) == list(range(16)), mode


def test_shard_sequence_rejects_indivisible_length():
    with pytest.raises(ValueError, match="length 12 .* not divisible by 8"):
        shard_sequence(torch.zeros(2, 12), 1, 0, 4, "ring")  # 2*sp = 8 chunks
    with pytest.raises(ValueError, match="length 10 .* not divisible by 4"):
        sequence_positions(10, 0, 4, "ulysses")
    with pytest.raises(ValueError, match="mode = 'stripe'"):
        shard_sequence(torch.zeros(8), 0, 0, 2, "stripe")
    with pytest.raises(ValueError, match="sp_rank = 2"):
        shard_sequence(torch.zeros(8), 0, 2, 2, "ulysses")


def test_ulysses_rejects_heads_not_divisible_by_sp():
    group = SimpleNamespace(size=lambda: 4)  # only its size is read before the check raises
    q = torch.zeros(B, 6, 4, HS)
    with pytest.raises(ValueError, match="nh = 6 .* sp = 4"):
        UlyssesAttention(group)(q, q, q)


def test_ring_attention_rejects_odd_local_length():
    q = torch.zeros(B, NH, 3, HS)
    with pytest.raises(ValueError, match="local length 3 must be even"):
        RingAttention(None)(q, q, q)  # raises before the group is used


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner_attention = SimpleNamespace(dropout=0.1)  # stands in for SDPA with attention dropout


def test_apply_sp_swaps_every_inner_attention():
    mesh = SimpleNamespace(get_group=lambda: "sp-group")  # apply_sp only asks the mesh for its group
    for mode, cls in MODULES.items():
        model = nn.ModuleDict({"0": _Attn(), "1": nn.Sequential(_Attn())})
        apply_sp(model, mesh, mode)
        swapped = [model["0"].inner_attention, model["1"][0].inner_attention]
        assert all(type(m) is cls and m.group == "sp-group" for m in swapped), mode
        assert mode == "ring" or all(m.dropout == 0.1 for m in swapped)
    with pytest.raises(ValueError, match="mode = 'stripe'"):
        apply_sp(nn.Module(), mesh, "stripe")
