"""``meshtrain plan`` options that were silently taken as something else (issue 58): each is now one line and exit
code 2 before anything runs, naming the value and what would be valid, and nothing is written.

- argparse's abbreviations are off on every parser of the CLI (``--ep 2`` was ``--epochs 2``);
- ``--measured``: a measurement no device can reach (in each unit: faster than the devices' peak, or outside the
  speed factors the planner fits), an MFU over 100%, a field or a measurement given twice, ``ep`` on a dense model;
- ``--calibrate-from`` a run on one kind of device (CPU, GPU) for a plan of the other;
- ``--stack`` with two options that set the same thing differently;
- a mode with options it would drop (``--validate FILE --calibrate machine``).

The cases are generated from the tables they come from (the CLI's options, :data:`MEASURED_KEYS`,
:data:`STACK_OPTIONS`, the layout fields), so a new option joins them by itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from pathlib import Path

import pytest

from meshtrain.cli.main import build_parser, main
from meshtrain.planner.actual import write_plan_vs_actual
from meshtrain.planner.stack import MEASURED_KEYS, STACK_OPTIONS, parse_stack

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "shakespeare_char.toml")
DENSE = ("--model", "llama3-8b", "--gpu", "H100-SXM-80GB", "--num-gpus", "64", "--global-batch-size", "512")
MOE = ("--model", "mixtral-8x7b", "--gpu", "H100-SXM-80GB", "--num-gpus", "64", "--global-batch-size", "512")
LAYOUT = "tp=8,pp=1,dp=8,micro_batch_size=2,gradient_accumulation_steps=32"


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, out: str, err: str, *needles: str) -> str:
    """The error line, after checking exit code 2, one line on stderr, nothing on stdout and each needle in it."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "" and "Traceback" not in err, (code, err[-2000:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Each case runs in an empty folder, which holds nothing after it but the run record a case made."""
    monkeypatch.chdir(tmp_path)
    yield
    assert {p.name for p in tmp_path.iterdir()} <= {"run"}, "a case wrote a file"


# --- abbreviations ---------------------------------------------------------------------------------------------

