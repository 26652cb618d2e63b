"""``meshtrain plan --validate``: which measured fields a run may give, and the errors for the others."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meshtrain.cli.main import main
from meshtrain.errors import ConfigError
from meshtrain.planner.validate import PREDICTABLE, validate_file

# "mosaicml-mpt-a100-7B" of the shipped published_runs.toml without its measured table.
MPT_A100 = {
    "name": "mosaicml-mpt-a100-7B",
    "source": "mosaicml/llm-foundry scripts/train/benchmarking/README.md",
    "gpu": "A100-SXM-80GB",
    "num_gpus": 8,
    "model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 50368, "seq_len": 2048},
    "layout": {"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 6, "gradient_accumulation_steps": 2,
               "global_batch_size": 96, "recompute": "none", "zero_stage": 3},
}
TOKENS_PER_S_PER_GPU = 4641  # its published measurement
TOKENS_PER_STEP = MPT_A100["layout"]["global_batch_size"] * MPT_A100["model"]["seq_len"]


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value) if isinstance(value, str | bool) else repr(value)


def write_runs(path: Path, *runs: dict[str, Any]) -> Path:
    """A validation file with one ``[[run]]`` table per dict."""
    tables = ["[[run]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in run.items()) for run in runs]
    path.write_text("\n".join(tables))
    return path


def run_with(name: str, **measured: Any) -> dict[str, Any]:
    return {**MPT_A100, "name": name, "measured": measured}


def test_iteration_time_is_predicted_in_sample_and_held_out(tmp_path):
    # Two views of one measurement: seconds per step, and tokens/s per GPU (the same run and layout), at 0.8 of the
    # published throughput, so that the catalog's prediction is well off it (~20%) whatever its constants.
    tokens_per_s_per_gpu = 0.8 * TOKENS_PER_S_PER_GPU
    seconds = TOKENS_PER_STEP / (tokens_per_s_per_gpu * MPT_A100["num_gpus"])
    path = write_runs(tmp_path / "runs.toml", run_with("time", iteration_time_s=seconds),
                      run_with("tokens", tokens_per_s_per_gpu=tokens_per_s_per_gpu))
    result = validate_file(path, profile=tmp_path / "none.toml")
    time_run, tokens_run = result["runs"]
    assert time_run["predicted"].keys() == time_run["measured"].keys() == {"iteration_time_s"}
    predicted = time_run["predicted"]["iteration_time_s"]
    assert math.isfinite(predicted) and predicted > 0
    assert time_run["layout"] == tokens_run["layout"]
    tokens_per_s = tokens_run["predicted"]["tokens_per_s_per_gpu"] * MPT_A100["num_gpus"]
    assert predicted == pytest.approx(TOKENS_PER_STEP / tokens_per_s, rel=1e-9)
    err = time_run["relative_error"]["iteration_time_s"]
    assert err == pytest.approx((predicted - seconds) / seconds, rel=1e-12)
    # a time is the inverse of a throughput: 1 + e_time = 1 / (1 + e_tokens)
    assert 1 + err == pytest.approx(1 / (1 + tokens_run["relative_error"]["tokens_per_s_per_gpu"]), rel=1e-9)
    assert result["median_abs_error"] is not None and math.isfinite(result["max_abs_error"])
    # Held out, each run gets the efficiency fitted on the other; both describe the same measurement,
    # so the fit must land on it (a time ratio taken the wrong way round moves the efficiency away).
    held_out = [r["leave_one_out_relative_error"] for r in result["runs"]]
    assert held_out[0].keys() == {"iteration_time_s"} and held_out[1].keys() == {"tokens_per_s_per_gpu"}
    assert abs(held_out[0]["iteration_time_s"]) < 1e-3 and abs(held_out[1]["tokens_per_s_per_gpu"]) < 1e-3
    assert abs(err) > 0.1  # the held-out errors are small because of the fit, not by chance


@pytest.mark.parametrize("measured, words", [
    ({"iteration_time_s": 5.0, "step_time": 5.0}, ["'step_time'", "cannot be predicted"]),
    ({"foo": 1.0, "bar": 2.0}, ["'foo', 'bar'", "cannot be predicted"]),
    ({}, ["no field"]),
    ({"tflops_per_gpu_kind": "hardware"}, ["no field"]),
])
def test_unpredictable_measured_fields_are_one_line_errors(tmp_path, measured, words):
    path = write_runs(tmp_path / "runs.toml", run_with("x", **measured))
    with pytest.raises(ConfigError) as info:
        validate_file(path, profile=tmp_path / "none.toml")
    message = str(info.value)
    assert "\n" not in message and message.startswith("run 'x': ")
    assert all(w in message for w in words), message
    assert message.endswith("use any of tflops_per_gpu, percent_of_peak, mfu_percent, tokens_per_s_per_gpu, "
                            "iteration_time_s, peak_memory_gib")


@pytest.mark.parametrize("measured, words", [
    ({"iteration_time_s": 0}, ["iteration_time_s = 0", "> 0"]),
    ({"iteration_time_s": "5.2"}, ["iteration_time_s = '5.2'", "> 0"]),
    ({"tflops_per_gpu": 137, "tflops_per_gpu_kind": "hw"}, ["'hw'", "model, hardware"]),
    ({"out_of_memory": False}, ["out_of_memory = False", "must be true"]),
    ({"out_of_memory": "yes", "tokens_per_s_per_gpu": 4641}, ["out_of_memory = 'yes'", "must be true"]),
])
def test_bad_measured_values_are_one_line_errors(tmp_path, measured, words):
    path = write_runs(tmp_path / "runs.toml", run_with("x", **measured))
    with pytest.raises(ConfigError, match=r"^run 'x': ") as info:
        validate_file(path, profile=tmp_path / "none.toml")
    assert all(w in str(info.value) for w in words), str(info.value)


def test_cli_reports_an_unknown_field_in_one_line_and_exits_2(tmp_path, capsys):
    good = run_with("good", iteration_time_s=5.0)
    path = write_runs(tmp_path / "runs.toml", good, run_with("bad", foo=1.0))
    code = main(["plan", "--validate", str(path), "--profile", str(tmp_path / "none.toml")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.splitlines() == [
        f"meshtrain plan: error: run 'bad': measured field(s) 'foo' cannot be predicted: "
        f"use any of {', '.join(PREDICTABLE)}"]
    assert "Traceback" not in captured.out + captured.err


def test_cli_prints_the_iteration_time_row(tmp_path, capsys):
    path = write_runs(tmp_path / "runs.toml", run_with("only-time", iteration_time_s=5.0))
    code = main(["plan", "--validate", str(path), "--json", "--profile", str(tmp_path / "none.toml")])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["runs"][0]["measured"] == {"iteration_time_s": 5.0}
    assert result["runs"][0]["leave_one_out_relative_error"].keys() == {"iteration_time_s"}


def test_leave_one_source_out_fits_each_source_on_the_others(tmp_path, capsys):
    """Source A measured 4000 tokens/s twice, source B 5000 on the same run: held out by source, A is
    predicted with the efficiency that fits B exactly, so its error is B's measurement against A's (+25%)
    while leave-one-out over runs keeps A's other run in the fit and flatters it. A device with one source
    has nothing to fit on: not held out. A memory-only run never enters the fit."""
    def run(name: str, source: str, **measured: Any) -> dict[str, Any]:
        return {**MPT_A100, "name": name, "source": source, "framework": "fsdp", "measured": measured}

    alone = {**run("alone", "Paper C", tokens_per_s_per_gpu=10000), "gpu": "H100-SXM-80GB"}
    path = write_runs(tmp_path / "runs.toml", run("a1", "Paper A 2020, Table 1", tokens_per_s_per_gpu=4000),
                      run("a2", "Paper A 2020, Table 2", tokens_per_s_per_gpu=4000),
                      run("b", "Recipe B (v2)", tokens_per_s_per_gpu=5000), alone,
                      run("a-memory", "Paper A 2020", peak_memory_gib=40.0))
    result = validate_file(path, profile=tmp_path / "none.toml")
    loso, runs = result["leave_one_source_out"], {r["name"]: r for r in result["runs"]}
    assert [s["source"] for s in loso["sources"]] == ["Paper A 2020", "Recipe B", "Paper C"]
    assert loso["not_held_out"] == ["alone"] and "leave_one_source_out_relative_error" not in runs["alone"]
    held = {n: runs[n]["leave_one_source_out_relative_error"] for n in ("a1", "b")}
    assert held["a1"]["tokens_per_s_per_gpu"] == pytest.approx(5000 / 4000 - 1, abs=0.01)
    assert held["b"]["tokens_per_s_per_gpu"] == pytest.approx(4000 / 5000 - 1, abs=0.01)
    assert abs(runs["a1"]["leave_one_out_relative_error"]["tokens_per_s_per_gpu"]) < 0.15  # a2 and b in its fit
    source_a = loso["sources"][0]["step_time"]
    assert source_a["in_sample"]["runs"] == source_a["held_out"]["runs"] == 2  # a-memory has no step time
    assert source_a["held_out"]["median_abs_error"] == pytest.approx(1 - 4000 / 5000, abs=0.01)  # step time -20%
    assert loso["sources"][0]["memory"]["in_sample"]["runs"] == 1
    assert "peak_memory_gib" in runs["a-memory"]["leave_one_source_out_relative_error"]
    assert result["median_abs_error"] == statistics.median(  # time fields only
        abs(e) for r in result["runs"] for k, e in r["relative_error"].items() if k != "peak_memory_gib")
    assert main(["plan", "--validate", str(path), "--markdown", "--profile", str(tmp_path / "none.toml")]) == 0
    out = capsys.readouterr().out
    assert "| held out by source |" in out and "| Recipe B | 1 |" in out and "Not held out" in out
    assert "Peak memory per GPU (1 runs report it)" in out


def test_fit_verdicts_compare_the_planner_with_what_each_run_did(tmp_path, capsys):
    """A run that measured something trained, so it fit; ``out_of_memory = true`` says it did not. The MPT run
    fits in 80 GB; at micro-batch 96 without recomputation (96 x 2048 tokens through 32 layers of 4096) it cannot:
    marked out of memory, the verdicts agree; marked as trained, the planner disagrees and says so. The 7B run at
    micro-batch 6 is predicted at 68.4 GiB, whose range (docs/planner.md, "Memory") holds the 80 GiB: "tight", which
    agrees with a run that trained."""
    big = {**MPT_A100["layout"], "micro_batch_size": 96, "gradient_accumulation_steps": 1, "global_batch_size": 768}
    oom = {**MPT_A100, "name": "oom", "layout": big, "measured": {"out_of_memory": True}}
    trained = {**oom, "name": "trained", "measured": {"tokens_per_s_per_gpu": 1000}}
    path = write_runs(tmp_path / "runs.toml", run_with("fits", tokens_per_s_per_gpu=TOKENS_PER_S_PER_GPU), oom, trained)
    result = validate_file(path, profile=tmp_path / "none.toml", cross=False)
    assert result["fits"] == {"runs": 3, "agree": 2,
                              "disagree": [{"name": "trained", "predicted": "does not fit", "measured": "fits"}],
                              "table": {"fits": {"fits": 0, "tight": 1, "does not fit": 1},
                                        "out of memory": {"fits": 0, "tight": 0, "does not fit": 1}}}
    assert [r["relative_error"] for r in result["runs"]][1] == {}  # nothing measured, nothing compared
    assert main(["plan", "--validate", str(path), "--profile", str(tmp_path / "none.toml")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "agrees for 2 of 3 runs" in out and "trained predicted does not fit, fits measured" in out


# A run on two nodes whose ZeRO-3 traffic crosses them (the MPT A100 run at 16 GPUs).
TWO_NODES = {**MPT_A100, "name": "two-nodes", "num_gpus": 16,
             "layout": {**MPT_A100["layout"], "dp": 16, "global_batch_size": 192}}


def test_a_run_may_name_the_network_it_ran_on():
    """A ``network`` table replaces those numbers of the catalog's network and no others; a node with one slow link
    (IBM's 400 Gbit/s per node) makes the same layout's data-parallel time longer than 8 NICs of 200 Gbit/s do."""
    from meshtrain.planner.validate import predict_run, run_context
    slow = {**TWO_NODES, "network": {"inter_node_bandwidth": 50e9, "nics_per_node": 1}, "measured": {"iteration_time_s": 1.0}}
    fast = {**TWO_NODES, "measured": {"iteration_time_s": 1.0}}
    net, catalog = run_context(slow).hw.network, run_context(fast).hw.network
    assert (net.inter_node_bandwidth, net.nics_per_node) == (50e9, 1)
    assert replace(net, inter_node_bandwidth=catalog.inter_node_bandwidth, nics_per_node=catalog.nics_per_node) == catalog
    (best_slow, _), (best_fast, _) = predict_run(slow), predict_run(fast)
    assert best_slow.layout == best_fast.layout
    assert best_slow.time.dp_comm > best_fast.time.dp_comm


@pytest.mark.parametrize("key", ["devices_per_node", "intra_node_bandwidth", "inter_node_bandwidth",
                                 "inter_node_latency_s", "inter_node_efficiency", "nics_per_node", "bandwidth"])
@pytest.mark.parametrize("value", [0, -1.0, "fast", True])
def test_a_bad_network_table_is_one_line_naming_the_run_and_key(tmp_path, key, value):
    path = write_runs(tmp_path / "runs.toml", {**TWO_NODES, "network": {key: value}, "measured": {"iteration_time_s": 1.0}})
    with pytest.raises(ConfigError) as err:
        validate_file(path, profile=tmp_path / "none.toml")
    message = str(err.value)
    assert "\n" not in message and "two-nodes" in message and (repr(key) in message or f".{key} =" in message)


@pytest.mark.parametrize("key, value", [("pipeline_split", "even"), ("pipeline_split", 3), ("attention", "sdpa")])
def test_a_run_naming_an_unknown_kernel_or_split_is_one_line(tmp_path, key, value):
    path = write_runs(tmp_path / "runs.toml", {**TWO_NODES, key: value, "measured": {"iteration_time_s": 1.0}})
    with pytest.raises(ConfigError) as err:
        validate_file(path, profile=tmp_path / "none.toml")
    message = str(err.value)
    assert "\n" not in message and "two-nodes" in message and key in message and repr(value) in message
