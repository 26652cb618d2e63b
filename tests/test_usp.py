"""USP, two-dimensional sequence parallelism (``parallel.sp_mode = "usp"``, Fang and Zhao 2024, arXiv:2405.07719):
Ulysses over ``sp_ulysses`` consecutive sp ranks inside, ring attention over the ``sp / sp_ulysses`` across.

1. The token layout: each sp rank's pieces of ring's zigzag chunks, every token held once, its positions.
2. Every layout computes what one process computes (the correctness contract, conftest's tolerances): a
   grouped-query Llama whose 2 kv heads are fewer than sp = 4 = 2 x 2, a GPT at tp2 x sp2, and packed documents
   (:mod:`packing_worker`: each line of the character corpus a document). ``make test`` runs the degenerate
   2-rank split (U = 2, R = 1: the all-to-all, the reorder and a ring of one); the 4-rank ones are in test-slow.
3. What cannot run is refused before launch, in one line.
"""

from __future__ import annotations

import re

import pytest
import torch

import packing_worker
from conftest import TINY, assert_resumed_losses, check_layout
from layout_worker import launch_layouts, load_result, run_in_process
from meshtrain.config.checks import resolve_world
from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError
from meshtrain.parallel.sequence.shard import sequence_positions, shard_sequence, usp_pieces


# --- 1. the token layout -----------------------------------------------------------------------------

@pytest.mark.parametrize("sp, ulysses", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4)])
def test_every_token_is_held_once_in_pieces_of_ring_chunks(sp, ulysses):
    """Rank k = r*U + u holds piece u of ring chunks r and 2R-1-r (pieces of T/(2sp) tokens), positions in the order
    it holds them; the U ranks of ring rank r together hold chunks r and 2R-1-r whole."""
    T, R = 4 * sp, sp // ulysses
    piece, chunk = T // (2 * sp), T // (2 * R)
    held = [sequence_positions(T, k, sp, "usp", ulysses=ulysses) for k in range(sp)]
    assert sorted(torch.cat(held).tolist()) == list(range(T))  # every token once
    for k, positions in enumerate(held):
        r, u = divmod(k, ulysses)
        want = [c * chunk + u * piece + i for c in (r, 2 * R - 1 - r) for i in range(piece)]
        assert positions.tolist() == want, (k, positions.tolist(), want)
    for r in range(R):  # a ring rank's Ulysses group: its two whole zigzag chunks
        group = torch.cat([held[r * ulysses + u] for u in range(ulysses)]).tolist()
        assert sorted(group) == sequence_positions(T, r, R, "ring").sort().values.tolist()
    x = torch.arange(2 * T).view(2, T) * 10  # (B, T): tokens sharded along dim 1 as positions are
    for k in range(sp):
        assert torch.equal(shard_sequence(x, 1, k, sp, "usp", ulysses), x[:, held[k]])


def test_one_ulysses_rank_is_ring_attentions_layout():
    for k in range(4):
        assert torch.equal(sequence_positions(32, k, 4, "usp", ulysses=1), sequence_positions(32, k, 4, "ring"))
    assert usp_pieces(3, 4, 2) == (3, 5)  # ring rank 1, Ulysses rank 1: piece 1 of chunks 1 and 2 (of 4)


