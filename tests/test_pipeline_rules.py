"""The pipeline's arithmetic, no processes: the cost-balanced split, chunk placement, schedule rules, bubbles."""

from __future__ import annotations

import itertools
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.models.registry import ModelConfig
from meshtrain.parallel.pipeline.balance import chunk_ranks, model_item_costs, split_layers
from meshtrain.rules.pipeline import RULES, bubble_fraction, microbatches_in_flight, schedule_error


def _brute_force_best(n_layer: int, n_chunks: int, costs: tuple[float, float, float]) -> float:
    """The smallest costliest chunk over every way to cut ``n_layer`` blocks into ``n_chunks`` non-empty runs."""
    emb, block, head = costs
    best = float("inf")
    for cuts in itertools.combinations(range(1, n_layer), n_chunks - 1):
        bounds = (0, *cuts, n_layer)
        worst = max((bounds[i + 1] - bounds[i]) * block + (emb if i == 0 else 0) + (head if i == n_chunks - 1 else 0)
                    for i in range(n_chunks))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("n_layer,n_chunks,costs", [
    (8, 4, (0.0, 1.0, 0.0)), (8, 4, (0.0, 1.0, 3.0)), (12, 4, (2.5, 1.0, 1.5)), (7, 3, (0.1, 1.0, 9.0)),
    (5, 5, (1.0, 1.0, 1.0)), (10, 1, (1.0, 1.0, 1.0)),
])
def test_split_is_contiguous_and_minimises_the_costliest_chunk(n_layer, n_chunks, costs):
    chunks = split_layers(n_layer, n_chunks, costs)
    assert [c.first_layer for c in chunks[1:]] == [c.end_layer for c in chunks[:-1]]
    assert chunks[0].first_layer == 0 and chunks[-1].end_layer == n_layer and all(len(c.layers) >= 1 for c in chunks)
    assert chunks[0].has_embedding and chunks[-1].has_head
    assert sum(c.has_embedding for c in chunks) == 1 and sum(c.has_head for c in chunks) == 1
    assert max(c.cost for c in chunks) == pytest.approx(_brute_force_best(n_layer, n_chunks, costs))


def _dp_split(n_layer: int, n_chunks: int, costs: tuple[float, float, float]) -> list[int]:
    """The cuts of the dynamic programme over every cut point (the split the trainer used before its bisection):
    each chunk, from the last back, starts as late as the best costliest chunk allows."""
    emb, block, head = costs

    def cost(chunk: int, start: int, end: int) -> float:
        return (end - start) * block + (emb if chunk == 0 else 0.0) + (head if chunk == n_chunks - 1 else 0.0)

    @cache
    def best(chunk: int, end: int) -> tuple[float, int]:
        if chunk == 0:
            return cost(0, 0, end), 0
        value, neg_start = min((max(best(chunk - 1, start)[0], cost(chunk, start, end)), -start)
                               for start in range(chunk, end))
        return value, -neg_start

    cuts = [n_layer]
    for chunk in range(n_chunks - 1, 0, -1):
        cuts.append(best(chunk, cuts[-1])[1])
    return [0, *reversed(cuts)]


_COST = st.one_of(st.integers(0, 12).map(float), st.floats(0, 40, allow_nan=False, allow_infinity=False))


@settings(max_examples=400, deadline=None)
@given(data=st.data(), n_layer=st.integers(1, 28), emb=_COST, head=_COST,
       block=st.one_of(st.integers(1, 4).map(float), st.floats(0.01, 9, allow_nan=False)))
def test_the_bisected_split_is_the_dynamic_programmes(data, n_layer, emb, head, block):
    """Same cuts as the O(chunks * layers**2) programme, ties (integer costs) included: the trainer's stages and the
    planner's busiest one do not move."""
    n_chunks = data.draw(st.integers(1, n_layer))
    chunks = split_layers(n_layer, n_chunks, (emb, block, head))
    assert [c.first_layer for c in chunks] + [n_layer] == _dp_split(n_layer, n_chunks, (emb, block, head))


