"""Config loading, CLI overrides and validation (meshtrain.config); no process group needed."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from meshtrain.config.checks import resolve_world, validate
from meshtrain.config.load import load_config, parse_overrides, set_key
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError

SHAKESPEARE = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- the main job config ------------------------------------------------------------------------------

def test_shakespeare_char_has_the_issue_values():
    cfg = load_config(SHAKESPEARE)
    m, p, b, o, t, c = cfg.model, cfg.parallel, cfg.batch, cfg.optim, cfg.train, cfg.checkpoint
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout) == (4, 4, 128, 64, 0.0)
    assert p.dp == -1 and (p.tp, p.pp, p.sp) == (1, 1, 1)
    assert (b.micro_batch_size, b.gradient_accumulation_steps) == (12, 1)
    assert (o.lr, o.min_lr, o.warmup_steps, o.weight_decay, o.grad_clip, o.beta2) == (1e-3, 1e-4, 100, 0.1, 1.0, 0.99)
    assert (t.steps, t.eval_interval, t.eval_steps, t.log_interval) == (2000, 250, 20, 10)
    assert t.out_dir == "runs/shakespeare_char"
    assert (c.interval, c.keep) == (500, 2)


def test_shakespeare_char_spells_out_every_key_of_every_section():
    written = tomllib.loads(SHAKESPEARE.read_text())
    for section in dataclasses.fields(Config):
        keys = {f.name for f in dataclasses.fields(getattr(Config(), section.name))}
        assert set(written.get(section.name, {})) == keys, section.name


def test_shakespeare_char_dp_fills_two_ranks_to_global_batch_24():
    from meshtrain.batch_math import plan_batch

    cfg = load_config(SHAKESPEARE)
    world, dp = resolve_world(cfg, 2)
    plan = plan_batch(world, cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps,
                      seq_len=cfg.model.block_size)
    assert (dp, plan.global_batch_size, plan.tokens_per_step) == (2, 24, 24 * 64)


# --- overrides and type coercion --------------------------------------------------------------------

@pytest.mark.parametrize("dotted, text, expected", [
    ("parallel.dp", "2", 2),
    ("parallel.zero_stage", " 3 ", 3),
    ("optim.lr", "3e-4", 3e-4),
    ("optim.weight_decay", "0", 0.0),
    ("parallel.tp_sequence_parallel", "false", False),
    ("train.dtype", "bfloat16", "bfloat16"),
    ("data.path", "", ""),
])
def test_set_key_coerces_cli_strings(dotted, text, expected):
    cfg = Config()
    set_key(cfg, dotted, text)
    section, key = dotted.split(".")
    value = getattr(getattr(cfg, section), key)
    assert value == expected and type(value) is type(expected)


def test_toml_is_typed_a_quoted_number_is_an_error_on_the_command_line_it_is_text(tmp_path):
    path = tmp_path / "quoted.toml"
    path.write_text('[model]\nn_layer = "4"\n')
    assert "model.n_layer = '4' is a string but must be a int" in error_of(load_config, path)
    assert load_config(None, {"model.n_layer": "4"}).model.n_layer == 4


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_refused_in_toml_and_on_the_command_line(tmp_path, literal):
    path = tmp_path / "lr.toml"
    path.write_text(f"[optim]\nlr = {literal}\n")
    assert f"optim.lr = {float(literal)} must be a finite number" in error_of(load_config, path)
    assert f"optim.lr = {float(literal)} must be a finite number" in error_of(load_config, None, {"optim.lr": literal})


def test_set_key_turns_toml_int_into_float():
    cfg = Config()
    set_key(cfg, "optim.grad_clip", 2)
    assert cfg.optim.grad_clip == 2.0 and isinstance(cfg.optim.grad_clip, float)


def test_overrides_apply_after_the_file():
    cfg = load_config(SHAKESPEARE, overrides={"parallel.zero_stage": "3", "train.dtype": "bfloat16",
                                              "train.steps": "60", "optim.warmup_steps": "10"})
    assert (cfg.parallel.zero_stage, cfg.train.dtype, cfg.train.steps, cfg.optim.warmup_steps) == \
        (3, "bfloat16", 60, 10)
    assert cfg.model.n_embd == 128  # untouched keys keep the file's values


def test_short_run_of_the_main_config_is_valid():
    # bench/bench_train.py and quick checks run the main config for a few dozen steps, inside its LR warmup.
    cfg = load_config(SHAKESPEARE, overrides={"train.steps": "20"})
    assert cfg.train.steps == 20 and cfg.optim.warmup_steps == 100


def test_parse_overrides_reads_long_short_and_equals_forms():
    tokens = ["--parallel.zero_stage", "3", "--train.dtype=bfloat16", "--steps", "60", "--dp", "2",
              "--out", "runs/x", "--optim.min_lr", "-0"]
    assert parse_overrides(tokens) == {"parallel.zero_stage": "3", "train.dtype": "bfloat16", "train.steps": "60",
                                       "parallel.dp": "2", "train.out_dir": "runs/x", "optim.min_lr": "-0"}


@pytest.mark.parametrize("tokens, message", [
    (["--stpes", "10"], "unknown option --stpes: did you mean 'steps'?"),
    (["--parallel.dp"], "--parallel.dp needs a value"),
    (["--parallel.dp", "--steps", "3"], "--parallel.dp needs a value"),
    (["2"], "unexpected argument '2'"),
])
def test_parse_overrides_rejects_malformed_flags(tokens, message):
    assert message in error_of(parse_overrides, tokens)


# --- bad configs: each message names the key ---------------------------------------------------------

# (key, TOML literal, text that must be in the message). Each is tried as a file and as a CLI override.
BAD_VALUES = [
    ("model.n_embd", "130", "model.n_embd = 130 must be divisible by model.n_head = 4"),
    ("model.n_layer", "0", "model.n_layer = 0 must be >= 1"),
    ("model.dropout", "1.0", "model.dropout = 1.0 must be in [0, 1)"),
    ("model.type", '"rnn"', "model.type = 'rnn' is not supported"),
    ("model.n_layers", "4", "unknown config key 'model.n_layers': did you mean 'n_layer'?"),
    ("parallel.zero_stage", "5", "parallel.zero_stage = 5 is not supported: use one of 0, 1, 2, 3"),
    ("parallel.tp", "3", "model.n_head = 4 is not divisible by parallel.tp = 3"),
    ("parallel.pp", "2", "batch.gradient_accumulation_steps = 1 is below pp = 2: pp_schedule = '1f1b' needs"),
    ("parallel.pp_schedule", '"pipedream"', "parallel.pp_schedule = 'pipedream' is not valid: use one of"),
    ("parallel.virtual_stages", "0", "parallel.virtual_stages = 0 must be >= 1"),
    ("parallel.sp", "3", "model.n_head = 4 is not divisible by tp*sp = 3: Ulysses"),
    ("parallel.sp_mode", '"zigzag"', "parallel.sp_mode = 'zigzag' is not valid: use one of ulysses, ring"),
    ("parallel.tp_sequence_parallel", "true", "parallel.tp_sequence_parallel = true needs parallel.tp > 1"),
    ("parallel.pp", "0", "parallel.pp = 0 must be >= 1"),
    ("parallel.dp", "0", "parallel.dp = 0 must be >= 1, or -1"),
    ("batch.micro_batch_size", '"twelve"', "batch.micro_batch_size = 'twelve' is"),
    ("batch.gradient_accumulation_steps", "0", "batch.gradient_accumulation_steps = 0 must be >= 1"),
    ("optim.min_lr", "0.01", "optim.min_lr = 0.01 must be in [0, optim.lr = 0.001]"),
    ("optim.lr", '"fast"', "optim.lr = 'fast' is"),
    ("optim.beta2", "1.0", "optim.beta2 = 1.0 must be in [0, 1)"),
    ("train.dtype", '"float16"', "train.dtype = 'float16' is not valid: use one of auto, float32, bfloat16"),
    ("train.log_interval", "0", "train.log_interval = 0 must be >= 1"),
    ("data.val_fraction", "1.5", "data.val_fraction = 1.5 must be in (0, 1)"),
    ("checkpoint.keep", "0", "checkpoint.keep = 0 must be >= 1"),
    ("parallel.tp_sequence_parallel", '"maybe"', "parallel.tp_sequence_parallel = 'maybe' is"),
    ("modle.n_layer", "4", "unknown config section 'modle': did you mean 'model'?"),
    ("optim.lr_scaling", '"cubic"', "optim.lr_scaling = 'cubic' is not valid: use one of none, linear, sqrt"),
    ("optim.lr_scaling", '"linear"', "optim.lr_scaling = 'linear' needs optim.reference_batch_size >= 1"),
    ("optim.reference_batch_size", "-4", "optim.reference_batch_size = -4 must be >= 0"),
    ("model.tbptt_steps", "16", "model.tbptt_steps = 16 applies to model.type = 'lstm' or 'gru' only"),
    ("model.activation", '"relu"', "model.activation = 'relu' is not valid: use one of gelu, gelu_tanh"),
    ("model.norm_eps", "1.5", "model.norm_eps = 1.5 must be in (0, 1)"),
]


@pytest.mark.parametrize("model_type", ["llama", "lstm", "gru"])
@pytest.mark.parametrize("dotted, value, message", [
    ("model.bias", "true", "model.bias = true applies to model.type = 'gpt' only: use false"),
    ("model.activation", "gelu_tanh", "model.activation = 'gelu_tanh' applies to model.type = 'gpt' only: use 'gelu'"),
])
def test_gpt_only_keys_name_the_model_type(model_type, dotted, value, message):
    assert message in error_of(load_config, overrides={"model.type": model_type, dotted: value})


def test_resume_checks_the_gpt_biases(tmp_path):
    """A GPT checkpoint's parameters include biases only with model.bias: resuming it with the other value is
    refused before DCP meets missing keys; a checkpoint from before the key has no biases."""
    from meshtrain.preflight import check_same_model

    cfg = load_config(None, {"model.bias": "true"})
    old = {"config": {"model": {k: getattr(cfg.model, k) for k in ("type", "n_layer", "n_embd", "n_head", "block_size")}},
           "tokenizer": {}}
    assert "holds a model with model.bias = False, this config has True: resume it with --model.bias False" in \
        error_of(check_same_model, cfg, old, {}, tmp_path)
    check_same_model(load_config(None), old, {}, tmp_path)


def _as_toml(dotted: str, literal: str) -> str:
    section, key = dotted.split(".")
    return f"[{section}]\n{key} = {literal}\n"


@pytest.mark.parametrize("dotted, literal, message", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
def test_bad_value_in_toml_names_the_key(tmp_path, dotted, literal, message):
    path = tmp_path / "bad.toml"
    path.write_text(_as_toml(dotted, literal))
    assert message in error_of(load_config, path)


@pytest.mark.parametrize("dotted, literal, message", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
def test_bad_value_as_override_names_the_key(dotted, literal, message):
    assert message in error_of(load_config, SHAKESPEARE, overrides={dotted: literal.strip('"')})


@pytest.mark.parametrize("dotted, literal, type_name", [
    ("parallel.dp", "true", "int"),
    ("train.dtype", "16", "str"),
    ("optim.lr", "[1e-3]", "float"),
    ("parallel.tp_sequence_parallel", "1", "bool"),
])
def test_wrong_toml_type_names_key_and_type(tmp_path, dotted, literal, type_name):
    path = tmp_path / "bad.toml"
    path.write_text(_as_toml(dotted, literal))
    message = error_of(load_config, path)
    assert message.startswith(f"{dotted} = ") and f"is not a valid {type_name}" in message


def test_missing_data_path_names_the_key(tmp_path):
    missing = tmp_path / "no_such_corpus.txt"
    path = tmp_path / "bad.toml"
    path.write_text(f"[data]\npath = '{missing}'\n")
    for message in (error_of(load_config, path), error_of(load_config, overrides={"data.path": str(missing)})):
        assert message.startswith(f"data.path = '{missing}' does not exist")


def test_invalid_toml_file_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[model]\nn_layer = = 4\n")
    message = error_of(load_config, path)
    assert f"config file '{path}' is not valid TOML" in message


def test_missing_config_file_names_the_file(tmp_path):
    assert f"config file '{tmp_path / 'nope.toml'}' does not exist" in error_of(load_config, tmp_path / "nope.toml")


def test_top_level_key_outside_a_section_is_rejected(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("steps = 10\n")
    assert "'steps'" in error_of(load_config, path) and "[section] table" in error_of(load_config, path)


def test_key_without_a_section_is_rejected():
    assert "'n_layer' is not a config key: use section.key" in error_of(set_key, Config(), "n_layer", "4")


def test_validate_accepts_the_defaults_and_returns_the_config():
    cfg = Config()
    assert validate(cfg) is cfg


# --- resolve_world -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dp, nproc, expected", [(-1, 2, (2, 2)), (-1, None, (1, 1)), (2, 2, (2, 2)),
                                                  (3, None, (3, 3))])
def test_resolve_world(dp, nproc, expected):
    cfg = Config()
    cfg.parallel.dp = dp
    assert resolve_world(cfg, nproc) == expected


def test_resolve_world_dp_fills_what_sp_leaves():
    cfg = Config()  # resolve_world needs no validate(), so a future sp layout can be checked already
    cfg.parallel.sp = 2
    assert resolve_world(cfg, 8) == (8, 4)


def test_resolve_world_nproc_not_divisible():
    cfg = Config()
    cfg.parallel.sp, cfg.parallel.tp = 2, 2
    message = error_of(resolve_world, cfg, 6)
    assert "--nproc = 6 is not divisible by pp*sp*tp = 4" in message


def test_resolve_world_dp_mismatch_names_both_values():
    cfg = Config()
    cfg.parallel.dp = 3
    message = error_of(resolve_world, cfg, 2)
    assert "parallel.dp = 3" in message and "--nproc = 2" in message and "dp = 2" in message


def test_resolve_world_rejects_zero_ranks():
    assert "--nproc = 0 must be >= 1" in error_of(resolve_world, Config(), 0)


# Layout rules that involve several keys (tensor and sequence parallelism), each one line naming the values.
LAYOUT_ERRORS = [
    ({"parallel.sp": "2", "parallel.sp_mode": "ring", "model.block_size": "6"},
     "model.block_size = 6 is not divisible by sp * 2 (ring chunks) = 4"),
    ({"parallel.sp": "2", "model.block_size": "9"}, "model.block_size = 9 is not divisible by sp = 2"),
    ({"parallel.tp": "2", "parallel.tp_sequence_parallel": "true", "parallel.sp": "2", "model.block_size": "10"},
     "model.block_size = 10 is not divisible by sp * tp (tp_sequence_parallel) = 4"),
    ({"parallel.sp": "4", "parallel.tp": "2", "model.n_head": "4"}, "model.n_head = 4 is not divisible by tp*sp = 8"),
    ({"parallel.sp": "2", "parallel.sp_mode": "ring", "model.dropout": "0.1"},
     "model.dropout = 0.1 is not supported with parallel.sp_mode = 'ring'"),
]


@pytest.mark.parametrize("overrides, message", LAYOUT_ERRORS, ids=[m.split(":")[0][:40] for _, m in LAYOUT_ERRORS])
def test_bad_layouts_are_one_line_errors(overrides, message):
    text = error_of(load_config, None, overrides)
    assert message in text and "\n" not in text


@pytest.mark.parametrize("overrides", [
    {"parallel.tp": "4", "parallel.tp_sequence_parallel": "true"},
    {"parallel.sp": "4", "parallel.sp_mode": "ring", "model.n_head": "3", "model.n_embd": "12", "model.block_size": "8"},
    {"parallel.sp": "2", "parallel.tp": "2", "model.block_size": "4"},
], ids=["tp4-seqpar", "ring-any-heads", "ulysses-x-tp"])
def test_valid_tp_sp_layouts_are_accepted(overrides):
    load_config(None, overrides)


def test_a_home_relative_out_and_resume_are_the_users_home(tmp_path, monkeypatch):
    """``--out '~/run'`` (quoted, so the shell leaves the tilde) names ``$HOME/run`` for everything that uses it: the
    config holds the expanded path, as for data.path and model.init_from (the run lock expanded it and the ranks did
    not, so a run wrote ``./~/run`` while holding the lock of ``$HOME/run``); so does checkpoint.resume."""
    from meshtrain import runlock

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, {"train.out_dir": "~/run", "checkpoint.resume": "~/old"})
    assert cfg.train.out_dir == str(tmp_path / "run") and cfg.checkpoint.resume == str(tmp_path / "old")
    lock = runlock.hold(cfg.train.out_dir)
    try:
        assert (tmp_path / "run").is_dir() and not (Path.cwd() / "~").exists()
    finally:
        lock.release()
    assert load_config(None, {"checkpoint.resume": "@out"}).checkpoint.resume == "@out"


def test_a_config_file_larger_than_any_config_is_refused_before_it_is_read_whole(tmp_path):
    """``read_toml`` reads at most ``MAX_TOML_BYTES`` + 1 bytes: a file past the bound (a log or a dataset given as the
    config) is one line, not a parse of gigabytes; a file at the bound is still parsed (and refused as TOML)."""
    from meshtrain.config.load import MAX_TOML_BYTES, load_config
    from meshtrain.errors import ConfigError

    big, edge = tmp_path / "big.toml", tmp_path / "edge.toml"
    big.write_bytes(b"#" * (MAX_TOML_BYTES + 1))
    edge.write_bytes(b"x" * MAX_TOML_BYTES)
    with pytest.raises(ConfigError, match=r"is larger than 16 MiB, far more than a TOML config") as error:
        load_config(big)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(edge)
