"""Stacks, calibration from one measured run, and ranges (``meshtrain.planner.stack``; issue 36, Sec. 2-4)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from meshtrain.cli.main import main
from meshtrain.config.load import read_toml
from meshtrain.errors import ConfigError
from meshtrain.planner import refit, stack
from meshtrain.planner.actual import write_plan_vs_actual
from meshtrain.planner.cost import step_time
from meshtrain.planner.hardware import get_hardware
from meshtrain.planner.layout import FRAMEWORKS, Layout
from meshtrain.planner.memory import PRECISIONS
from meshtrain.planner.model_specs import load_model
from meshtrain.planner.validate import PUBLISHED_RUNS, calibrate_one_per_source, fit_stacks, predict_run, validate_file
from tests.test_planner_validate import write_runs

ROOT = Path(__file__).resolve().parents[1]
H100 = get_hardware("H100-SXM-80GB")
BF16 = PRECISIONS["bf16"]
BISECTION = 1e-4
"""fit_speed stops when its log-interval is 1e-4 wide and returns the middle: |log s - log s0| <= 5e-5."""


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_speed_scales_compute_and_leaves_communication():
    """Every compute term is divided by the factor; tensor parallelism's collectives (Megatron-LM 2021 did not
    overlap them) are not."""
    model, fw = load_model("llama3-8b"), FRAMEWORKS["megatron-2021"]
    layout = Layout(dp=1, tp=8, micro_batch_size=1, gradient_accumulation_steps=4, recompute="full")
    base = step_time(model, layout, H100, PRECISIONS["fp16"], fw)
    fast = step_time(model, layout, stack.scaled(H100, 2.0), PRECISIONS["fp16"], fw)
    # identical arithmetic with every rate doubled: equal to float rounding (a few ulps over a sum of ~100 terms)
    assert fast.compute == pytest.approx(base.compute / 2, rel=1e-12)
    assert fast.optimizer == pytest.approx(base.optimizer / 2, rel=1e-12)
    assert fast.tp_comm == base.tp_comm > 0


@pytest.mark.parametrize("factor", [0.3, 0.77, 1.0, 1.9, 7.5])
@pytest.mark.parametrize("layout", [Layout(dp=8, micro_batch_size=2, zero_stage=3),
                                    Layout(dp=2, tp=4, micro_batch_size=1, gradient_accumulation_steps=8)])
def test_fit_speed_recovers_the_factor_a_measurement_was_made_at(factor, layout):
    model, fw = load_model("llama3-8b"), FRAMEWORKS["torchtitan"]

    def seconds(hw):
        return step_time(model, layout, hw, BF16, fw).total

    fitted = stack.fit_speed(seconds, H100, seconds(stack.scaled(H100, factor)))
    assert abs(math.log(fitted / factor)) <= BISECTION / 2 + 1e-12


def test_fit_speed_refuses_what_no_factor_reaches():
    model, layout, fw = load_model("llama3-8b"), Layout(dp=8, micro_batch_size=2, zero_stage=3), FRAMEWORKS["torchtitan"]

    def seconds(hw):
        return step_time(model, layout, hw, BF16, fw).total

    for measured in (seconds(H100) / 100, seconds(H100) * 100):
        with pytest.raises(ConfigError, match="outside what this layout can take"):
            stack.fit_speed(seconds, H100, measured)


@pytest.mark.parametrize("text, name", [("torchtitan", "torchtitan"), ("torchtitan+compile", "torchtitan+compile"),
                                        ("megatron-core+fused-ce+no-tp-comm-overlap",
                                         "megatron-core+fused-ce+no-tp-comm-overlap"),
                                        (" fsdp + flash + compile ", "fsdp+compile+flash"),
                                        ("torchtitan+flash2", "torchtitan+flash2"),
                                        ("megatron-core@nemo-24.09+fused-ce", "megatron-core@nemo-24.09+fused-ce"),
                                        (" megatron-core @ r0.8 ", "megatron-core@r0.8")])
def test_a_stack_is_a_framework_with_options(text, name):
    """A version changes no fact of the framework, only the stack's name (and so its fitted speed)."""
    got, fw = stack.parse_stack(text)
    assert got == name and fw.name == name
    options = name.split("+")[1:]
    base = FRAMEWORKS[name.split("+")[0].split("@")[0]]
    assert fw == replace(base, name=fw.name, **{k: v for o in options for k, v in stack.STACK_OPTIONS[o].items()})