def _parsers(parser: argparse.ArgumentParser, name: str = "meshtrain"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_no_parser_of_the_cli_takes_an_abbreviation():
    """Every parser, a subcommand's own subparsers included (``tokenizer train``), takes whole option names only."""
    found = dict(_parsers(build_parser()))
    assert {"meshtrain plan", "meshtrain train", "meshtrain tokenizer train"} <= set(found)
    assert [name for name, p in found.items() if p.allow_abbrev] == []


PLAN_OPTIONS = sorted(o for a in dict(_parsers(build_parser()))["meshtrain plan"]._actions for o in a.option_strings
                      if o.startswith("--") and o != "--help")
PREFIXES = [(option, option[:n]) for option in PLAN_OPTIONS for n in (len(option) - 1, 4)
            if n >= 4 and option[:n] not in PLAN_OPTIONS]


@pytest.mark.parametrize("option, prefix", PREFIXES, ids=[p for _, p in PREFIXES])
def test_a_prefix_of_a_plan_option_is_not_that_option(capsys, option, prefix):
    """``--epoch 2`` is not ``--epochs 2``: an unknown flag (overrides follow a config), whose value argparse takes
    as the config."""
    one_line(*plan(capsys, *DENSE, prefix, "2"), f"'2' is the value of {prefix}, which is not an option of plan")


def test_ep_after_a_config_is_the_ep_override(capsys):
    """``--ep 2`` after a config is the ``parallel.ep`` override (it was ``--epochs 2``): refused for a dense model,
    planned for a mixture of experts."""
    one_line(*plan(capsys, CONFIG, "--ep", "2"), "parallel.ep = 2", "use ep = 1")
    code, out, err = plan(capsys, CONFIG, "--model.type", "mixtral", "--num-gpus", "2", "--ep", "2", "--top", "1")
    assert code == 0 and "Your config's layout: dp2 tp1 pp1 sp1 ep2" in out, err


# --- --measured ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", MEASURED_KEYS)
@pytest.mark.parametrize("scale", [1e-6, 1e6])
def test_an_impossible_measurement_is_refused_with_the_range_that_is_possible(capsys, key, scale):
    """A measurement far outside what the layout can reach (each unit, too fast and too slow) is one line naming the
    key, the value and the range this layout can take; a value in that range is then accepted."""
    typical = {"step_time_s": 10.0, "tokens_per_s": 4e5, "tokens_per_s_per_gpu": 6e3, "mfu_percent": 40.0}[key]
    value = typical * scale if key != "mfu_percent" or scale < 1 else 101.0
    line = one_line(*plan(capsys, *DENSE, "--measured", f"{LAYOUT},{key}={value:g}"), f"--measured {key} = ")
    if key == "mfu_percent" and value > 100:
        assert "give a value in (0, 100]" in line
        return
    low, high = (float(x) for x in re.search(rf"give {key} in ([\d.e+-]+)-([\d.e+-]+) ", line).groups())
    inside = math.sqrt(low * high)
    code, out, err = plan(capsys, *DENSE, "--measured", f"{LAYOUT},{key}={inside:.6g}", "--top", "1", "--json")
    assert code == 0, err


@pytest.mark.parametrize("field, value", [("tp", "8"), ("pp", "1"), ("dp", "8"), ("zero_stage", "1"),
                                          ("micro_batch_size", "2"), ("recompute", "full"), ("ep", "1")])
@pytest.mark.parametrize("flag", ["--measured", "--fix"])
def test_a_field_given_twice_is_refused(capsys, flag, field, value):
    text = f"{field}={value},{field}={value}" + (",step_time_s=10" if flag == "--measured" else "")
    one_line(*plan(capsys, *DENSE, flag, text), f"gives {field} twice")


@pytest.mark.parametrize("twice", [("step_time_s", "step_time_s"), ("step_time_s", "mfu_percent"),
                                   ("tokens_per_s", "tokens_per_s_per_gpu")])
def test_two_measurements_are_refused(capsys, twice):
    a, b = twice
    needle = f"gives {a} 2 times" if a == b else f"gives {a} and {b}"
    one_line(*plan(capsys, *DENSE, "--measured", f"tp=8,{a}=10,{b}=20"), needle, "give exactly one of")


@pytest.mark.parametrize("flag", ["--measured", "--fix"])
def test_ep_on_a_dense_model_is_refused_and_on_experts_taken(capsys, flag):
    suffix = ",step_time_s=10" if flag == "--measured" else ""
    one_line(*plan(capsys, *DENSE, flag, f"ep=2{suffix}"), f"{flag} ep = 2", "model 'llama3-8b' has none")
    code, out, err = plan(capsys, *MOE, flag, f"ep=8{suffix}", "--top", "1", "--json")
    assert code == 0 and json.loads(out)[0]["ep"] == 8, err


# --- --calibrate-from ------------------------------------------------------------------------------------------

def _record(folder: Path, **predicted) -> Path:
    """A run record measured at twice its prediction (compute only: a speed factor of 0.5)."""
    parts = {"compute": 1.0, "bubble": 0.0, "optimizer": 0.0, "dp_comm": 0.0, "total": 1.0}
    write_plan_vs_actual({"step_time_s": 1.0, "layout": "dp1", "time_breakdown_s": parts, **predicted},
                         {"step_time_s": 2.0}, folder)
    return folder


CPU_JOB = ("--model", "gpt2-small", "--gpu", "cpu", "--num-gpus", "1", "--global-batch-size", "8", "--seq-len", "64")
GPU_JOB = ("--model", "gpt2-small", "--gpu", "H100-SXM-80GB", "--num-gpus", "8", "--global-batch-size", "64")
RECORDS = {"device cpu": {"device": "cpu"}, "device cuda": {"device": "cuda"},
           "written before the device field, on a cpu": {"profile": "uncalibrated: the reference machine's cpu profile"},
           "written before the device field, on a GPU": {"profile": "catalog H100-SXM-80GB"}}


@pytest.mark.parametrize("record", RECORDS)
@pytest.mark.parametrize("job", ["cpu", "gpu"])
def test_a_run_calibrates_a_plan_of_its_own_kind_of_device_only(capsys, tmp_path, record, job):
    run = _record(tmp_path / "run", **RECORDS[record])
    ran_on = "cpu" if "cpu" in record else "gpu"
    code, out, err = plan(capsys, *(CPU_JOB if job == "cpu" else GPU_JOB), "--calibrate-from", str(run), "--top", "1",
                          "--json")
    if ran_on == job:
        assert code == 0 and json.loads(out)[0]["speed_factor"] == pytest.approx(0.5, rel=1e-3), err
    else:
        one_line(code, out, err, f"--calibrate-from {run}: its plan_vs_actual.json is of a run on a "
                                 f"{'CPU' if ran_on == 'cpu' else 'GPU'}", "calibrate from")


# --- --stack ---------------------------------------------------------------------------------------------------

PAIRS = list(itertools.combinations(STACK_OPTIONS, 2))


def _contradict(a: str, b: str) -> bool:
    return any(STACK_OPTIONS[b].get(k, v) != v for k, v in STACK_OPTIONS[a].items())


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_two_stack_options_that_contradict_are_refused(capsys, a, b):
    """Each pair of options: refused where both set the same field differently (flash+flash2), else combined."""
    code, out, err = plan(capsys, *GPU_JOB, "--stack", f"torchtitan+{a}+{b}", "--top", "1", "--json")
    if _contradict(a, b):
        one_line(code, out, err, f"options {a!r} and {b!r} contradict each other", "keep one of them")
    else:
        assert code == 0, err
        fw = parse_stack(f"torchtitan+{a}+{b}")[1]
        assert all(getattr(fw, k) == v for o in (a, b) for k, v in STACK_OPTIONS[o].items())
    assert any(_contradict(a, b) for a, b in PAIRS)  # the table has such pairs (the test would be empty else)


# --- modes and the options they would drop -----------------------------------------------------------------------

DROPPED = {"CONFIG": (CONFIG,), "--model": ("--model", "gpt2-small"), "--gpu": ("--gpu", "cpu"),
           "--num-gpus": ("--num-gpus", "2"), "--fix": ("--fix", "tp=2"), "--top": ("--top", "3"),
           "--explain": ("--explain", "tp=2"), "--stack": ("--stack", "torchtitan"),
           "--measured": ("--measured", "step_time_s=1"), "--calibrate-from": ("--calibrate-from", "run"),
           "--plot": ("--plot", "p.png")}


@pytest.mark.parametrize("option", [*DROPPED, "--validate", "--validate FILE", "--markdown"])
def test_calibrate_machine_takes_no_option_it_would_drop(capsys, tmp_path, option):
    """``--calibrate`` measures this machine (minutes) and saves a profile: with any option it would ignore
    (``--validate FILE`` most of all), it is one line and measures nothing, writes no profile."""
    profile = tmp_path / "p.toml"
    args = {"--validate": ("--validate",), "--validate FILE": ("--validate", "runs.toml"),
            "--markdown": ("--markdown",)}.get(option, DROPPED.get(option))
    line = one_line(*plan(capsys, "--calibrate", "--profile", str(profile), *args), "--calibrate measures this machine")
    assert option.split()[0] in line and not profile.exists()


@pytest.mark.parametrize("option", DROPPED)
def test_validate_takes_no_option_it_would_drop(capsys, option):
    one_line(*plan(capsys, "--validate", "runs.toml", *DROPPED[option]), "--validate predicts the runs of its file",
             option)


def test_markdown_and_one_per_source_go_with_validate(capsys):
    one_line(*plan(capsys, *DENSE, "--markdown"), "--markdown prints the table of --validate")
    one_line(*plan(capsys, *DENSE, "--calibrate", "one-per-source"), "goes with --validate")
