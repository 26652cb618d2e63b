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
from meshtrain.config import BatchConfig, ParallelConfig

MODEL = {**TINY, "model.n_layer": "4", "model.n_head": "4", "train.steps": "2"}
WORLDS = (2, 4)


def ranked_layouts(world: int, overrides: dict[str, str]) -> list:
    """The layouts ``meshtrain plan CONFIG --num-gpus world OVERRIDES`` ranks (every one that fits, fastest
    first; the table shows the top ``--top`` of these), through the command's own context and search."""
    from meshtrain.cli.main import build_parser
    from meshtrain.planner.command import _config_overrides, build_context
    from meshtrain.planner.search import search

    args, extra = build_parser().parse_known_args(["plan", str(CONFIG), "--num-gpus", str(world),
                                                   *override_args(overrides)])
    args.overrides = _config_overrides(args.config, extra)
    ctx = build_context(args)
    return [e.layout for e in search(ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job)]


SYNC_MODES = {"local_sgd_steps": "local-sgd", "ps_servers": "async"}
"""Layout fields whose non-zero value also sets ``parallel.sync_mode`` (``Layout.from_config`` reads them only then)."""


def layout_overrides(layout) -> dict[str, str]:
    """``meshtrain train`` overrides that run ``layout`` (the inverse of ``Layout.from_config``): fields shared by
    name with ParallelConfig or BatchConfig as they are, ``dp`` as ``parallel.dp``, :data:`SYNC_MODES`' fields
    only when set. A field the trainer has no key for must hold its default; the test fails here when the
    planner starts ranking one, so that it gets mapped."""
    sections = {f.name: "parallel" for f in dataclasses.fields(ParallelConfig)}
    sections.update({f.name: "batch" for f in dataclasses.fields(BatchConfig)})
    out = {}
    for name, mode in SYNC_MODES.items():
        if getattr(layout, name):
            out["parallel.sync_mode"] = mode
        else:
            sections.pop(name)
    for f in dataclasses.fields(layout):
        value = getattr(layout, f.name)
        if f.name in sections:
            out[f"{sections[f.name]}.{f.name}"] = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            assert value == f.default, f"the planner ranks {f.name} = {value!r}: map it to the trainer's config here"
    return out


def structure(layout) -> tuple:
    """What selects the code a layout runs: every field but the batch split."""
    return dataclasses.astuple(dataclasses.replace(layout, micro_batch_size=0, gradient_accumulation_steps=0))


def known_failure(layout) -> bool:
    """OPEN BUG, found by this test (fails at HEAD too): a pipeline under DDP (pp > 1, dp*sp > 1, zero_stage 0)
    with gradient_accumulation_steps > 1 stops at step 2 in DDP's reducer ("rebuilt parameter indices size
    is not same as original model parameters size ... 18 versus ... 36") when a chunk runs two backwards in
    a row before any forward follows its first one (likely: torch's schedules run the early backwards under
    ``no_sync``, whose gradient hooks still record the bucket order): seen at pp=2 GA 2 (1f1b, gpipe,
    interleaved-1f1b), interleaved-1f1b GA 4, pp=4 GA 2 and 4 (gpipe). GA 1, 1f1b with GA > pp, and FSDP2
    run. Left out of the launch (a failing rank hangs its peers) until fixed or ruled out in rules/;
    :func:`test_known_failure_still_fails` keeps it in view."""
    ddp_pipeline = layout.pp > 1 and layout.dp * layout.sp > 1 and layout.zero_stage == 0  # DDP spans dp x sp
    verified = layout.pp_schedule == "1f1b" and layout.gradient_accumulation_steps > layout.pp
    return ddp_pipeline and layout.gradient_accumulation_steps > 1 and not verified


def planned(world: int) -> dict[str, dict[str, str]]:
    """{label: overrides} of the fastest-ranked layout of each :func:`structure` for ``world`` ranks
    (:func:`known_failure` left out)."""
    chosen: dict[tuple, object] = {}
    for layout in ranked_layouts(world, MODEL):
        if not known_failure(layout):
            chosen.setdefault(structure(layout), layout)
    return {layout.label().replace(" ", "_"): layout_overrides(layout) for layout in chosen.values()}


@pytest.mark.parametrize("world", WORLDS)
def test_planned_overrides_give_back_the_ranked_layout(world):
    """No process group: the overrides of each planned layout pass config validation and read back as that
    very layout (``Layout.from_config``), so the launch below trains what the planner ranked."""
    from meshtrain.config import load_config
    from meshtrain.planner.layout import Layout

    chosen = {}
    for layout in ranked_layouts(world, MODEL):
        chosen.setdefault(structure(layout), layout)
    assert len(chosen) > 10
    for layout in chosen.values():
        assert Layout.from_config(load_config(CONFIG, {**MODEL, **layout_overrides(layout)}), world) == layout


@pytest.mark.slow  # 36 layouts at 2 ranks ~95 s, 103 at 4 ranks > 10 min on the shared 2 cores: `make test-slow`
@pytest.mark.parametrize("world", WORLDS)
def test_every_planned_layout_trains_and_matches_one_process(tmp_path, world):
    layouts = planned(world)
    assert any(o["parallel.tp"] != "1" and o["parallel.pp"] != "1" and o["parallel.pp_schedule"] == "zbv"
               for o in layouts.values()) == (world == 4)  # the layout of issue 25 is ranked, and runs
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


@pytest.mark.slow  # one 4-rank launch, ~15 s
def test_known_failure_still_fails(tmp_path):
    """The open bug of :func:`known_failure`, through ``meshtrain train`` (whose launcher stops every rank when
    one fails). When this test fails, the bug is fixed: delete :func:`known_failure` and this test."""
    from conftest import run_cli

    overrides = {**MODEL, "parallel.pp": "2", "parallel.dp": "2", "batch.micro_batch_size": "2",
                 "batch.gradient_accumulation_steps": "2", "train.out_dir": str(tmp_path / "run")}
    proc = run_cli("train", str(CONFIG), "--nproc", "4", *override_args(overrides))
    assert proc.returncode != 0 and "rebuilt parameter indices size" in proc.stderr, proc.stderr[-3000:]