@pytest.mark.parametrize("text, message", [("torchtitn", "unknown framework 'torchtitn'"),
                                           ("torchtitan+compiled", "unknown option 'compiled'"),
                                           ("megatron-core@", "version '' must be"),
                                           ("megatron-core@24 09", "version '24 09' must be"),
                                           ("megatronn@nemo-24.09", "unknown framework 'megatronn'")])
def test_a_bad_stack_is_named(text, message):
    with pytest.raises(ConfigError, match=message):
        stack.parse_stack(text)


@pytest.mark.parametrize("text, message", [("tp=8,pp=4", "has no measurement: give exactly one of"),
                                           ("tp=8,step_time_s=1,mfu_percent=40", "gives step_time_s and mfu_percent: give exactly one of"),
                                           ("tp=8,step_time_s=fast", "must be a number > 0"),
                                           ("tp=8,step_time_s=-2", "must be a number > 0"),
                                           ("tp=8,step_time_s=inf", "must be a number > 0")])
def test_a_bad_measurement_is_named(text, message):
    with pytest.raises(ConfigError, match=message):
        stack.parse_measured(text)


JOB = ("--model", "llama3-8b", "--gpu", "H100", "--num-gpus", "16", "--global-batch-size", "64")
LAYOUT = ("dp=8,tp=2,tp_sequence_parallel=true,pp=1,sp=1,zero_stage=3,micro_batch_size=2,gradient_accumulation_steps=4,"
          "recompute=selective")


@pytest.mark.parametrize("key, value", [("step_time_s", 7.5), ("tokens_per_s", 40000.0), ("mfu_percent", 33.0)])
def test_measured_run_calibrates_the_plan_to_itself(capsys, tmp_path, key, value):
    """``--measured LAYOUT,KEY=VALUE`` then ``--explain LAYOUT``: the layout is predicted at what it measured."""
    code, out, err = plan(capsys, *JOB, "--stack", "torchtitan", "--measured", f"{LAYOUT},{key}={value}",
                          "--explain", LAYOUT, "--json")
    assert code == 0, err
    e = json.loads(out)
    seconds = {"step_time_s": value, "tokens_per_s": e["tokens_per_step"] / value,
               "mfu_percent": e["step_time_s"] * e["mfu"] * 100 / value}[key]
    # the fit's bisection leaves |log s| within 5e-5, and the step time moves at most as much
    assert e["step_time_s"] == pytest.approx(seconds, rel=BISECTION)


def test_search_json_carries_ranges_and_their_basis(capsys, tmp_path):
    code, out, _ = plan(capsys, *JOB, "--stack", "torchtitan", "--token-budget", "1e9", "--top", "3", "--json")
    assert code == 0
    table = stack.load_stacks()
    fitted = table["stack"]["torchtitan/H100-SXM-80GB"]
    for e in json.loads(out):
        assert e["speed_factor"] == fitted["factor"] and e["step_time_error_range"] == [fitted["low"], fitted["high"]]
        low, high = e["step_time_range_s"]
        assert low == pytest.approx(e["step_time_s"] / (1 + fitted["high"])) and low < e["step_time_s"] < high
        assert e["total_time_range_s"] == pytest.approx([e["total_steps"] * low, e["total_steps"] * high])
        assert e["mfu_range"][0] < e["mfu"] < e["mfu_range"][1]
        m_low, m_high = e["memory_range_bytes"]
        assert m_low < e["memory_per_device_bytes"] < m_high
    # a stack no published run used: the pooled factor (1) and range
    code, out, _ = plan(capsys, *JOB, "--stack", "fsdp+compile", "--top", "1", "--json")
    best = json.loads(out)[0]
    assert best["speed_factor"] == 1.0 or "fsdp/H100-SXM-80GB" in table["stack"]


