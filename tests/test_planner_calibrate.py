"""``plan --calibrate`` on this machine (2 gloo processes) and the trainer's plan-vs-actual hook."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshtrain.config import load_config
from meshtrain.planner.actual import predict_for_run, write_plan_vs_actual
from meshtrain.planner.hardware import get_hardware, load_hardware_file

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char.toml"


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    from meshtrain.planner.calibrate import calibrate

    path = tmp_path_factory.mktemp("profile") / "hardware_profile.toml"
    return calibrate(path, ranks=2, min_time=0.002, gemm_sizes=(64, 256), attention_lengths=(32, 64),
                     collective_bytes=(4096, 2**20), passes=1)


def test_calibration_writes_a_loadable_profile(profile):
    devices = load_hardware_file(profile)
    assert "cpu" in devices and any(name.startswith("cpu-") for name in devices)
    cpu = devices["cpu"]
    assert cpu.device.peak("float32") > 1e8 and cpu.device.memory_bandwidth > 1e8
    assert 50 * 2**20 < cpu.device.framework_overhead_bytes < 4 * 2**30  # python + torch + gloo
    assert [k for k, _ in cpu.device.matmul_table["float32"]] == [64, 256]
    assert [t for t, _ in cpu.device.attention_table["bfloat16"]] == [32, 64]
    assert not cpu.device.comm_overlap  # a rank's gloo thread shares its core
    host = cpu.device
    assert 0 < host.layer_host_s < 0.1 and 0 < host.tensor_update_host_s < host.sharded_tensor_update_host_s
    assert 0 <= host.ddp_bucket_overhead_s < 0.1 and 0 <= host.fsdp_unit_overhead_s < 0.1
    assert cpu.network.devices_per_node == 2 and cpu.network.intra_node_bandwidth > 1e6
    # the profile replaces the uncalibrated default
    assert get_hardware("cpu", profile=profile).device.framework_overhead_bytes == cpu.device.framework_overhead_bytes


def test_prediction_for_a_trainer_run_uses_the_profile(profile):
    cfg = load_config(CONFIG, {"parallel.zero_stage": "2"})
    one = predict_for_run(cfg, world_size=2, vocab_size=65, device="cpu", profile=profile, threads=1)
    assert str(profile) in one["profile"] and one["step_time_s"] > 0
    overhead = load_hardware_file(profile)["cpu"].device.framework_overhead_bytes
    assert one["peak_memory_bytes"] > overhead
    bigger = load_config(CONFIG, {"parallel.zero_stage": "2", "model.n_embd": "256"})
    two = predict_for_run(bigger, world_size=2, vocab_size=65, device="cpu", profile=profile, threads=1)
    assert two["step_time_s"] > one["step_time_s"] and two["peak_memory_bytes"] > one["peak_memory_bytes"]


def test_uncalibrated_prediction_says_so(tmp_path):
    cfg = load_config(CONFIG)
    out = predict_for_run(cfg, world_size=1, vocab_size=65, device="cpu", profile=tmp_path / "none.toml", threads=1)
    assert "uncalibrated" in out["profile"] and out["step_time_s"] > 0


def test_write_plan_vs_actual_is_atomic_and_computes_signed_errors(tmp_path):
    predicted = {"step_time_s": 0.12, "peak_memory_bytes": 300, "profile": "p"}
    measured = {"step_time_s": 0.10, "peak_memory_bytes": 400}
    result = write_plan_vs_actual(predicted, measured, tmp_path)
    assert result["relative_error"]["step_time_s"] == pytest.approx(0.2)
    assert result["relative_error"]["peak_memory_bytes"] == pytest.approx(-0.25)
    assert json.loads((tmp_path / "plan_vs_actual.json").read_text()) == result
    assert [p.name for p in tmp_path.iterdir()] == ["plan_vs_actual.json"]  # no temporary file left
    nan = write_plan_vs_actual({"step_time_s": math.nan}, measured, tmp_path)
    assert nan["relative_error"] == {}


def test_ddp_buckets_follow_pytorch_defaults_and_each_pays_the_measured_overhead():
    """DDP reduces a 1 MiB first bucket, then 25 MiB ones (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES,
    bucket_cap_mb=25); the planner charges the calibrated per-bucket overhead on top of the wire time."""
    import dataclasses

    import torch.distributed as dist

    from meshtrain.planner.cost import _micro_batch, dp_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.models import from_config

    fw = FRAMEWORKS["meshtrain"]
    assert fw.grad_first_bucket_bytes == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert [fw.grad_buckets(n) for n in (1000, 2**20, 2**20 + 1, 26 * 2**20, 27 * 2**20)] == [1, 1, 2, 2, 3]
    assert FRAMEWORKS["megatron-2021"].grad_buckets(1e12) == 1  # one contiguous buffer

    cpu = get_hardware("cpu")
    hw, costly = (dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, ddp_bucket_overhead_s=s))
                  for s in (0.0, 0.01))
    model, prec = from_config(load_config(CONFIG), 65), PRECISIONS["fp32"]
    layout = Layout(dp=2, micro_batch_size=12)
    micro = _micro_batch(model, layout, hw, prec, fw)
    buckets = fw.grad_buckets(4 * model.num_params())  # fp32 gradients, ~3.2 MB
    extra = dp_time(model, layout, costly, prec, fw, micro) - dp_time(model, layout, hw, prec, fw, micro)
    assert buckets == 2 and extra == pytest.approx(0.01 * buckets)