def test_a_heavy_head_takes_layers_off_the_last_stage():
    """GPT-2 small's vocabulary on 4 stages of 12 layers: the head costs ~2 blocks, so the last stage holds fewer."""
    gpt2_small = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)
    costs = model_item_costs(gpt2_small, 50257, tokens=8 * 1024)
    chunks = split_layers(12, 4, costs)
    assert len(chunks[-1].layers) < len(chunks[1].layers)


def test_split_and_placement_errors_and_shapes():
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        split_layers(3, 4, (0.0, 1.0, 0.0))
    with pytest.raises(ValueError, match="block's cost must be > 0"):
        split_layers(4, 2, (1.0, 0.0, 1.0))
    assert chunk_ranks(2, 4, "loop") == [0, 1, 0, 1]
    assert chunk_ranks(2, 4, "v") == [0, 1, 1, 0]
    assert chunk_ranks(4, 8, "v") == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("schedule,pp,v,m,needle", [
    ("1f1b", 4, 1, 3, "below pp = 4"),
    ("interleaved-1f1b", 2, 2, 3, "not a multiple of pp = 2"),
    ("interleaved-1f1b", 2, 1, 4, "virtual_stages = 1 does not fit"),
    ("zbv", 2, 3, 4, "virtual_stages = 3 does not fit"),
    ("gpipe", 4, 1, 1, None), ("naive", 4, 1, 1, None), ("zero-bubble", 2, 1, 2, None),
    ("gpipe", 4, 2, 4, "virtual_stages = 2 does not fit"),
    ("1f1b", 8, 1, 8, "pp * virtual_stages = 8 exceeds model.n_layer = 6"),
    ("pipedream", 2, 1, 2, "is not valid"),
])
def test_schedule_rules(schedule, pp, v, m, needle):
    error = schedule_error(schedule, pp, v, m, n_layer=6)
    assert (error is None) if needle is None else (needle in error)


def test_zero_bubble_schedules_refuse_ddp_and_zero3_and_run_with_fsdp2_zero2():
    for schedule in ("zero-bubble", "zbv"):
        for zero_stage in (0, 1):
            assert "cannot run under DDP" in schedule_error(schedule, 2, 2, 4, 8, batch_degree=2, zero_stage=zero_stage)
        assert schedule_error(schedule, 2, 2, 4, 8, batch_degree=2, zero_stage=2) is None
        for batch_degree in (1, 2):  # FSDP2 wraps a single rank too
            assert "cannot run with zero_stage = 3" in schedule_error(schedule, 2, 2, 4, 8, batch_degree, 3)
        assert schedule_error(schedule, 2, 2, 4, 8, batch_degree=1, zero_stage=0) is None
    for schedule in ("1f1b", "interleaved-1f1b", "gpipe"):
        assert schedule_error(schedule, 2, 2 if schedule == "interleaved-1f1b" else 1, 4, 8, 2, 3) is None
    assert schedule_error("1f1b", 2, 1, 4, 8, batch_degree=2) is None
    assert {s for s, r in RULES.items() if not r.ddp} == {"zero-bubble", "zbv"}
    assert {s for s, r in RULES.items() if not r.fsdp_zero3} == {"zero-bubble", "zbv"}


def test_bubble_and_in_flight_formulas():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction("gpipe", 4, 8) == bubble_fraction("1f1b", 4, 8)
    assert bubble_fraction("interleaved-1f1b", 4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(v*m+p-1)
    assert bubble_fraction("naive", 4, 8) == pytest.approx(3 / 4)
    assert bubble_fraction("zero-bubble", 4, 8) < bubble_fraction("1f1b", 4, 8)
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    assert microbatches_in_flight("gpipe", 4, 8) == 8 and microbatches_in_flight("1f1b", 4, 8) == 4
    assert microbatches_in_flight("naive", 4, 8) == 1
    assert microbatches_in_flight("interleaved-1f1b", 4, 8, 2) == pytest.approx(4 + 3 / 2)


def test_every_schedule_of_the_vocabulary_has_its_rules():
    """``meshtrain.axes.PP_SCHEDULES`` (what config, CLI and planner accept) and the schedules' rules name the same set."""
    from meshtrain.axes import PP_SCHEDULES
    from meshtrain.rules.pipeline import RULES

    assert set(RULES) == set(PP_SCHEDULES) and len(PP_SCHEDULES) == len(set(PP_SCHEDULES))