@pytest.mark.parametrize("args, message", [
    (("--stack", "torchtitan", "--framework", "fsdp"), "not both"),
    (("--measured", f"{LAYOUT},step_time_s=7", "--calibrate-from", "x"), "not both"),
    (("--calibrate-from", "no-such-run"), "no plan_vs_actual.json there"),
    (("--measured", "tp=3,step_time_s=7"), "--measured tp = 3: model.n_head = 32 is not divisible by parallel.tp = 3"),
    (("--measured", "pp=64,step_time_s=7"), "no valid layout"),
    (("--measured", f"{LAYOUT},step_time_s=1e-9"), "is faster than the devices' peak"),
])
def test_bad_calibration_arguments_are_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = plan(capsys, *JOB, *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_calibrate_one_per_source_needs_validate(capsys):
    code, _, err = plan(capsys, "--calibrate", "one-per-source")
    assert code == 2 and "goes with --validate" in err


def _run_record(tmp_path: Path, parts: dict[str, float], measured: float) -> Path:
    out = tmp_path / "run"
    write_plan_vs_actual({"step_time_s": sum(parts.values()), "layout": "dp1 tp1 pp1 sp1 z0 mbs12 ga1 none",
                          "time_breakdown_s": {**parts, "total": sum(parts.values())}},
                         {"step_time_s": measured}, out)
    return out


def test_calibrate_from_a_run_folder(capsys, tmp_path):
    """The factor at which the run's predicted compute, bubble and optimizer, divided by it, plus its communication
    make the measured time: (1.0 + 0.2 + 0.3) / (1.0 - 0.25) = 2."""
    parts = {"compute": 1.0, "bubble": 0.2, "optimizer": 0.3, "dp_comm": 0.25, "tp_comm": 0.0}
    run = _run_record(tmp_path, parts, 1.0)
    assert stack.run_dir_speed(run)[0] == pytest.approx(2.0, rel=1e-12)
    code, out, err = plan(capsys, *JOB, "--calibrate-from", str(run), "--top", "1", "--json")
    assert code == 0, err
    best = json.loads(out)[0]
    assert best["speed_factor"] == pytest.approx(2.0) and str(run) in best["basis"]
    # faster than its own communication: nothing to calibrate
    code, _, err = plan(capsys, *JOB, "--calibrate-from", str(_run_record(tmp_path / "b", parts, 0.2)))
    assert code == 2 and "not above the predicted communication" in err
    (run / "plan_vs_actual.json").write_text('{"predicted": {}}')
    code, _, err = plan(capsys, *JOB, "--calibrate-from", str(run))
    assert code == 2 and "'predicted.time_breakdown_s' = None must be a table of seconds" in err


def test_plan_vs_actual_says_whether_the_measurement_is_inside_the_range(tmp_path):
    predicted = {"step_time_s": 1.0, "peak_memory_bytes": 100.0,
                 "ranges": {"step_time_s": [0.8, 1.2], "peak_memory_bytes": [None, None]}}
    result = write_plan_vs_actual(predicted, {"step_time_s": 1.25, "peak_memory_bytes": 90.0}, tmp_path)
    assert result["inside_range"] == {"step_time_s": False, "peak_memory_bytes": None}
    result = write_plan_vs_actual(predicted, {"step_time_s": 0.8, "peak_memory_bytes": 90.0}, tmp_path)
    assert result["inside_range"]["step_time_s"] is True


SINGLE = {"source": "a single-GPU benchmark", "gpu": "H100-SXM-80GB", "num_gpus": 1,
          "model": {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 2048},
          "layout": {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 4,
                     "global_batch_size": 8, "recompute": "none", "zero_stage": 0}}


def test_one_run_calibrates_its_sources_other_runs(tmp_path):
    """Two single-GPU runs (no communication: step time is exactly proportional to 1 / speed) that both ran 1.3x
    slower than predicted: uncalibrated the second is 30% off, calibrated on the first it is exact to the bisection."""
    runs = [{**SINGLE, "name": "small"},
            {**SINGLE, "name": "wide", "model": {**SINGLE["model"], "hidden": 4096, "heads": 32}}]
    for run in runs:
        predicted = predict_run({**run, "measured": {"iteration_time_s": 1.0}})[1]["iteration_time_s"]
        run["measured"] = {"iteration_time_s": 1.3 * predicted}
    result = validate_file(write_runs(tmp_path / "runs.toml", *runs), calibrate=True)
    wide = next(r for r in result["runs"] if r["name"] == "wide")
    assert wide["relative_error"]["iteration_time_s"] == pytest.approx(1 / 1.3 - 1, rel=1e-9)
    assert abs(wide["calibrated_step_time_error"]) < BISECTION
    cal = result["calibrated"]
    assert cal["runs"] == 1 and cal["calibrated_on"]["a single-GPU benchmark"]["run"] == "small"
    assert cal["calibrated_on"]["a single-GPU benchmark"]["speed_factor"] == pytest.approx(1 / 1.3, rel=BISECTION)


def test_the_shipped_stack_table_is_the_fit_of_the_shipped_runs():
    """``data/stacks.toml`` is what ``python -m meshtrain.planner.refit`` writes from the shipped runs (4 decimals)."""
    runs = read_toml(PUBLISHED_RUNS, "validation file")["run"]
    fit, shipped = fit_stacks(runs, calibrated=calibrate_one_per_source(runs)), stack.load_stacks()
    assert shipped["stack"].keys() == fit["stack"].keys()
    for name, s in fit["stack"].items():
        for key in ("factor", "low", "high"):
            assert shipped["stack"][name][key] == pytest.approx(s[key], abs=5e-5), (name, key)
    for section in ("pooled", "calibrated", "memory"):
        for key in ("low", "high"):
            assert shipped[section][key] == pytest.approx(fit[section][key], abs=5e-5), (section, key)
    bench = ROOT / "bench" / "results" / "plan_vs_actual.json"
    if bench.is_file():
        assert shipped["cpu"]["low"] == pytest.approx(refit.cpu_spread(bench)["low"], abs=5e-5)
    # the held-out ranges cover what they claim on the runs they came from
    assert 0.5 < fit["pooled"]["coverage"] <= 1 and 0.5 < fit["calibrated"]["coverage"] <= 1


def test_a_runs_stack_sets_its_framework(tmp_path):
    """A validation run's ``stack`` is its framework with the options applied (compiled: fused element-wise kernels,
    so a shorter step than the eager count); with ``framework`` too it is one line."""
    llama = {**SINGLE["model"], "activation": "swiglu", "kv_heads": 4, "learned_positions": False}
    eager = {**SINGLE, "model": llama, "name": "eager", "stack": "torchtitan", "measured": {"iteration_time_s": 1.0}}
    compiled = {**eager, "name": "compiled", "stack": "torchtitan+compile"}
    assert predict_run(compiled)[1]["iteration_time_s"] < predict_run(eager)[1]["iteration_time_s"]
    with pytest.raises(ConfigError, match="not both"):
        predict_run({**eager, "framework": "fsdp"})


@pytest.mark.slow
def test_the_gpu_sweep_writes_runs_the_validation_reads(tmp_path):
    """``bench/gpu_sweep.py --smoke`` (tiny shapes on this CPU, ~20 s): its runs file is valid validation input whose
    measured step times are the runs' own summaries."""
    import subprocess
    import sys

    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_sweep.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, capture_output=True)
    runs = read_toml(tmp_path / "gpu_runs.toml", "runs")["run"]
    summaries = {r["name"]: r["summary"] for r in json.loads((tmp_path / "gpu_runs.json").read_text())["runs"]}
    assert len(runs) == 2 and {r["name"] for r in runs} == set(summaries)
    for run in runs:
        assert run["measured"]["iteration_time_s"] == summaries[run["name"]]["step_time_s"]
    result = validate_file(tmp_path / "gpu_runs.toml", cross=False)
    assert all(r["fits"] and r["predicted"]["iteration_time_s"] > 0 for r in result["runs"])
    assert len(json.loads((tmp_path / "gpu_gemm.json").read_text())["gemm"]) == 2 * 2 * 2


