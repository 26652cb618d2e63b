"""``train.check_memory``: a layout that fits is never refused. Over the available memory by less than the
planner's largest measured memory error it warns (saying by how much); by more, it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError
from meshtrain.launch import checks
from meshtrain.resolved import ResolvedRun

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
GiB = 2**30


def test_verdict_bands():
    assert checks.memory_verdict(9 * GiB, 10 * GiB, 0.2) == "fits"
    assert checks.memory_verdict(10 * GiB, 10 * GiB, 0.2) == "fits"
    assert checks.memory_verdict(11 * GiB, 10 * GiB, 0.2) == "uncertain"
    assert checks.memory_verdict(12 * GiB, 10 * GiB, 0.2) == "uncertain"
    assert checks.memory_verdict(12.1 * GiB, 10 * GiB, 0.2) == "over"
    assert checks.memory_verdict(math.nan, 10 * GiB, 0.2) == "fits"  # unknown GPU: never refused


def test_margin_is_the_largest_measured_error():
    # The CPU bench's worst row (-18.3%), and on a GPU at least that: the published runs may add more.
    assert checks.memory_margin("CPU (MemAvailable)") == pytest.approx(0.183)
    assert checks.memory_margin("GPU") >= checks.CPU_MEMORY_ERROR
    assert checks.published_memory_error() >= 0


def test_cpu_margin_covers_the_benchmark():
    """The constant is the bench's worst memory error: re-running bench/plan_vs_actual.py with a worse row
    must update it (docs/planner.md, "Plan vs actual on this machine")."""
    import json

    results = Path(__file__).resolve().parents[1] / "bench" / "results" / "plan_vs_actual.json"
    if not results.is_file():
        pytest.skip("no bench results in this checkout")
    worst = max(v["max_abs_error"] for v in json.loads(results.read_text())["summary"]["peak_memory_bytes"].values())
    assert checks.CPU_MEMORY_ERROR >= round(worst, 3), f"update CPU_MEMORY_ERROR to {worst:.3f}"


@pytest.fixture
def fake_node(monkeypatch):
    """check_memory with a chosen prediction (bytes per rank) and 10 GiB of CPU memory."""
    import meshtrain.planner.actual as actual

    def use(peak: float) -> None:
        monkeypatch.setattr(checks, "available_memory", lambda: ("CPU (MemAvailable)", 10 * GiB))
        monkeypatch.setattr(actual, "predict_for_run", lambda *a, **k: {"peak_memory_bytes": peak})
    return use


def test_a_run_within_the_error_warns_and_runs(fake_node, capsys):
    fake_node(5.5 * GiB)  # 2 ranks x 5.5 = 11 GiB on 10: 10% over, inside the 18% margin
    checks.check_memory(ResolvedRun.resolve(load_config(CONFIG), 2), nproc=2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err
    assert "over by 1.00 GiB (10%)" in err and "(18%)" in err and "may still fit" in err


def test_a_run_beyond_the_error_is_refused_with_the_overshoot(fake_node):
    fake_node(7 * GiB)  # 14 GiB on 10: 40% over
    with pytest.raises(ConfigError) as info:
        checks.check_memory(ResolvedRun.resolve(load_config(CONFIG), 2), nproc=2)
    message = str(info.value)
    assert "\n" not in message and "over by 4.00 GiB (40%)" in message
    assert "largest measured memory error (18%)" in message and "--train.check_memory false" in message


def test_a_run_that_fits_is_silent(fake_node, capsys):
    fake_node(4 * GiB)
    checks.check_memory(ResolvedRun.resolve(load_config(CONFIG), 2), nproc=2)
    assert capsys.readouterr().err == ""
