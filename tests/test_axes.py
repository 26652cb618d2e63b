"""One table of axes (:data:`meshtrain.axes.AXIS_TABLE`): the config's, the planner's and the run's degree fields,
the flags, the pinnable and fixable keys and the mesh's strides all follow it, and no other module lists the axes;
and the resolved run (:mod:`meshtrain.resolved`) the launcher hands its ranks."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain import axes
from meshtrain.axes import AXES, AXIS_TABLE, BATCH_AXES, REPLICA_AXES
from meshtrain.config.load import load_config
from meshtrain.config.sections import ParallelConfig
from meshtrain.errors import ConfigError
from meshtrain.resolved import ResolvedRun

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char.toml"
NAMES = [str(s.axis) for s in AXIS_TABLE]


def test_the_degree_fields_of_config_layout_and_dims_are_the_table_in_its_order():
    from meshtrain.mesh import ParallelDims
    from meshtrain.planner.layout import Layout

    for cls in (ParallelConfig, Layout, ParallelDims):
        assert [f.name for f in dataclasses.fields(cls)][:len(NAMES)] == NAMES, cls
    assert {n: getattr(ParallelConfig(), n) for n in NAMES} == {str(s.axis): -1 if s.fills else 1 for s in AXIS_TABLE}
    assert all(getattr(Layout(), n) == 1 for n in NAMES)
    with pytest.raises(TypeError):  # the run's degrees are all required
        ParallelDims(world_size=1)


def test_every_axis_is_a_flag_a_pin_and_a_fix():
    from meshtrain.cli.main import build_parser
    from meshtrain.config.load import SHORT_FLAGS
    from meshtrain.launch.auto import PINNABLE
    from meshtrain.planner.validate import FIXABLE

    parser = build_parser()
    for name in NAMES:
        args, extra = parser.parse_known_args(["train", "c.toml", f"--{name}", "3"])
        assert getattr(args, name) == "3" and not extra
        assert SHORT_FLAGS[name] == f"parallel.{name}" and PINNABLE[f"parallel.{name}"] == name and name in FIXABLE
    for name in REPLICA_AXES:  # meshtrain batch: the axes that share each sample
        assert parser.parse_args(["batch", "--world-size", "8", "--micro-batch-size", "1", f"--{name}", "2"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=len(AXES), max_size=len(AXES)), st.data())
def test_strides_and_sizes_follow_the_mesh_order(values, data):
    """A rank's coordinates (row-major over AXES, :meth:`ParallelDims.coordinates`) weighted by the strides give
    the rank back; world_size, replica_size and batch_degree are the products of their axes, and a borrowed axis
    (ep) multiplies none of them: it must divide dp*sp."""
    from meshtrain.mesh import ParallelDims

    degrees = dict(zip(map(str, AXES), values))
    world = math.prod(values)
    batch = axes.batch_degree(degrees)
    ep = data.draw(st.integers(1, batch + 1))
    if batch % ep:
        with pytest.raises(ConfigError, match=f"parallel.ep = {ep} does not divide dp\\*sp"):
            ParallelDims(**degrees, ep=ep, world_size=world)
        return
    degrees["ep"] = ep
    dims = ParallelDims(**degrees, world_size=world)
    assert dims.expert_replicas * ep == batch
    rank = data.draw(st.integers(0, world - 1))
    coords = dims.coordinates(rank)
    assert sum(coords[str(a)] * axes.stride(degrees, a) for a in AXES) == rank
    assert axes.world_size(degrees) == world
    assert axes.replica_size(degrees) * degrees["dp"] == world
    assert axes.batch_degree(degrees) == math.prod(degrees[str(a)] for a in BATCH_AXES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0, -1, -2])
def test_a_degree_below_one_is_one_line_naming_it(name, value):
    spec = axes.SPECS[name]
    degrees = {**{n: 1 for n in NAMES}, name: value}
    errors = axes.degree_errors(degrees, "parallel.")
    if spec.fills and value == -1:
        assert errors == []
        return
    assert errors == [f"parallel.{name} = {value} must be >= 1" + (", or -1 to fill the remaining ranks"
                                                                   if spec.fills else "")]
    with pytest.raises(ConfigError, match=f"parallel.{name} = {value} must be >= 1"):
        load_config(CONFIG, {f"parallel.{name}": str(value)})


def test_no_module_but_axes_lists_the_axes():
    """A tuple, list, set or dict of three or more axis names written out is a copy of the table that a new
    axis would miss; only :mod:`meshtrain.axes` may hold one."""
    copies = []
    for path in sorted((ROOT / "src" / "meshtrain").rglob("*.py")):
        if path.name == "axes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = (node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                     else node.keys if isinstance(node, ast.Dict) else [])
            named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES}
            if len(named) >= 3:
                copies.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not copies, copies


# --- the resolved run -----------------------------------------------------------------------------------

def test_a_resolved_run_reads_back_equal(tmp_path):
    cfg = load_config(CONFIG, {"parallel.tp": "2", "batch.gradient_accumulation_steps": "3"})
    run = ResolvedRun.resolve(cfg, 4, "auto")
    assert (run.world_size, run.dp, run.degrees, run.global_batch_size) == (4, 2, {"dp": 2, "tp": 2, "pp": 1, "sp": 1, "ep": 1},
                                                                           12 * 3 * 2)
    assert cfg.parallel.dp == -1  # the config it came from is untouched
    again = ResolvedRun.read(run.write(tmp_path / "resolved.json"))
    assert again == run
    assert [p.name for p in tmp_path.iterdir()] == ["resolved.json"]  # no temporary left


def test_a_run_on_other_ranks_than_resolved_for_is_refused_as_before():
    run = ResolvedRun.resolve(load_config(CONFIG), 4)
    assert run.for_world(4) is run
    with pytest.raises(ConfigError, match="parallel.dp = 4 does not match --nproc = 2"):
        run.for_world(2)  # an elastic restart with fewer nodes: dp was pinned for 4 ranks


def _damage(data: dict, how: str) -> dict | str:
    if how == "not json":
        return "{"
    if how == "format":
        return {**data, "format": "other"}
    if how == "version":
        return {**data, "version": 99}
    if how == "layout":
        return {**data, "layout": "guess"}
    if how == "degrees":
        return {**data, "degrees": {**data["degrees"], "dp": 3}}
    if how == "global batch":
        return {**data, "global_batch_size": 1}
    if how == "unknown key":
        return {**data, "config": {**data["config"], "parallel": {**data["config"]["parallel"], "dq": 1}}}
    if how == "wrong type":
        return {**data, "config": {**data["config"], "train": {**data["config"]["train"], "steps": "ten"}}}
    assert how == "bad value"
    return {**data, "config": {**data["config"], "parallel": {**data["config"]["parallel"], "tp": 0}}}


@pytest.mark.parametrize("how", ["not json", "format", "version", "layout", "degrees", "global batch", "unknown key",
                                 "wrong type", "bad value"])
def test_a_damaged_resolved_run_is_one_line(tmp_path, how):
    path = ResolvedRun.resolve(load_config(CONFIG), 2).write(tmp_path / "resolved.json")
    damaged = _damage(json.loads(path.read_text()), how)
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(ConfigError) as e:
        ResolvedRun.read(path)
    assert "\n" not in str(e.value)


def test_the_launcher_starts_its_ranks_on_the_resolved_run_alone(tmp_path):
    """The ranks' command line names the resolved run and nothing else: no TOML, no override to re-derive."""
    from meshtrain.cli.main import build_parser
    from meshtrain.cli.train import torchrun_argv

    args = build_parser().parse_args(["train", str(CONFIG), "--tp", "2"])
    argv = torchrun_argv(args, 2, str(tmp_path / "store"), tmp_path / "resolved.json")
    assert argv[argv.index("-m"):] == ["-m", "meshtrain.train", "--resolved", str(tmp_path / "resolved.json")]