def test_flash_attention_2_runs_at_its_hopper_rate_and_at_the_gemm_rate_elsewhere():
    """FlashAttention-2 reaches 35% of an H100's peak (FlashAttention-3 paper, abstract), under the H100's GEMM rate;
    on the A100 (no ``flash2_efficiency``) it is the GEMM rate; FlashAttention in Triton is FlashAttention-2's rate / 1.8
    on both; a measured attention table wins over all."""
    from meshtrain.planner.hardware import FLASH2_HOPPER

    peak, gemm = H100.device.peak("bfloat16"), H100.device.matmul_flops("bfloat16", 4096)
    assert FLASH2_HOPPER * peak < gemm
    assert H100.device.attention_flops("bfloat16", 8192, 4096, "flash2") == FLASH2_HOPPER * peak
    assert H100.device.attention_flops("bfloat16", 8192, 4096, "flash") == gemm
    a100 = get_hardware("A100-SXM-80GB").device
    assert a100.attention_flops("bfloat16", 8192, 4096, "flash2") == a100.matmul_flops("bfloat16", 4096)
    from meshtrain.planner.hardware import FLASH_TRITON_SLOWDOWN

    triton = H100.device.attention_flops("bfloat16", 8192, 4096, "flash-triton")
    assert triton == pytest.approx(FLASH2_HOPPER * peak / FLASH_TRITON_SLOWDOWN, rel=1e-15)
    assert a100.attention_flops("bfloat16", 8192, 4096, "flash-triton") == pytest.approx(
        a100.matmul_flops("bfloat16", 4096) / FLASH_TRITON_SLOWDOWN, rel=1e-15)
    measured = replace(H100.device, attention_table={"bfloat16": [(1024, 1e14), (8192, 2e14)]})
    assert measured.attention_flops("bfloat16", 8192, 4096, "flash2") == 2e14
    assert stack.scaled(H100, 2.0).device.attention_flops("bfloat16", 8192, 4096, "flash2") == 2 * FLASH2_HOPPER * peak


