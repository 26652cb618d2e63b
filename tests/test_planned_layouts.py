"""Every layout ``meshtrain plan CONFIG`` ranks trains (issue 25, Sec. 3), and computes what one process computes.

The planner and config validation read one table (``meshtrain.rules``), so a ranked layout passes
validation; this proves the trainer also runs it. For 2 and 4 ranks the layouts come from the planner's own
search, as ``meshtrain plan CONFIG --num-gpus N`` ranks them (:func:`ranked_layouts`), on the main job's
model shape (4 layers, 4 heads: what pp * virtual_stages and tp * sp must divide) at the tiny test width
(``conftest.TINY``). Layouts that differ only in micro_batch_size and gradient_accumulation_steps run the
same code (the batch arithmetic; the equality tests prove accumulation exact), so each other combination
of fields trains once, as its fastest-ranked member: 2 steps each, one torchrun launch per world size
(``tests/layout_worker.py``), checked against one process by the correctness contract.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import CONFIG, TINY, check_layout, override_args
from layout_worker import launch_layouts, reference_run

MODEL = {**TINY, "model.n_layer": "4", "model.n_head": "4", "train.steps": "2"}
WORLDS = (2, 4)


def ranked_layouts(world: int, overrides: dict[str, str]) -> list:
    """The layouts ``meshtrain plan CONFIG --num-gpus world OVERRIDES`` ranks (every one that fits, fastest
    first; the table shows the top ``--top`` of these), through the command's own context and search."""
    from meshtrain.cli.main import build_parser
    from meshtrain.cli.plan import _config_overrides, build_context
    from meshtrain.planner.search import search

    args, extra = build_parser().parse_known_args(["plan", str(CONFIG), "--num-gpus", str(world),
                                                   *override_args(overrides)])
    args.overrides = _config_overrides(args.config, extra)
    ctx = build_context(args)
    return [e.layout for e in search(ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job)]


def layout_overrides(layout) -> dict[str, str]:
    """``meshtrain train`` overrides that run ``layout`` (``Layout.to_overrides``, which ``--layout auto`` uses)."""
    return layout.to_overrides()


def structure(layout) -> tuple:
    """What selects the code a layout runs: every field but the batch split."""
    return dataclasses.astuple(dataclasses.replace(layout, micro_batch_size=0, gradient_accumulation_steps=0))


def planned(world: int) -> dict[str, dict[str, str]]:
    """{label: overrides} of the fastest-ranked layout of each :func:`structure` for ``world`` ranks."""
    chosen: dict[tuple, object] = {}
    for layout in ranked_layouts(world, MODEL):
        chosen.setdefault(structure(layout), layout)
    return {layout.label().replace(" ", "_"): layout_overrides(layout) for layout in chosen.values()}


@pytest.mark.parametrize("world", WORLDS)
def test_planned_overrides_give_back_the_ranked_layout(world):
    """No process group: the overrides of each planned layout pass config validation and read back as that
    very layout (``Layout.from_config``), so the launch below trains what the planner ranked."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.layout import Layout

    chosen = {}
    for layout in ranked_layouts(world, MODEL):
        chosen.setdefault(structure(layout), layout)
    assert len(chosen) > 10
    for layout in chosen.values():
        assert Layout.from_config(load_config(CONFIG, {**MODEL, **layout_overrides(layout)}), world) == layout


PARTS = {2: 1, 4: 4}
"""Launches per world size: 4 ranks rank ~100 layouts, which one launch does not train within its timeout on
2 shared cores; each part trains every PARTS-th layout (~25, ~5 min)."""


@pytest.mark.slow  # 2 ranks: ~40 layouts, ~2 min; 4 ranks: ~100 layouts in 4 launches of ~5 min: `make test-slow`
@pytest.mark.parametrize("world, part", [(w, p) for w, n in PARTS.items() for p in range(n)])
def test_every_planned_layout_trains_and_matches_one_process(tmp_path, world, part):
    everything = planned(world)
    assert any(o["parallel.tp"] != "1" and o["parallel.pp"] != "1" and o["parallel.pp_schedule"] == "zbv"
               for o in everything.values()) == (world == 4)  # the layout of issue 25 is ranked, and runs
    layouts = dict(list(everything.items())[part::PARTS[world]])
    gbs = {int(o["parallel.dp"]) * int(o["batch.micro_batch_size"]) * int(o["batch.gradient_accumulation_steps"])
           for o in layouts.values()}
    assert len(gbs) == 1  # one global batch, that of the config on `world` ranks
    reference = reference_run(tmp_path / "ref", {**MODEL, "batch.micro_batch_size": str(gbs.pop()),
                                                 "batch.gradient_accumulation_steps": "1"})
    results = launch_layouts(world, tmp_path, {name: {**MODEL, **o} for name, o in layouts.items()})
    for name, got in results.items():
        try:
            check_layout(got, reference, MODEL)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