@pytest.mark.parametrize("T, ulysses, message", [
    (24, 2, "sequence length 24 (tensor dim 0) is not divisible by 16: mode 'usp' with sp = 8"),
    (32, 3, "sp_ulysses = 3 does not divide sp = 8"),
])
def test_a_layout_that_does_not_cut_is_refused(T, ulysses, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sequence_positions(T, 0, 8, "usp", ulysses=ulysses)


# --- 2. every layout computes what one process computes ----------------------------------------------

BASE = {**TINY, "model.n_head": "4", "train.steps": "3", "batch.micro_batch_size": "8"}
"""Global batch 8 of 32 tokens, 3 steps: step 1's loss and gradients, then steps 2-3 on moved parameters."""
GPT = BASE
LLAMA = {**BASE, "model.type": "llama", "model.n_kv_head": "2", "model.multiple_of": "16"}
"""Grouped-query attention with 2 kv heads: Ulysses alone stops at sp = 2; USP's Ulysses degree 2 divides them."""
PACKED = {**LLAMA, "data.packing": "document"}
USP = {"parallel.sp_mode": "usp"}
MODELS = {"gpt": GPT, "llama": LLAMA, "packed": PACKED}
LAYOUTS = {  # name: (world size, model, overrides); global batch 8 each
    # 2 ranks (make test): Ulysses 2 x ring 1, plain and with documents (a ring of one rank holds both halves)
    "llama-sp2-u2r1": (2, "llama", {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2"}),
    "packed-sp2-u2r1": (2, "packed", {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2"}),
    # 4 ranks (make test-slow): sp4 = 2 x 2 on 2 kv heads, with documents, tp2 x sp2 (U = 2), and U = 1, R = 2 x tp2
    "llama-sp4-u2r2": (4, "llama", {**USP, "parallel.sp": "4", "parallel.sp_ulysses": "2"}),
    "packed-sp4-u2r2": (4, "packed", {**USP, "parallel.sp": "4", "parallel.sp_ulysses": "2"}),
    "gpt-tp2-sp2-u2r1": (4, "gpt", {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2", "parallel.tp": "2"}),
    "llama-tp2-sp2-u1r2": (4, "llama", {**USP, "parallel.sp": "2", "parallel.tp": "2"}),
    # ... with a pipeline (2 x 1 per stage, 4 micro-batches), and with FSDP2 over dp2 and full recomputation
    "gpt-pp2-sp2-u2r1": (4, "gpt", {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2", "parallel.pp": "2",
                                    "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"}),
    "llama-fsdp2-dp2-sp2-u2r1-recompute": (4, "llama", {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2",
                                                        "parallel.zero_stage": "3", "batch.micro_batch_size": "4",
                                                        "train.recompute": "full"}),
}
SLOW = {name for name, (world, _, _) in LAYOUTS.items() if world == 4}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process, micro batch 8, for each model (the packed one through :mod:`packing_worker`'s hooks)."""
    root = tmp_path_factory.mktemp("usp-ref")
    with packing_worker.newline_documents():
        run_in_process([{"out": str(root / name), "overrides": model} for name, model in MODELS.items()])
    return {name: load_result(root / name) for name in MODELS}


RESUME = {**LLAMA, "train.steps": "6", "parallel.sp": "2", "checkpoint.interval": "3"}
"""Checkpoints: the sp mode changes no parameter. A Ulysses sp2 run checkpointed at step 3 (contiguous tokens) is
resumed under USP 2 x 1 (zigzag pieces) and continues the Ulysses run's steps 4-6."""


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One torchrun launch per world size (packing_worker: plain runs are unchanged by its hooks); the 2-rank one
    then trains :data:`RESUME` under Ulysses and resumes its step-3 checkpoint under USP."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict[str, tuple]:
        if world not in cache:
            root = tmp_path_factory.mktemp(f"usp{world}")
            layouts = {name: {**MODELS[model], **o} for name, (w, model, o) in LAYOUTS.items() if w == world}
            if world == 2:
                saved = root / "ulysses-saved" / "checkpoints" / "step_000003"
                layouts |= {"ulysses-saved": RESUME, "usp-resumed": {**RESUME, **USP, "parallel.sp_ulysses": "2",
                                                                      "checkpoint.resume": str(saved)}}
            cache[world] = launch_layouts(world, root, layouts, worker=packing_worker.__file__)
        return cache[world]
    return get


def _check(name: str, references, launched) -> None:
    world, model, _ = LAYOUTS[name]
    config = {k: v for k, v in MODELS[model].items() if k != "data.packing"}  # the drift bound's config: valid
    check_layout(launched(world)[name], references[model], config)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in SLOW])
def test_usp_matches_single_process(references, launched, name):
    _check(name, references, launched)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_usp_on_four_ranks_matches_single_process(references, launched, name):
    _check(name, references, launched)


def test_a_ulysses_checkpoint_resumes_under_usp(launched):
    saved, resumed = launched(2)["ulysses-saved"][0], launched(2)["usp-resumed"][0]
    assert sorted(saved) == list(range(1, 7)) and sorted(resumed) == [4, 5, 6]
    assert_resumed_losses(resumed, {step: saved[step] for step in (4, 5, 6)})


# --- 3. what cannot run is refused before launch, in one line ----------------------------------------

def _refusal(overrides: dict[str, str], world: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, {**LLAMA, **overrides})
        resolve_world(cfg, world)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.sp": "4", "parallel.sp_ulysses": "2"},
     "parallel.sp_ulysses = 2 splits sp for sp_mode = 'usp' only (sp_mode is 'ulysses'): use sp_mode = 'usp' or "
     "sp_ulysses = 1"),
    ({**USP, "parallel.sp": "4", "parallel.sp_ulysses": "3"},
     "parallel.sp_ulysses = 3 does not divide parallel.sp = 4: USP runs Ulysses over sp_ulysses ranks and ring "
     "attention over sp/sp_ulysses; use sp_ulysses in 1, 2, 4"),
    ({**USP, "parallel.sp": "4", "parallel.sp_ulysses": "0"}, "parallel.sp_ulysses = 0 must be >= 1"),
    ({**USP, "parallel.sp": "4", "parallel.sp_ulysses": "4"},
     "model.n_kv_head = 2 is not divisible by tp*sp_ulysses = 4: USP's Ulysses hands each of its sp_ulysses ranks "
     "n_kv_head/(tp*sp_ulysses) whole kv heads"),
    ({**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2", "parallel.tp": "2", "model.n_head": "2",
      "model.n_kv_head": "2"},
     "model.n_head = 2 is not divisible by tp*sp_ulysses = 4"),
    ({**USP, "parallel.sp": "4", "parallel.sp_ulysses": "2", "model.block_size": "12"},
     "model.block_size = 12 is not divisible by sp * 2 (ring chunks) = 8"),
    ({**USP, "parallel.sp": "4", "parallel.sp_ulysses": "2", "model.dropout": "0.1"},
     "model.dropout = 0.1 is not supported with parallel.sp_mode = 'usp'"),
])
def test_what_usp_cannot_run_is_refused(overrides, message):
    assert message in _refusal(overrides)


def test_usp_is_accepted_where_it_runs():
    for model, overrides in ((LLAMA, {**USP, "parallel.sp": "4", "parallel.sp_ulysses": "2"}),
                             (LLAMA, {**USP, "parallel.sp": "4"}),
                             (GPT, {**USP, "parallel.sp": "2", "parallel.sp_ulysses": "2", "parallel.tp": "2"})):
        cfg = load_config(None, {**model, **overrides})
        assert resolve_world(cfg, 4) == (4, 4 // (cfg.parallel.sp * cfg.parallel.tp))


def test_the_planner_searches_usp_at_each_inner_ulysses_degree():
    """At sp = 8 the search ranks USP at U = 2 and U = 4 beside Ulysses and ring (U = 1 and U = 8 would be ring and
    Ulysses again), each costed, and a pinned ``sp_ulysses`` is the one searched."""
    from meshtrain.planner.estimate import Job
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.layout import FRAMEWORKS
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import preset
    from meshtrain.planner.search import search

    from dataclasses import replace

    args = (replace(preset("llama3-8b"), seq_len=32768), get_hardware("H100"), PRECISIONS["bf16"], FRAMEWORKS["meshtrain"])
    found = search(*args, Job(num_devices=8, global_batch_size=8), fixed={"sp": 8}, keep_unfit=True)
    modes = {(e.layout.sp_mode, e.layout.sp_ulysses) for e in found}
    assert {("ulysses", 1), ("ring", 1), ("usp", 2), ("usp", 4)} <= modes and ("usp", 1) not in modes
    pinned = search(*args, Job(num_devices=8, global_batch_size=8),
                    fixed={"sp": 8, "sp_mode": "usp", "sp_ulysses": 4}, keep_unfit=True)
    assert pinned and {(e.layout.sp_mode, e.layout.sp_ulysses) for e in pinned} == {("usp", 4)}
    usp = next(e for e in found if e.layout.sp_ulysses == 2)
    assert usp.layout.to_overrides()["parallel.sp_ulysses"] == "2"  # what --layout auto hands the trainer
