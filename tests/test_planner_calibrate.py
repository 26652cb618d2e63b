"""``plan --calibrate`` on this machine (2 gloo processes) and the trainer's plan-vs-actual hook."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshtrain.config.load import load_config
from meshtrain.planner.actual import hardware_for_run, predict_for_run, write_plan_vs_actual
from meshtrain.planner.hardware import CPU_REFERENCE, HOST_KEYS, get_hardware, load_hardware_file

serial = pytest.mark.serial
"""The tests that read :func:`profile`: calibration measures this machine, so `make test` runs them alone, not beside
another pytest worker. The others compute from fixed numbers (or, the send-recv pattern, check values), and run with
the parallel workers."""

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "shakespeare_char.toml"


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    from meshtrain.planner.calibrate import calibrate

    path = tmp_path_factory.mktemp("profile") / "hardware_profile.toml"
    return calibrate(path, ranks=2, min_time=0.002, gemm_sizes=(64, 256), attention_lengths=(32, 64),
                     collective_bytes=(4096, 2**20), passes=1)


@serial
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
    text = profile.read_text()
    for key in ("tp_layer_host_s", "tp_seqpar_layer_host_s", "ulysses_layer_host_s", "ring_layer_host_s",
                "pipeline_action_host_s"):
        assert f"{key} = " in text and 0 <= getattr(host, key) < 0.1, key  # measured, not defaulted
    assert "split_backward_factor = " in text and 1.0 <= host.split_backward_factor < 3.0
    assert cpu.network.devices_per_node == 2 and cpu.network.intra_node_bandwidth > 1e6
    # the profile replaces the uncalibrated default
    assert get_hardware("cpu", profile=profile).device.framework_overhead_bytes == cpu.device.framework_overhead_bytes


@serial
def test_prediction_for_a_trainer_run_uses_the_profile(profile):
    cfg = load_config(CONFIG, {"parallel.zero_stage": "2"})
    one = predict_for_run(cfg, world_size=2, vocab_size=65, device="cpu", profile=profile, threads=1)
    assert str(profile) in one["profile"] and one["step_time_s"] > 0
    overhead = load_hardware_file(profile)["cpu"].device.framework_overhead_bytes
    assert one["peak_memory_bytes"] > overhead
    bigger = load_config(CONFIG, {"parallel.zero_stage": "2", "model.n_embd": "256"})
    two = predict_for_run(bigger, world_size=2, vocab_size=65, device="cpu", profile=profile, threads=1)
    assert two["step_time_s"] > one["step_time_s"] and two["peak_memory_bytes"] > one["peak_memory_bytes"]


def test_the_uncalibrated_cpu_is_the_reference_profile(tmp_path):
    """Without a profile, ``cpu`` and ``cpu-2threads`` are the shipped reference machine's measured profile: every
    host term and gloo collective measured (none left at a default), ``peak_source = "assumed"`` (no range), two
    threads computing faster than one; a run's thread count picks its device, a count it lacks falls back to ``cpu``."""
    none = tmp_path / "none.toml"
    reference = load_hardware_file(CPU_REFERENCE)
    text = CPU_REFERENCE.read_text()
    for name in ("cpu", "cpu-2threads"):
        hw = get_hardware(name, profile=none)
        assert hw == reference[name] and hw.device.peak_source == "assumed"
        assert hw.device.matmul_table["float32"] and hw.device.attention_table["float32"]
    assert all(text.count(f"\n{key} = ") == 2 for key in HOST_KEYS), "a host term the reference did not measure"
    assert {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "p2p", "send-recv"} <= set(
        reference["cpu"].network.collectives)
    assert reference["cpu-2threads"].device.peak("float32") > reference["cpu"].device.peak("float32")
    assert hardware_for_run("cpu", none, 2)[0] == reference["cpu-2threads"]
    assert hardware_for_run("cpu", none, 4)[0] == reference["cpu"]


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

    from meshtrain.planner.cost import micro_batch, dp_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    fw = FRAMEWORKS["meshtrain"]
    assert fw.grad_first_bucket_bytes == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert [fw.grad_buckets(n) for n in (1000, 2**20, 2**20 + 1, 26 * 2**20, 27 * 2**20)] == [1, 1, 2, 2, 3]
    assert FRAMEWORKS["megatron-2021"].grad_buckets(1e12) == 1  # one contiguous buffer

    cpu = get_hardware("cpu")
    hw, costly = (dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, ddp_bucket_overhead_s=s))
                  for s in (0.0, 0.01))
    model, prec = from_config(load_config(CONFIG), 65), PRECISIONS["fp32"]
    layout = Layout(dp=2, micro_batch_size=12)
    micro = micro_batch(model, layout, hw, prec, fw)
    buckets = fw.grad_buckets(4 * model.num_params())  # fp32 gradients, ~3.2 MB
    extra = dp_time(model, layout, costly, prec, fw, micro) - dp_time(model, layout, hw, prec, fw, micro)
    assert buckets == 2 and extra == pytest.approx(0.01 * buckets)


