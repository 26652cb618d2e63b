"""``meshtrain train CONFIG --layout auto`` (issue 24, Sec. 3): the planner's fastest fitting layout for the ranks
given, the config's global batch kept, command-line layout keys pinned, and the run trains that very layout
(its ``plan_vs_actual.json`` predicts the chosen one). That every layout the search may return trains and
equals one process is ``tests/test_planned_layouts.py``'s."""

from __future__ import annotations

import json

import pytest

from conftest import CONFIG, TINY, override_args, run_cli
from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError

MODEL = {**TINY, "model.n_layer": "4", "model.n_head": "4", "train.steps": "3"}
RUN = {"train.steps": "8", "train.log_interval": "4"}
"""Enough steps that the run times some (after its warm-up steps) and writes plan_vs_actual.json."""


def choose(world: int, fixed: dict | None = None, **overrides: str):
    from meshtrain.launch.auto import choose_layout

    # as `meshtrain train --layout auto` loads it: the schedule's rules on the split wait for the chosen layout
    return choose_layout(load_config(CONFIG, {**MODEL, **overrides}, schedule=False), world, world, 1, fixed or {})


@pytest.mark.parametrize("world", (2, 4))
def test_the_choice_is_the_fastest_fitting_layout_and_keeps_the_global_batch(world):
    """The chosen layout is ranked first by the planner's own search of the same job, the runner-up second;
    the config's global batch (micro_batch_size 12 x dp filling the ranks) is kept; its overrides read back as
    that layout through config validation (``Layout.from_config``)."""
    from meshtrain.planner.layout import Layout

    choice = choose(world)
    assert choice.global_batch_size == 12 * world == choice.best.layout.global_batch_size
    assert choice.runner_up is not None and choice.best.time.total <= choice.runner_up.time.total
    assert choice.best.fits and choice.best.memory.total <= choice.memory_per_rank_bytes
    cfg = load_config(CONFIG, {**MODEL, **choice.overrides()})
    assert Layout.from_config(cfg, world) == choice.best.layout
    lines = choice.lines()
    assert len(lines) == 4 and choice.best.layout.label() in lines[1] and "why:" in lines[3]


def test_command_line_layout_keys_are_pinned():
    from meshtrain.launch.auto import pinned

    fixed = pinned({"parallel.tp": "2", "train.recompute": "full", "optim.lr": "1e-3"})
    assert fixed == {"tp": 2, "recompute": "full"}
    choice = choose(4, fixed)
    assert (choice.best.layout.tp, choice.best.layout.recompute) == (2, "full")
    assert all((e.layout.tp, e.layout.recompute) == (2, "full") for e in (choice.best, choice.runner_up))


@pytest.mark.parametrize("overrides, fixed, needle", [
    ({"model.type": "lstm"}, {}, "model.type = 'lstm' has no planner model"),
    ({"parallel.sync_mode": "local-sgd"}, {}, "plans synchronous training"),
    ({}, {"tp": 3}, "no layout of this model on 4 ranks with tp=3 pinned"),
    ({"parallel.tp": "2"}, {}, "the config's own layout names none on 3 ranks"),
])
def test_what_it_cannot_plan_is_one_config_error(overrides, fixed, needle):
    with pytest.raises(ConfigError, match=needle):
        choose(3 if "3 ranks" in needle else 4, fixed, **overrides)


def test_a_pinned_pipeline_needs_no_accumulation_in_the_config():
    """``--layout auto --pp 2 --pp_schedule 1f1b`` on a config with gradient_accumulation_steps = 1 < pp: the config's
    global batch (its micro_batch_size x 1 x dp) is kept and the planner splits it for the pipeline; without --layout
    auto the same config is refused (1F1B needs a micro-batch per stage; GPipe and the naive schedule take one, and the
    planner may pick them unpinned)."""
    choice = choose(2, {"pp": 2, "pp_schedule": "1f1b"}, **{"parallel.pp": "2", "parallel.pp_schedule": "1f1b"})
    layout = choice.best.layout
    assert layout.pp == 2 and layout.pp_schedule == "1f1b" and layout.gradient_accumulation_steps >= 2
    assert layout.micro_batch_size * layout.gradient_accumulation_steps * layout.dp == 12  # micro_batch_size 12 x 1 x 1
    with pytest.raises(ConfigError, match="gradient_accumulation_steps = 1 is below pp = 2"):
        load_config(CONFIG, {**MODEL, "parallel.pp": "2", "parallel.pp_schedule": "1f1b"})


