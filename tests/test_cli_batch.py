"""``meshtrain batch`` as a user runs it: through the installed console script in a fresh process for a plan and a
refusal (:data:`SCRIPTED`), the other cases through the same entry point in this process (``conftest.cli_here``: a
process start costs more than the command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_here

SCRIPT = Path(sys.executable).with_name("meshtrain")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "meshtrain.cli"]


def meshtrain(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    """``meshtrain ARGS``: the console script in a fresh process (``script``), else in this process."""
    if script:
        return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=60)
    return cli_here(*args)


def batch_json(*args: str, script: bool = False) -> dict:
    result = meshtrain("batch", *args, "--json", script=script)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_json_has_the_whole_plan():
    # 16 ranks, tp 2, sp 2 -> dp 4; 4 * 3 * 2 = 24 samples/step; 1000 samples -> ceil(1000/24) = 42 steps.
    out = batch_json("--world-size", "16", "--tp", "2", "--sp", "2", "--micro-batch-size", "3",
                     "--grad-accum", "2", "--seq-len", "64", "--num-samples", "1000", "--epochs", "2",
                     "--time-per-step", "0.5", script=True)
    assert out["dp"] == 4
    assert out["global_batch_size"] == 24
    assert out["tokens_per_step"] == 24 * 64
    assert out["steps_per_epoch"] == 42
    assert out["micro_steps_per_epoch"] == 42 * 2
    assert out["total_steps"] == 84
    assert out["total_time_s"] == pytest.approx(84 * 0.5)


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_json_scales_the_learning_rate_with_the_global_batch(rule, factor):
    # 4 ranks x 12 samples = 48 = 4 x the reference batch of 12.
    out = batch_json("--world-size", "4", "--micro-batch-size", "12", "--lr", "1e-3", "--lr-scaling", rule,
                     "--reference-batch-size", "12")
    assert out["lr"] == pytest.approx(1e-3 * factor, rel=1e-12)


def test_json_diloco_workers_and_outer_steps():
    # 16 ranks, tp 2 -> dp 8, 4 * 8 = 32 samples per inner step; groups of 8 ranks -> 2 workers of 16 samples each;
    # 100 inner steps, H = 32 -> ceil(100 / 32) = 4 exchanges
    out = batch_json("--world-size", "16", "--tp", "2", "--micro-batch-size", "4", "--steps", "100",
                     "--diloco-group", "8", "--diloco-inner-steps", "32")
    assert (out["global_batch_size"], out["diloco_workers"], out["worker_batch_size"]) == (32, 2, 16)
    assert (out["diloco_inner_steps"], out["outer_steps"]) == (32, 4)
    refused = meshtrain("batch", "--world-size", "16", "--tp", "2", "--micro-batch-size", "4", "--diloco-group", "3")
    assert refused.returncode == 2 and "diloco_group = 3 must split world_size = 16" in refused.stderr


def test_json_sp_seed_example():
    out = batch_json("--world-size", "8", "--sp", "4", "--micro-batch-size", "1")
    assert (out["dp"], out["global_batch_size"]) == (2, 2)


def test_json_steps_instead_of_epochs():
    out = batch_json("--world-size", "2", "--micro-batch-size", "12", "--num-samples", "240", "--steps", "25")
    assert out["steps_per_epoch"] == 10
    assert out["total_steps"] == 25
    assert out["epochs"] == pytest.approx(2.5)


def test_json_open_sora_log_fields():
    out = batch_json("--world-size", "8", "--sp", "4", "--micro-batch-size", "1", "--loader-batch-size", "2",
                     "--num-samples", "1000")
    osl = out["open_sora_log"]
    assert osl["real_global_batch_size"] == out["global_batch_size"] == 2
    assert osl["logged_global_batch_size"] == 2 * 2  # a factor b = 2 too large
    assert osl["real_steps_per_epoch"] == out["steps_per_epoch"]


def test_table_names_dp_and_the_formula():
    result = meshtrain("batch", "--world-size", "8", "--tp", "2", "--micro-batch-size", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    dp_row = next(line for line in lines if line.strip("│┃ ").startswith("dp "))
    assert " 4 " in dp_row  # 8 / 2
    gbs_row = next(line for line in lines if "global_batch_size" in line)
    assert " 16 " in gbs_row  # 4 * 1 * 4


def test_table_with_loader_batch_size_explains_the_open_sora_log():
    result = meshtrain("batch", "--world-size", "8", "--sp", "4", "--micro-batch-size", "1",
                       "--loader-batch-size", "2", "--num-samples", "1000")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Its log would print global batch 4 (real 2) and 63 updates/epoch (real 500" in text
    assert "one loader step makes 8 optimizer step(s) of global batch 2" in text


BAD_LAYOUTS = [
    (["--world-size", "6", "--sp", "4", "--micro-batch-size", "1"], "world_size = 6 is not divisible"),
    (["--world-size", "4", "--micro-batch-size", "0"], "micro_batch_size = 0"),
    (["--world-size", "4", "--micro-batch-size", "1", "--epochs", "2"], "epochs needs num_samples"),
    (["--world-size", "4", "--micro-batch-size", "1", "--num-samples", "9", "--epochs", "1", "--steps", "3"],
     "not both"),
    (["--world-size", "8", "--sp", "4", "--micro-batch-size", "3", "--loader-batch-size", "1"],
     "not divisible by train_sp_batch_size = 3"),
    (["--world-size", "4", "--micro-batch-size", "1", "--lr-scaling", "linear", "--reference-batch-size", "2"],
     "give --lr too"),
    (["--world-size", "4", "--micro-batch-size", "1", "--lr", "1e-3", "--lr-scaling", "sqrt"],
     "optim.reference_batch_size = 0 both >= 1"),
    (["--world-size", "4", "--micro-batch-size", "1", "--lr", "-1"], "argument --lr: -1 must be a finite number > 0"),
]
SCRIPTED = (BAD_LAYOUTS[0][0], False)
"""The refusal (arguments, --json) that also runs through the console script in a fresh process."""


@pytest.mark.parametrize("args, message", BAD_LAYOUTS)
@pytest.mark.parametrize("as_json", [False, True])
def test_bad_layout_exits_2_with_one_line(args, message, as_json):
    result = meshtrain("batch", *args, *(["--json"] if as_json else []), script=(args, as_json) == SCRIPTED)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("meshtrain batch: error: ")
    assert message in lines[0]
    assert "Traceback" not in result.stderr
