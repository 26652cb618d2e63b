"""The planner's ``meshtrain`` framework and the trainer's config validation read one table
(``meshtrain.rules.support.SUPPORTED``): every layout the search can rank, the trainer accepts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import CONFIG
from meshtrain.cli.main import main
from meshtrain.config.checks import validate
from meshtrain.config.load import load_config
from meshtrain.config.sections import BatchConfig, Config, ParallelConfig
from meshtrain.errors import ConfigError
from meshtrain.planner.estimate import Job
from meshtrain.planner.layout import FRAMEWORKS, Layout, divisibility_errors, framework_errors
from meshtrain.planner.model_specs import ModelSpec
from meshtrain.planner.search import candidate_layouts
from meshtrain.rules.support import SUPPORTED


def trainer_config(model: ModelSpec, layout: Layout) -> Config:
    """The trainer's config for ``layout`` of the GPT ``model`` (bundled corpus, so data.path exists)."""
    cfg = Config()
    m, p, b = cfg.model, cfg.parallel, cfg.batch
    m.n_layer, m.n_head, m.n_embd, m.block_size = model.layers, model.heads, model.hidden, model.seq_len
    m.vocab_size, m.dropout = model.vocab, 0.1 if model.dropout else 0.0
    p.dp, p.tp, p.pp, p.sp, p.zero_stage = layout.dp, layout.tp, layout.pp, layout.sp, layout.zero_stage
    p.sp_mode, p.pp_schedule, p.virtual_stages = layout.sp_mode, layout.pp_schedule, layout.virtual_stages
    p.tp_sequence_parallel, p.hierarchical_allreduce = layout.tp_sequence_parallel, layout.hierarchical_allreduce
    b.micro_batch_size, b.gradient_accumulation_steps = layout.micro_batch_size, layout.gradient_accumulation_steps
    cfg.train.recompute = layout.recompute
    return cfg