def _auto_run(tmp_path, world: int, *extra: str):
    out = tmp_path / "run"
    proc = run_cli("train", str(CONFIG), "--nproc", str(world), "--layout", "auto", "--out", str(out),
                   *override_args({**MODEL, **RUN}), *extra)
    assert proc.returncode == 0, proc.stderr[-4000:]
    chosen = next(line for line in proc.stderr.splitlines() if line.startswith("  chosen:"))
    predicted = json.loads((out / "plan_vs_actual.json").read_text())["predicted"]
    assert chosen.split(":")[1].strip() == predicted["layout"]  # the run trained the layout the planner chose
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 8
    return proc, predicted


@pytest.mark.slow  # a 2-rank launch, ~15 s: `make test-slow` (make test is at its 15-minute limit)
def test_a_2_rank_auto_run_trains_the_chosen_layout(tmp_path):
    proc, predicted = _auto_run(tmp_path, 2)
    assert proc.stderr.count("layout auto: 2 ranks, global batch 24") == 1


@pytest.mark.slow  # one 4-rank launch on 2 cores, ~30 s
def test_a_4_rank_auto_run_with_a_pinned_tp_trains_the_chosen_layout(tmp_path):
    proc, predicted = _auto_run(tmp_path, 4, "--tp", "2")
    # the config's global batch with the command line's tp: 12 x dp = 12 x 4 / 2
    assert " tp2" in predicted["layout"] and "global batch 24" in proc.stderr


def test_a_calibration_run_scales_the_ranked_layouts(tmp_path, capsys):
    """``--calibrate-from RUN_DIR``: every layout is ranked at the run's measured speed (a run whose compute took half
    its predicted time, no communication: factor 2), named in the first line; without ``--layout auto`` it is one
    line, before any rank starts."""
    from meshtrain.cli.main import main
    from meshtrain.launch.auto import choose_layout
    from meshtrain.planner.actual import write_plan_vs_actual

    run = tmp_path / "run"
    write_plan_vs_actual({"step_time_s": 2.0, "layout": "dp1", "time_breakdown_s": {"compute": 2.0, "bubble": 0.0, "optimizer": 0.0,
                                                                         "total": 2.0}},
                         {"step_time_s": 1.0}, run)
    cfg = load_config(CONFIG, MODEL, schedule=False)
    plain, fast = choose_layout(cfg, 2, 2, 1, {}), choose_layout(cfg, 2, 2, 1, {}, run)
    assert "speed x2 calibrated on" in fast.lines()[0]
    # compute and the optimizer halve; on this CPU (no overlap) the collectives stay: the step is faster, not 2x
    assert plain.best.time.compute == pytest.approx(2 * fast.best.time.compute) or plain.best.layout != fast.best.layout
    assert fast.best.time.total < plain.best.time.total
    code = main(["train", str(CONFIG), "--calibrate-from", str(run), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "goes with --layout auto" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_the_why_line_says_when_the_runner_up_is_within_the_planners_range():
    """``--layout auto`` ranks by the predicted step time and says when the runner-up lies inside the chosen layout's
    range (the spread of the planner's measured errors: the two may swap in practice), and nothing when it lies
    outside."""
    from dataclasses import replace

    from meshtrain.planner.stack import Speed

    choice = choose(2)
    best, other = choice.best.time.total, choice.runner_up.time.total
    # a range reaches up to best / (1 + low) seconds: just above the runner-up's step, then just below it
    wide = replace(choice, speed=Speed(1.0, best / other - 1 - 0.01, 0.5, "test range"))
    assert "so the two may swap in practice" in wide.lines()[3] and "test range" in wide.lines()[3]
    narrow = replace(choice, speed=Speed(1.0, best / other - 1 + 1e-6, 0.5, "test range"))
    assert "may swap" not in narrow.lines()[3]
    assert "may swap" not in replace(choice, speed=None).lines()[3]