def test_only_the_attention_time_follows_the_flash2_rate():
    """One GPU, no communication: the step with FlashAttention-2 at utilization u minus the step at the GEMM rate g is
    A * (1/u - 1/g) for the step's attention FLOPs A (over peak). Two utilizations give that ratio exactly, which holds
    only if the attention kernel's time, and nothing else, moved with the rate."""
    model = load_model("llama3-8b")
    layout = Layout(dp=1, micro_batch_size=1, gradient_accumulation_steps=2, recompute="full")
    fw = replace(FRAMEWORKS["fsdp"], attention="flash2")
    g = H100.device.matmul_efficiency

    def compute(u):
        hw = replace(H100, device=replace(H100.device, flash2_efficiency=u))
        return step_time(model, layout, hw, BF16, fw).compute

    at_gemm = step_time(model, layout, H100, BF16, replace(fw, attention="flash")).compute
    ratio = (compute(0.35) - at_gemm) / (compute(g / 2) - at_gemm)
    # sums of ~10 float terms: rounding far below 1e-9
    assert ratio == pytest.approx((1 / 0.35 - 1 / g) / (2 / g - 1 / g), rel=1e-9)
    assert compute(0.35) > at_gemm


def test_a_runs_attention_kernel_changes_its_framework_not_its_stack(tmp_path):
    """A validation run's ``attention`` is what its software version ran: FlashAttention-2 on the H100 is slower than
    the GEMM-rate kernel; the run's stack (and so the factor fitted for it) is unchanged; a kernel the model does not
    know is one line naming it."""
    from meshtrain.planner.validate import stack_of

    long = {**SINGLE, "model": {**SINGLE["model"], "seq_len": 8192}, "name": "long", "stack": "torchtitan",
            "measured": {"iteration_time_s": 1.0}}
    flash2 = {**long, "attention": "flash2"}
    assert predict_run(flash2)[1]["iteration_time_s"] > predict_run(long)[1]["iteration_time_s"]
    assert stack_of(flash2) == stack_of(long) == "torchtitan"
    with pytest.raises(ConfigError, match="attention 'flash3' is not one of flash, flash2, flash-triton, materialized"):
        predict_run({**long, "attention": "flash3"})


def test_a_version_has_its_own_speed_and_an_unknown_one_falls_back_to_its_framework():
    """A versioned stack with published runs gets their factor; an unknown version, or the framework without one, the
    framework's own; options on top do not change which (they have no runs of their own)."""
    table = {"stack": {"megatron-core/H100-SXM-80GB": {"factor": 0.99, "low": -0.1, "high": 0.1, "runs": 3,
                                                      "sources": 1},
                       "megatron-core@nemo-24.09/H100-SXM-80GB": {"factor": 1.31, "low": -0.05, "high": 0.08, "runs": 6,
                                                                 "sources": 1}},
             "pooled": {"low": -0.2, "high": 0.3}}
    assert stack.speed_for("megatron-core@nemo-24.09", "H100-SXM-80GB", table).factor == 1.31
    assert stack.speed_for("megatron-core@nemo-24.09+fused-ce", "H200-SXM-141GB", table).factor == 1.31
    assert stack.speed_for("megatron-core@nemo-25.04", "H100-SXM-80GB", table).factor == 0.99
    assert stack.speed_for("megatron-core+fused-ce", "H100-SXM-80GB", table).factor == 0.99
    assert stack.speed_for("torchtitan@x", "H100-SXM-80GB", table).basis.endswith("pooled range")


@pytest.mark.parametrize("compile_mode, device, name", [("auto", "cuda", "meshtrain+compile"), ("off", "cuda", "meshtrain"),
                                                        ("auto", "cpu", "meshtrain"), ("on", "cpu", "meshtrain+compile")])
def test_the_trainer_as_configured_is_its_stack(compile_mode, device, name):
    """``meshtrain_framework``: a config whose blocks compile (``train.compile`` "on", or "auto" on CUDA) is the stack
    ``meshtrain+compile``, so the plan of a compiled run (plan vs actual, ``--layout auto``, ``plan CONFIG``) takes the
    compiled runs' fitted speed; its element-wise kernels are the fused ones, the eager count where not compiled."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.layout import meshtrain_framework

    config = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
    fw = meshtrain_framework(load_config(config, {"train.compile": compile_mode}), device)
    assert fw.name == name and (fw.eager_elementwise is None) == name.endswith("+compile")
    table = stack.load_stacks()["stack"]
    assert stack.speed_for(fw.name, "H100-SXM-80GB").factor == table[f"{name}/H100-SXM-80GB"]["factor"]