@serial
def test_calibration_measures_every_collective_that_dp_tp_and_sp_issue(profile):
    """all-reduce, all-gather, reduce-scatter (dp and tp), all-to-all (Ulysses), send-recv (ring attention's
    ring_pass) and p2p, each fitted to a positive bandwidth and latency."""
    from meshtrain.planner.calibrate import COLLECTIVES

    measured = load_hardware_file(profile)["cpu"].network.collectives
    assert set(measured) == set(COLLECTIVES) >= {"all-gather", "reduce-scatter", "all-to-all", "send-recv"}
    for kind, (bandwidth, latency) in measured.items():
        assert bandwidth > 1e6 and 0 < latency < 0.1, kind


def test_send_recv_call_shifts_around_the_ring(tmp_path):
    """The measured send-recv is the trainer's pattern: each rank sends to the next, receives from the previous."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_shift_worker, args=(r, 2, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: 1.0, 1: 0.0}  # with 2 ranks, next and previous are the same rank


def _shift_worker(rank: int, world: int, store: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from meshtrain.planner.calibrate import send_recv

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    received = torch.empty(4)
    send_recv(torch.full((4,), float(rank)), received, rank, world)
    queue.put((rank, float(received[0])))
    dist.barrier()
    dist.destroy_process_group()


def _cpu_with(collectives: dict[str, tuple[float, float]]):
    import dataclasses

    cpu = get_hardware("cpu", profile=Path("/nonexistent"))
    return dataclasses.replace(cpu, network=dataclasses.replace(cpu.network, collectives=collectives))


def test_tp_and_sp_are_charged_at_the_measured_rate_of_each_collective():
    """A calibrated CPU charges tp's all-reduce, or its all-gather + reduce-scatter with tp_sequence_parallel,
    Ulysses' all-to-all and ring attention's send-recv each at its own measured numbers; without measurements
    (the GPU catalog) all-gather + reduce-scatter cost exactly one all-reduce, as before."""
    from meshtrain.planner.cost import micro_batch, collective_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    model, prec, fw = from_config(load_config(CONFIG), 65), PRECISIONS["fp32"], FRAMEWORKS["meshtrain"]
    layouts = {"tp": Layout(dp=1, tp=2), "tp+seqp": Layout(dp=1, tp=2, tp_sequence_parallel=True),
               "ulysses": Layout(dp=1, sp=2), "ring": Layout(dp=1, sp=2, sp_mode="ring")}
    fast = (1e9, 1e-5)
    base = {k: fast for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "send-recv")}

    def comm(collectives: dict) -> dict[str, float]:
        hw = _cpu_with(collectives)
        return {name: (lambda mb: mb.tp + mb.sp)(micro_batch(model, layout, hw, prec, fw))
                for name, layout in layouts.items()}

    before = comm(base)
    for kind, changed in (("all-reduce", "tp"), ("all-gather", "tp+seqp"), ("reduce-scatter", "tp+seqp"),
                          ("all-to-all", "ulysses"), ("send-recv", "ring")):
        after = comm({**base, kind: (1e8, 1e-4)})
        assert [name for name in layouts if after[name] != pytest.approx(before[name])] == [changed], kind
    # 4 layers x (2 forward + 2 backward) all-reduces of a (1 x 64 x 128) fp32 activation (micro-batch 1)
    hw = _cpu_with(base)
    act = 1 * 64 * 128 * 4
    assert comm(base)["tp"] == pytest.approx(16 * collective_time(hw, "all-reduce", 2, act, False))
    h100 = get_hardware("H100")
    seqp = Layout(dp=1, tp=8, tp_sequence_parallel=True)
    pair = sum(collective_time(h100, k, 8, act, False) for k in ("all-gather", "reduce-scatter"))
    assert pair == pytest.approx(collective_time(h100, "all-reduce", 8, act, False))
    assert micro_batch(model, seqp, h100, prec, FRAMEWORKS["fsdp"]).tp == pytest.approx(16 * pair)


def _summary(**overrides) -> dict:
    """``OUT/summary.json`` as the trainer writes it."""
    return {"val_loss": 2.0, "step_time_s": 0.05, "peak_memory_bytes": 500 * 2**20, "world_size": 4, "dp": 1,
            "tp": 2, "sp": 2, "vocab_size": 65, "device": "cpu", "tokens_per_s": 30720.0, **overrides}


@serial
def test_plan_vs_actual_of_a_tp_and_sp_run(profile, tmp_path, capsys):
    """The launcher's comparison predicts the run's own layout: tp with tp_sequence_parallel and ring sp."""
    from meshtrain.planner.actual import report_run

    overrides = {"parallel.tp": "2", "parallel.sp": "2", "parallel.sp_mode": "ring",
                 "parallel.tp_sequence_parallel": "true", "train.out_dir": str(tmp_path)}
    result = report_run(load_config(CONFIG, overrides), _summary(), threads=1, profile=profile)
    predicted = result["predicted"]
    assert predicted["layout"].startswith("dp1 tp2+sp pp1 sp2ring z0 mbs12")
    assert predicted["time_breakdown_s"]["tp_comm"] > 0 and predicted["time_breakdown_s"]["sp_comm"] > 0
    assert json.loads((tmp_path / "plan_vs_actual.json").read_text()) == result
    line = capsys.readouterr().err
    assert line.startswith("plan vs actual: step time predicted") and str(profile) in line
    ulysses = report_run(load_config(CONFIG, {**overrides, "parallel.sp_mode": "ulysses"}), _summary(), 1, profile)
    assert ulysses["predicted"]["step_time_s"] != predicted["step_time_s"]


def test_launcher_reads_the_summary_and_skips_runs_without_one(tmp_path, capsys):
    from meshtrain.launch.outcome import report_plan_vs_actual

    cfg = load_config(CONFIG, {"train.out_dir": str(tmp_path)})
    report_plan_vs_actual(cfg, threads=1)  # no summary.json (rank 0 on another node): nothing
    (tmp_path / "summary.json").write_text(json.dumps(_summary(step_time_s=None)))
    assert capsys.readouterr().err == ""
    report_plan_vs_actual(cfg, threads=1)  # no measured step: no comparison, one line saying why
    err = capsys.readouterr().err
    assert not (tmp_path / "plan_vs_actual.json").exists() and err.count("\n") == 1 and "no step time" in err
    (tmp_path / "summary.json").write_text(json.dumps(_summary(world_size=2, tp=1, sp=1, dp=2)))
    report_plan_vs_actual(cfg, threads=1)
    assert "plan vs actual:" in capsys.readouterr().err
    result = json.loads((tmp_path / "plan_vs_actual.json").read_text())
    assert result["measured"] == {"step_time_s": 0.05, "peak_memory_bytes": 500 * 2**20}
    assert result["predicted"]["layout"].startswith("dp2 tp1 pp1 sp1 z0")
    (tmp_path / "summary.json").write_text("{not json")
    report_plan_vs_actual(cfg, threads=1)  # a broken summary costs one warning, never the finished run
    assert "warning: no plan vs actual" in capsys.readouterr().err


def test_rank_threads_share_out_the_cores():
    import os

    from meshtrain.cli.train import rank_threads

    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        cores = len(os.sched_getaffinity(0))
        assert rank_threads(2) == max(1, cores // 2) and rank_threads(cores * 2) == 1 and rank_threads(1) >= 1
        os.environ["OMP_NUM_THREADS"] = "3"
        assert rank_threads(2) == 3
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


@pytest.mark.parametrize("layout, key", [
    ({"tp": 2}, "tp_layer_host_s"), ({"tp": 2, "tp_sequence_parallel": True}, "tp_seqpar_layer_host_s"),
    ({"sp": 2}, "ulysses_layer_host_s"), ({"sp": 2, "sp_mode": "ring"}, "ring_layer_host_s")])
def test_tp_and_sp_host_time_is_charged_per_layer_and_micro_step(layout, key):
    """The calibrated host time a strategy adds costs exactly layers * micro-steps * it per step."""
    from dataclasses import replace

    from meshtrain.planner.cost import step_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    hw = get_hardware("cpu")
    model = from_config(load_config(CONFIG), 65)
    lay = Layout(dp=1, micro_batch_size=4, gradient_accumulation_steps=3, **layout)

    def seconds(host: float) -> float:
        device = replace(hw.device, **{key: host})
        return step_time(model, lay, replace(hw, device=device), PRECISIONS["fp32"], FRAMEWORKS["meshtrain"]).total

    base, more = seconds(0.0), seconds(1e-3)
    assert more - base == pytest.approx(model.layers * 3 * 1e-3, rel=1e-9)


@pytest.mark.parametrize("schedule, v, actions", [("1f1b", 1, 2), ("interleaved-1f1b", 2, 2), ("zbv", 2, 3)])
def test_pipeline_action_host_time_is_charged_per_action(schedule, v, actions):
    """Each forward, backward (or zero-bubble half) of each chunk and micro-batch costs the calibrated host
    time, on the busy path (m micro-batches) and in the bubble that scales with a micro-batch's time."""
    from dataclasses import replace

    from meshtrain.planner.cost import step_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config
    from meshtrain.rules.pipeline import bubble_fraction

    hw = get_hardware("cpu")
    model = from_config(load_config(CONFIG), 65)
    m = 4
    lay = Layout(dp=1, pp=2, micro_batch_size=3, gradient_accumulation_steps=m, pp_schedule=schedule,
                 virtual_stages=v)

    def seconds(host: float) -> float:
        device = replace(hw.device, pipeline_action_host_s=host)
        return step_time(model, lay, replace(hw, device=device), PRECISIONS["fp32"], FRAMEWORKS["meshtrain"]).total

    f = bubble_fraction(schedule, 2, m, v)
    assert seconds(1e-3) - seconds(0.0) == pytest.approx(m / (1 - f) * v * actions * 1e-3, rel=1e-9)


def test_zero_bubble_backward_costs_the_calibrated_split_factor():
    """Only the zero-bubble schedules run their backward as two passes; their compute grows by the factor."""
    from dataclasses import replace

    from meshtrain.planner.cost import step_time
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    hw = get_hardware("cpu")
    model = from_config(load_config(CONFIG), 65)

    def compute(schedule: str, factor: float) -> float:
        device = replace(hw.device, split_backward_factor=factor)
        lay = Layout(dp=1, pp=2, micro_batch_size=3, gradient_accumulation_steps=4, pp_schedule=schedule,
                     virtual_stages=2)
        return step_time(model, lay, replace(hw, device=device), PRECISIONS["fp32"], FRAMEWORKS["meshtrain"]).compute

    assert compute("interleaved-1f1b", 1.5) == compute("interleaved-1f1b", 1.0)
    assert compute("zero-bubble", 1.5) > compute("zero-bubble", 1.0) == compute("interleaved-1f1b", 1.0)