# GPTs the trainer can build (GELU MLP of 4h, kv_heads = heads), with head counts and lengths that
# exercise tp, Ulysses (heads % (tp*sp)), ring (2*sp chunks) and tp_sequence_parallel.
MODELS = [
    ModelSpec("shakespeare", layers=4, hidden=128, heads=4, vocab=65, seq_len=64),
    ModelSpec("odd-heads", layers=2, hidden=96, heads=6, vocab=50, seq_len=24, dropout=True),
    ModelSpec("long", layers=3, hidden=64, heads=2, vocab=65, seq_len=48),
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("world, batch", [(2, 24), (4, 8), (8, 16), (12, 24)])
def test_every_meshtrain_candidate_passes_the_trainer_validation(model, world, batch):
    framework = FRAMEWORKS["meshtrain"]
    candidates = [(base, modes) for base, modes in candidate_layouts(model, Job(world, batch), framework,
                                                                      devices_per_node=2)]
    assert candidates
    seen = set()
    for base, modes in candidates:
        # every mode, but "selective" under the zero-bubble schedules (ScheduleRule.selective_recompute)
        assert modes == [m for m in SUPPORTED.recompute if m != "selective" or base.pp == 1
                         or base.pp_schedule not in ("zero-bubble", "zbv")]
        for rc in modes:
            layout = Layout(**{**base.to_dict(), "recompute": rc})
            validate(trainer_config(model, layout))  # raises ConfigError if the trainer would reject it
            seen.add((layout.tp > 1, layout.sp_mode if layout.sp > 1 else "", layout.tp_sequence_parallel))
    assert all(b.zero_stage in SUPPORTED.zero_stages for b, _ in candidates)
    if world >= 4:  # the search really covers tp, sp and the pipeline schedules
        assert any(tp for tp, _, _ in seen) and any(mode for _, mode, _ in seen)
        assert {b.pp_schedule for b, _ in candidates if b.pp > 1} >= {"gpipe", "naive"}
        assert any(b.hierarchical_allreduce for b, _ in candidates)  # dp groups spanning 2-device nodes


def test_the_trainer_rejects_what_the_planner_rules_out():
    """The other direction, for the rules both sides state: each layout breaks one rule in each."""
    model = MODELS[1]  # 6 heads, seq_len 24, dropout
    fw = FRAMEWORKS["meshtrain"]
    for layout in (Layout(dp=1, tp=4), Layout(dp=1, tp=2, sp=2), Layout(dp=1, sp=8, sp_mode="ring"),
                   Layout(dp=1, sp=2, sp_mode="ring"), Layout(dp=1, tp=2, zero_stage=1), Layout(dp=1, pp=2),
                   Layout(dp=1, pp=2, gradient_accumulation_steps=2, pp_schedule="zbv", virtual_stages=1,
                          recompute="selective")):
        assert divisibility_errors(model, layout) + framework_errors(fw, layout, model), layout
        with pytest.raises(ConfigError):
            validate(trainer_config(model, layout))


def test_framework_is_built_from_the_support_table():
    fw = FRAMEWORKS["meshtrain"]
    assert fw.zero_stages == SUPPORTED.zero_stages and fw.pp_schedules == SUPPORTED.pp_schedules
    assert fw.recompute == SUPPORTED.recompute and fw.sp_modes == SUPPORTED.sp_modes
    assert fw.sequence_parallel == SUPPORTED.tp_sequence_parallel and fw.tensor_parallel == SUPPORTED.tp
    assert FRAMEWORKS["megatron-core"].recompute == ("none", "selective", "full")


def test_plan_of_the_main_config_and_of_a_preset_ranks_only_runnable_layouts(capsys):
    for args in (["configs/shakespeare_char.toml", "--num-gpus", "4"],
                 ["--model", "gpt2-small", "--gpu", "H100", "--num-gpus", "64", "--global-batch-size", "512"]):
        assert main(["plan", *args, "--json", "--top", "1000"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows
        for r in rows:
            assert r["recompute"] in SUPPORTED.recompute and r["zero_stage"] in SUPPORTED.zero_stages
            assert r["pp"] == 1 or r["pp_schedule"] in SUPPORTED.pp_schedules


def test_fix_and_explain_name_what_the_trainer_lacks(capsys):
    job = ["--model", "gpt2-small", "--gpu", "H100", "--num-gpus", "8", "--global-batch-size", "64"]
    assert main(["plan", *job, "--explain", "recompute=selective,pp=2,pp_schedule=zbv,virtual_stages=2,zero_stage=1"]) == 0
    out = capsys.readouterr().out
    assert "recompute = 'selective' does not run with pp_schedule = 'zbv' in meshtrain" in out
    assert "zero_stage = 1 needs tp = 1 and pp = 1 (got tp = 1, pp = 2;" in out
    assert main(["plan", *job, "--fix", "recompute=selective,pp=2,pp_schedule=zero-bubble"]) == 2
    assert ("--fix asks for what meshtrain cannot run: recompute = 'selective' does not run with pp_schedule = "
            "'zero-bubble'") in capsys.readouterr().err


def test_fsdp_units_group_consecutive_blocks_up_to_the_unit_size():
    from meshtrain.rules.support import fsdp_units

    assert fsdp_units([10.0] * 4, 0.0) == ([[0], [1], [2], [3]], [])  # one unit per block (torchtitan)
    assert fsdp_units([10.0] * 5, 20.0) == ([[0, 1], [2, 3]], [4])  # the rest stays in the root
    assert fsdp_units([10.0] * 3, 100.0) == ([], [0, 1, 2])  # a small model: the root unit only
    assert fsdp_units([30.0, 5.0, 5.0, 20.0], 25.0) == ([[0], [1, 2, 3]], [])


def test_the_planner_counts_the_trainers_fsdp_units():
    """Memory: ZeRO-3 holds two units and the root unsharded, and in backward the gradients of the root
    and of one unit, plus a copy of the largest unit's for its reduce-scatter; a model under the unit size
    is all root. Time: fewer units, fewer collectives to pay for."""
    from dataclasses import replace

    from meshtrain.config.load import load_config
    from meshtrain.planner.cost import step_time
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.layout import meshtrain_framework
    from meshtrain.planner.memory import PRECISIONS, fsdp_unit_shape, memory_breakdown, stage_params
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(CONFIG)
    model, prec = from_config(cfg, 65), PRECISIONS["fp32"]
    hw = get_hardware("H100-SXM-80GB")
    hw = replace(hw, device=replace(hw.device, fsdp_unit_overhead_s=1e-4))  # a host cost per collective, as on a CPU
    layout = Layout(dp=2, zero_stage=3, micro_batch_size=12)
    whole, per_block = meshtrain_framework(cfg), replace(FRAMEWORKS["meshtrain"], fsdp_unit_bytes=0.0)
    assert whole.fsdp_unit_bytes == cfg.parallel.fsdp_unit_mb * 2**20
    assert fsdp_unit_shape(model, layout, whole) == (0, 0) and fsdp_unit_shape(model, layout, per_block) == (4, 1)
    p, b, w, g = stage_params(model, layout), model.layer_params(), prec.weight_bytes, prec.grad_bytes
    assert memory_breakdown(model, layout, hw, prec, whole).buffers == pytest.approx(p * (w + 2 * g))
    root = p - 4 * b  # embedding, position embedding, final norm: smaller than a block here
    assert 0 < root < b
    per_block_bytes = (root + 2 * b) * w + (root + b) * g + b * g
    assert memory_breakdown(model, layout, hw, prec, per_block).buffers == pytest.approx(per_block_bytes)
    # 2 collectives (root gather, reduce-scatter) against 5 + 3 + 5, each paying the host time (never hidden)
    saved = step_time(model, layout, hw, prec, per_block).dp_comm - step_time(model, layout, hw, prec, whole).dp_comm
    assert saved >= (13 - 2) * 1e-4 * (1 - 1e-9)


# For every field Layout shares by name with ParallelConfig/BatchConfig: overrides of a valid config
# whose value of that field is not the default, and the world size to build the layout for.
SHARED_FIELD_CASES = {
    "dp": ({"parallel.dp": "2"}, 2),
    "tp": ({"parallel.tp": "2"}, 2),
    "pp": ({"parallel.pp": "2", "batch.gradient_accumulation_steps": "2"}, 2),
    "sp": ({"parallel.sp": "2"}, 2),
    "ep": ({"model.type": "mixtral", "parallel.ep": "2"}, 2),
    "zero_stage": ({"parallel.zero_stage": "3"}, 2),
    "micro_batch_size": ({"batch.micro_batch_size": "5"}, 1),
    "gradient_accumulation_steps": ({"batch.gradient_accumulation_steps": "3"}, 1),
    "pp_schedule": ({"parallel.pp": "2", "parallel.pp_schedule": "gpipe"}, 2),
    "virtual_stages": ({"parallel.pp": "2", "parallel.pp_schedule": "interleaved-1f1b", "parallel.virtual_stages": "2",
                        "batch.gradient_accumulation_steps": "2"}, 2),
    "tp_sequence_parallel": ({"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}, 2),
    "sp_mode": ({"parallel.sp": "2", "parallel.sp_mode": "ring"}, 2),
    "sp_ulysses": ({"parallel.sp": "4", "parallel.sp_mode": "usp", "parallel.sp_ulysses": "2"}, 4),
    "local_sgd_steps": ({"parallel.sync_mode": "local-sgd", "local_sgd.steps": "7"}, 2),
    "hierarchical_allreduce": ({"parallel.hierarchical_allreduce": "true"}, 2),
    "ps_servers": ({"parallel.sync_mode": "async", "parameter_server.servers": "2"}, 4),
    **{f"diloco_{key}": ({"parallel.sync_mode": "diloco", "diloco.group": "2", f"diloco.{key}": value}, 4)
       for key, value in (("group", "2"), ("inner_steps", "6"), ("fragments", "2"), ("delay", "1"),
                          ("precision", "int8"))},
}


def _shared_fields() -> dict[str, tuple[str, str]]:
    """Layout's field names that ParallelConfig or BatchConfig also has, or a sync mode's section under its prefix
    (``planner.layout.SYNC_FIELDS``) -> (that config section, its key)."""
    from meshtrain.planner.layout import SYNC_FIELDS

    layout_names = {f.name for f in dataclasses.fields(Layout)}
    return {f.name: (name, f.name) for name, section in (("parallel", ParallelConfig), ("batch", BatchConfig))
            for f in dataclasses.fields(section) if f.name in layout_names} | {
        field: (section, key) for field, (_, section, key) in SYNC_FIELDS.items()}


def test_every_shared_field_has_a_case():
    assert set(SHARED_FIELD_CASES) == set(_shared_fields()), \
        "a field Layout shares by name with ParallelConfig/BatchConfig needs a case in SHARED_FIELD_CASES"


@pytest.mark.parametrize("name", sorted(_shared_fields()))
def test_layout_from_config_carries_every_field_it_shares_with_the_config(name):
    overrides, world = SHARED_FIELD_CASES[name]
    cfg = load_config(None, overrides)
    section, key = _shared_fields()[name]
    value = getattr(getattr(cfg, section), key)
    defaults = {getattr(getattr(Config(), section), key)} | {f.default for f in dataclasses.fields(Layout) if f.name == name}
    assert value not in defaults, f"the case for {name} must set a value that is no default"
    layout = Layout.from_config(cfg, world)
    assert getattr(layout, name) == value
    assert layout.world_size == world


@pytest.mark.parametrize("sync_mode, world", [("sync", 2), ("local-sgd", 2), ("async", 3), ("diloco", 2)])
def test_layout_from_config_keeps_the_sync_mode_fields_of_other_modes_off(sync_mode, world):
    # another mode's keys are refused off their defaults (tests/test_sync_mode_keys.py): DiLoCo's only under DiLoCo
    cfg = load_config(None, {"parallel.sync_mode": sync_mode, **({"diloco.group": "1"} if sync_mode == "diloco" else {})})
    layout = Layout.from_config(cfg, world)
    assert layout.local_sgd_steps == (cfg.local_sgd.steps if sync_mode == "local-sgd" else 0)
    assert layout.ps_servers == (cfg.parameter_server.servers if sync_mode == "async" else 0)
    assert layout.diloco_group == (1 if sync_mode == "diloco" else 0)
    overrides = layout.to_overrides()
    assert overrides["parallel.sync_mode"] == sync_mode
    assert any(key.startswith("diloco.") for key in overrides) == (sync_mode == "diloco")
    assert (layout.dp, layout.recompute) == (world - layout.ps_servers, "none")
    assert layout.global_batch_size == cfg.batch.micro_batch_size * (1 if sync_mode == "async" else world)


def test_zero1_is_ddp_with_adamw_states_split_over_dp():
    """meshtrain's zero_stage 1 (DDP + ZeroRedundancyOptimizer): AdamW states 1/dp, DDP's buckets kept, and
    the updated parameters' broadcast after the step adds to DDP's gradient all-reduce."""
    from meshtrain.planner.cost import step_time
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.memory import PRECISIONS, memory_breakdown
    from meshtrain.planner.model_specs import preset

    model, hw, fw, prec = preset("gpt2-small"), get_hardware("H100"), FRAMEWORKS["meshtrain"], PRECISIONS["bf16"]
    z0, z1 = (Layout(dp=8, zero_stage=z, micro_batch_size=8) for z in (0, 1))
    m0, m1 = (memory_breakdown(model, L, hw, prec, fw) for L in (z0, z1))
    assert m1.optimizer == pytest.approx(m0.optimizer / 8) and m1.gradients == m0.gradients
    assert m1.buffers == m0.buffers > 0  # DDP's gradient bucket copy
    t0, t1 = (step_time(model, L, hw, prec, fw) for L in (z0, z1))
    assert t1.dp_comm > t0.dp_comm and t1.optimizer < t0.optimizer
