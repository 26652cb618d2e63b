"""Every numeric config key and CLI flag at its extremes: 0, negative, 1e-324 (rounds to 0), 5e-324 (the
smallest double), 1e400 (rounds to inf), nan, inf, 2**63, 2**64 + 1, and pairs of keys at once.

Each value is either refused before launch (exit code 2, one line ``meshtrain CMD: error: ...``, no file
written) or accepted (``train`` reaches torchrun's engine, replaced by a trap; ``plan``, ``batch``,
``generate``, ``export`` and the others answer with exit code 0); never a traceback, and never past
:data:`artefacts.LIMIT_S` seconds (the planner factors device counts and batches: 2**64 once took forever).
Config keys go through ``plan CONFIG`` and ``train CONFIG`` (config validation, the pre-launch checks); CLI
flags through their own subcommand on the session's artefacts. Hypothesis draws values in ``make test``; the
whole grid (every key or flag x every extreme) runs under ``make test-slow``.
"""

from __future__ import annotations

import re
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artefacts import run_cli_here

EXTREMES = ["0", "-1", "1e-324", "5e-324", "1e400", "-1e400", "nan", "inf", "-inf", str(2**63), str(2**64 + 1),
            str(-2**64), "1e308", "0.5"]


def numeric_keys() -> list[str]:
    """Every int or float key of the config, as ``section.key``."""
    from meshtrain.config.load import _field_types, _sections

    return [f"{section}.{key}" for section, cls in _sections().items()
            for key, typ in _field_types(cls).items() if typ in (int, float) or typing.get_args(typ) == (int,)]


KEYS = numeric_keys()
# (subcommand, argv before the flag, flag); {a} = the artefacts folder, {t} = this case's own folder
FLAGS = [
    *(("plan", ["plan", "--model", "gpt2-small", "--gpu", "A100-SXM-80GB", "--num-gpus", "8", "--global-batch-size",
                "8"], flag) for flag in ("--num-gpus", "--global-batch-size", "--global-batch-tokens", "--seq-len",
                                         "--dataset-samples", "--dataset-tokens", "--epochs", "--token-budget", "--top",
                                         "--devices-per-node", "--nics-per-node")),
    *(("batch", ["batch", "--world-size", "8", "--micro-batch-size", "2"], flag)
      for flag in ("--world-size", "--micro-batch-size", "--grad-accum", "--tp", "--pp", "--sp", "--seq-len",
                   "--num-samples", "--epochs", "--steps", "--time-per-step", "--lr", "--reference-batch-size",
                   "--loader-batch-size")),
    *(("generate", ["generate", "--checkpoint", "{a}/run", "--max-new-tokens", "2"], flag)
      for flag in ("--temperature", "--top-k", "--seed")),
    ("generate", ["generate", "--checkpoint", "{t}/missing"], "--max-new-tokens"),
    ("export", ["export", "--checkpoint", "{a}/run", "--format", "hf", "--out", "{t}/hf"], "--max-shard-mb"),
    *(("train", ["train", "{a}/config.toml", "--out", "{t}/out"], flag)
      for flag in ("--nproc", "--max-restarts", "--node-rank", "--steps", "--seed", "--dp", "--tp", "--pp", "--sp")),
    *(("prepare", ["prepare", "--tokenizer", "{a}/bpe/tokenizer.json", "--input", "{a}/corpus.txt", "--out", "{t}/p",
                   "--doc-split", "blank-line", "--workers", "1"], flag)
      for flag in ("--val-fraction", "--workers", "--shard-tokens")),
    *(("tokenizer", ["tokenizer", "train", "--input", "{a}/corpus.txt", "--vocab-size", "300", "--out",
                     "{t}/tok.json"], flag) for flag in ("--vocab-size", "--min-frequency")),
]


def assert_answers_or_refuses(argv: list[str], where) -> None:
    """``meshtrain ARGV`` in this process: accepted, or one line and exit 2 writing nothing; within the limit."""
    before = sorted(p.name for p in where.iterdir()) if where.exists() else []
    code, err, _ = run_cli_here(argv)
    assert code != "hang", f"HANG: {argv}"
    assert not str(code).startswith("traceback"), f"TRACEBACK {code}: {argv}"
    if code in (0, "launched"):
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and re.match(rf"meshtrain {argv[0]}( \w+)?: error: ", lines[0]), (argv, err)
    assert sorted(p.name for p in where.iterdir()) == before, f"WROTE: {argv}"


def config_argv(command: str, artefacts, tmp, overrides: dict[str, str]) -> list[str]:
    extra = [tok for key, value in overrides.items() for tok in (f"--{key}", value)]
    if command == "plan":
        return ["plan", str(artefacts / "config.toml"), *extra]
    return ["train", str(artefacts / "config.toml"), "--nproc", "1", "--out", str(tmp / "out"), *extra]


def flag_argv(base: list[str], flag: str, value: str, artefacts, tmp) -> list[str]:
    argv = [a.replace("{a}", str(artefacts)).replace("{t}", str(tmp)) for a in base]
    if flag in argv:  # the base gives it a valid value: replace that one
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]


values = st.one_of(st.sampled_from(EXTREMES), st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
fast = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@fast
@given(command=st.sampled_from(["plan", "train"]), pairs=st.dictionaries(st.sampled_from(KEYS), values,
                                                                         min_size=1, max_size=2))
def test_config_keys_at_extremes_are_refused_in_one_line_or_accepted(artefacts, tmp_path, command, pairs):
    assert_answers_or_refuses(config_argv(command, artefacts, tmp_path, pairs), tmp_path)


@fast
@given(case=st.sampled_from(FLAGS), value=values)
def test_cli_flags_at_extremes_are_refused_in_one_line_or_answered(artefacts, tmp_path, case, value):
    command, base, flag = case
    assert_answers_or_refuses(flag_argv(base, flag, value, artefacts, tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("key", KEYS)
def test_every_config_key_at_every_extreme(artefacts, tmp_path, key, command, value):
    assert_answers_or_refuses(config_argv(command, artefacts, tmp_path, {key: value}), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("case", FLAGS, ids=[f"{c}{f}" for c, _, f in FLAGS])
def test_every_cli_flag_at_every_extreme(artefacts, tmp_path, case, value):
    command, base, flag = case
    assert_answers_or_refuses(flag_argv(base, flag, value, artefacts, tmp_path), tmp_path)


def test_seeds_past_torchs_generator_are_config_errors(artefacts, tmp_path):
    """A seed torch's generator cannot take is one line before launch, not a crash in every rank."""
    for value, fragment in ((str(2**64), "train.seed = 18446744073709551616 must be in [0, 4294967295]"),
                            ("-1", "train.seed = -1 must be in [0, 4294967295]")):
        code, err, _ = run_cli_here(config_argv("train", artefacts, tmp_path, {"train.seed": value}))
        assert code == 2 and fragment in err, err
    code, err, _ = run_cli_here(["generate", "--checkpoint", str(artefacts / "run"), "--seed", str(2**64)])
    assert code == 2 and "--seed" in err, err
