"""Planner formulas against the published equations they implement (no process group, no torch)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.planner.cost import (_elementwise_bytes_per_token, attention_flops_per_token, dense_flops_per_token, gemm_traffic_bytes, hardware_flops, layer_gemm_shapes,
                                    model_flops, overlapped, ring_time, step_time)
from meshtrain.planner.hardware import GiB, Device, Hardware, Network, get_hardware
from meshtrain.planner.layout import FRAMEWORKS, Layout, divisibility_errors
from meshtrain.planner.memory import (PRECISIONS, in_flight_microbatches, layer_activation_bytes,
                                      memory_breakdown)
from meshtrain.planner.model_specs import ModelSpec, preset

MEGATRON_2021 = FRAMEWORKS["megatron-2021"]
MESHTRAIN = FRAMEWORKS["meshtrain"]
BF16 = PRECISIONS["bf16"]


def ideal_hardware(**device) -> Hardware:
    """A device with exact numbers and a network with no cost, so single terms can be isolated."""
    dev = Device("ideal", {"bfloat16": 1e15, "float32": 1e14}, memory_bytes=1e12, memory_bandwidth=1e30,
                 matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=0.0, **device)
    return Hardware(dev, Network(8, 1e30, 1e30, 0.0, 0.0, 1.0, 1.0))


# ---- parameter counts: published totals ---------------------------------------------------------

@pytest.mark.parametrize("name, params", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200),  # Hugging Face model cards
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800),
])
def test_preset_parameter_counts_match_the_released_models(name, params):
    assert preset(name).num_params() == params


def test_gpt_config_with_gpt2s_options_is_gpt2_small():
    """The trainer's GPT with ``model.bias`` at GPT-2 small's shape has the released 124,439,808 parameters
    (the planner's count of a config equals the built model's: tests/test_llama.py)."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(None, {"model.n_layer": "12", "model.n_head": "12", "model.n_embd": "768",
                             "model.block_size": "1024", "model.vocab_size": "50257", "model.bias": "true",
                             "model.activation": "gelu_tanh"})
    assert from_config(cfg).num_params() == preset("gpt2-small").num_params() == 124_439_808


@pytest.mark.parametrize("name, billions", [("megatron-1.7b", 1.7), ("megatron-7.5b", 7.5), ("megatron-39.1b", 39.1),
                                            ("megatron-145.6b", 145.6), ("megatron-529.6b", 529.6),
                                            ("megatron-1t", 1008.0)])
def test_megatron_configs_match_narayanan_table_1(name, billions):
    m = preset(name)
    L, h, V, s = m.layers, m.hidden, m.vocab, m.seq_len
    eq2 = 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))  # Narayanan et al. 2021, Eq. 2
    assert m.num_params() == pytest.approx(eq2, rel=1e-12)
    assert m.num_params() / 1e9 == pytest.approx(billions, abs=0.05)


def test_unknown_preset_names_the_closest_one():
    with pytest.raises(ConfigError, match="did you mean 'llama3-70b'"):
        preset("llama3-70")


# ---- FLOPs --------------------------------------------------------------------------------------

def test_model_flops_is_korthikanti_eq_7_and_hardware_flops_is_narayanan_eq_3():
    m = preset("megatron-145.6b")
    B, s, L, h, V = 2304, m.seq_len, m.layers, m.hidden, m.vocab
    assert model_flops(m, B) == pytest.approx(72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-12)
    assert hardware_flops(m, B, "full") == pytest.approx(96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)),
                                                         rel=1e-12)


def test_model_flops_with_gqa_and_swiglu_is_megatrons_count():
    m = preset("llama3-70b")
    B, s, L, h, f, V = 8, m.seq_len, m.layers, m.hidden, m.ffn_hidden, m.vocab
    # Megatron-LM num_floating_point_operations: 12 B s L h^2 (1 + kv/a + s/h + 3/2 f/h + V/(2 L h))
    megatron = 12 * B * s * L * h**2 * (1 + m.kv_heads / m.heads + s / h + 1.5 * f / h + V / (2 * L * h))
    assert model_flops(m, B) == pytest.approx(megatron, rel=1e-12)


def test_causal_attention_executes_half_the_scores():
    m = preset("gpt2-small")
    assert attention_flops_per_token(m, causal=True) * 2 == attention_flops_per_token(m) == 4 * m.seq_len * m.hidden


# ---- memory ---------------------------------------------------------------------------------------

def test_activations_reproduce_korthikanti_table_2():
    m = preset("megatron-145.6b")  # MHA, GELU, f = 4h, dropout: the paper's model
    s, b, h, a, t = m.seq_len, 2, m.hidden, m.heads, 8
    L = Layout(dp=1, tp=t, micro_batch_size=b)
    act = lambda layout: layer_activation_bytes(m, layout, BF16, MEGATRON_2021)  # noqa: E731
    assert act(replace(L, tp=1)) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert act(L) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = replace(L, tp_sequence_parallel=True)
    assert act(sp) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert act(replace(sp, recompute="selective")) == pytest.approx(34 * s * b * h / t)
    assert act(replace(L, recompute="full")) == pytest.approx(2 * s * b * h)


def test_flash_attention_keeps_no_scores():
    m = preset("megatron-7.5b")
    L = Layout(dp=1)
    assert layer_activation_bytes(m, L, BF16, MESHTRAIN) == layer_activation_bytes(
        m, replace(L, recompute="selective"), BF16, MEGATRON_2021)


def test_zero_stages_reproduce_the_zero_paper_figure_1():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, 64 GPUs, K = 12 -> 120, 31.4, 16.6, 1.9 GB.
    m, hw, prec = preset("megatron-7.5b"), ideal_hardware(), PRECISIONS["fp16"]
    scale = 7.5e9 / m.num_params()
    for zero, gb in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.88)):
        mem = memory_breakdown(m, Layout(dp=64, zero_stage=zero), hw, prec, MEGATRON_2021)
        states = (mem.weights + mem.gradients + mem.optimizer) * scale / 1e9
        assert states == pytest.approx(gb, rel=0.02), zero


def test_pipeline_in_flight_microbatches_per_schedule():
    assert in_flight_microbatches(Layout(dp=1, pp=4, gradient_accumulation_steps=8)) == 4
    assert in_flight_microbatches(Layout(dp=1, pp=4, gradient_accumulation_steps=2)) == 2
    assert in_flight_microbatches(Layout(dp=1, pp=4, gradient_accumulation_steps=8, pp_schedule="gpipe")) == 8
    inter = Layout(dp=1, pp=4, gradient_accumulation_steps=8, pp_schedule="interleaved-1f1b", virtual_stages=2)
    assert in_flight_microbatches(inter) == pytest.approx(4 + 3 / 2)  # Korthikanti et al. 2022, Sec. 4.2.3


def test_memory_falls_with_recompute_zero_stage_and_tp():
    m, hw = preset("llama3-8b"), get_hardware("H100")
    total = lambda **kw: memory_breakdown(m, Layout(**{"dp": 8, **kw}), hw, BF16, MESHTRAIN).total  # noqa: E731
    # meshtrain's per-operator "selective" keeps GEMM outputs but not the MLP activation, norms or dropout
    assert total(recompute="none") > total(recompute="selective") > total(recompute="full")
    core = lambda rc: memory_breakdown(m, Layout(dp=8, recompute=rc), hw, BF16, FRAMEWORKS["megatron-core"]).total  # noqa: E731
    assert core("none") == core("selective") > core("full")  # attention-core recomputation under flash: no scores
    materialized = lambda rc: memory_breakdown(m, Layout(dp=8, recompute=rc), hw, BF16, MEGATRON_2021).total  # noqa: E731
    assert materialized("none") > materialized("selective") > materialized("full")
    assert total(zero_stage=0) > total(zero_stage=2) > total(zero_stage=3)
    assert total(tp=1) > total(tp=2) > total(tp=4)


# ---- communication and time -------------------------------------------------------------------------

def test_ring_collective_times():
    S, B, a = 1e9, 1e10, 1e-5
    assert ring_time("all-reduce", 8, S, B, a) == pytest.approx(2 * 7 / 8 * S / B + 2 * 7 * a)
    assert ring_time("all-gather", 8, S, B, a) == pytest.approx(7 / 8 * S / B + 7 * a)
    assert ring_time("p2p", 2, S, B, a) == pytest.approx(S / B + a)
    assert ring_time("all-reduce", 1, S, B, a) == 0.0


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_bubble_is_pp_minus_1_over_v_m(schedule, v):
    # Narayanan et al. 2021, Sec. 2.2: bubble / ideal time = (p - 1) / (v * m) without communication.
    m, hw = preset("megatron-39.1b"), ideal_hardware()
    layout = Layout(dp=1, pp=4, gradient_accumulation_steps=16, pp_schedule=schedule, virtual_stages=v)
    t = step_time(m, layout, hw, BF16, MEGATRON_2021)
    assert t.bubble / t.compute == pytest.approx(3 / (v * 16), rel=1e-9)


def test_zero_bubble_leaves_forward_times_only():
    m, hw = preset("megatron-39.1b"), ideal_hardware()
    base = Layout(dp=1, pp=4, gradient_accumulation_steps=16)
    one = step_time(m, base, hw, BF16, MESHTRAIN)
    zb = step_time(m, replace(base, pp_schedule="zero-bubble"), hw, BF16, MESHTRAIN)
    assert zb.bubble == pytest.approx(one.bubble / 3, rel=1e-6)  # backward = 2 x forward without recompute


def test_unoverlapped_dp_all_reduce_is_the_ring_formula():
    m, hw, prec = preset("gpt2-small"), get_hardware("A100-80GB"), PRECISIONS["fp16"]
    layout = Layout(dp=32, gradient_accumulation_steps=4)
    torch_ddp = replace(MEGATRON_2021, grad_bucket_bytes=25 * 2**20)  # no overlap, PyTorch DDP buckets
    t = step_time(m, layout, hw, prec, torch_ddp)
    bw, lat = hw.network.link(True, "all-reduce", ranks_per_node=8)  # 32 ranks span 4 nodes of 8
    assert bw == pytest.approx(min(0.8 * 300e9, 8 * 0.9 * 25e9))  # one ring per NIC: the node's 8 NICs
    grads = m.num_params() * 2  # fp16 gradients: 249 MB -> 10 DDP buckets of at most 25 MiB
    buckets = math.ceil(grads / (25 * 2**20))
    assert buckets == 10
    scalars = 2 * ring_time("all-reduce", 32, 8, bw, lat)
    expected = buckets * ring_time("all-reduce", 32, grads / buckets, bw, lat) + scalars
    assert t.dp_comm == pytest.approx(expected, rel=1e-9)
    one_buffer = step_time(m, layout, hw, prec, MEGATRON_2021).dp_comm  # Megatron 2021: one contiguous buffer
    assert one_buffer == pytest.approx(ring_time("all-reduce", 32, grads, bw, lat) + scalars, rel=1e-9)


def test_compute_time_scales_with_matmul_efficiency():
    m = preset("llama3-8b")
    slow = step_time(m, Layout(dp=1), ideal_hardware(), BF16, MESHTRAIN)
    fast_hw = ideal_hardware()
    fast_hw = replace(fast_hw, device=replace(fast_hw.device, matmul_efficiency=0.5))
    assert step_time(m, Layout(dp=1), fast_hw, BF16, MESHTRAIN).compute == pytest.approx(2 * slow.compute, rel=1e-9)


def test_layer_gemm_shapes_carry_the_dense_flops_and_their_traffic():
    for m in (preset("megatron-7.5b"), preset("llama3-70b")):  # MHA + GELU, GQA + SwiGLU
        for t in (1, 8):
            shapes = layer_gemm_shapes(m, t)
            assert sum(2 * k * n for k, n in shapes) == pytest.approx(dense_flops_per_token(m) / t, rel=1e-12)
    assert gemm_traffic_bytes(100, ((3, 5),), 2) == 2 * (100 * 3 + 3 * 5 + 100 * 5)


def test_gemm_time_is_flops_plus_operand_traffic_unless_measured():
    # No-overlap roofline (Calculon's "no_overlap" mode): t = 2MKN / rate + e(MK + KN + MN) / bandwidth,
    # i.e. efficiency * I / (I + I*) of peak for arithmetic intensity I.
    hw = get_hardware("H100")
    dev = hw.device
    M, K, N = 4096, 1024, 8192
    flops, nbytes = 2 * M * K * N, gemm_traffic_bytes(M, ((K, N),), 2)
    seconds = flops / dev.matmul_flops("bfloat16", K) + dev.gemm_traffic_seconds("bfloat16", nbytes)
    ridge = dev.matmul_flops("bfloat16", K) / dev.bandwidth()
    intensity = flops / nbytes
    assert flops / seconds == pytest.approx(dev.matmul_flops("bfloat16", K) * intensity / (intensity + ridge))
    measured = replace(dev, matmul_table={"bfloat16": [(1024, 1e12)]})  # a calibrated table includes it
    assert measured.gemm_traffic_seconds("bfloat16", nbytes) == 0.0
    # so a larger micro-batch (more GEMM rows) computes each sample faster on a GPU
    m = preset("gpt2-xl")  # 1024 rows per sample, h = 1600
    per_sample = [step_time(m, Layout(dp=1, micro_batch_size=b), hw, BF16, MESHTRAIN).compute / b for b in (1, 8)]
    assert per_sample[1] < 0.92 * per_sample[0]


def test_megatron_cross_entropy_moves_52_bytes_per_logit():
    # cast to fp32 (2 + 4), max (4), subtract (8), exp (8), sum (4), divide (8); backward multiply (8), cast (6)
    assert FRAMEWORKS["megatron-core"].cross_entropy_bytes == MEGATRON_2021.cross_entropy_bytes == 52
    hw = ideal_hardware()
    hw = replace(hw, device=replace(hw.device, memory_bandwidth=1e12))
    m, layout = preset("gpt2-small"), Layout(dp=1, micro_batch_size=2)
    ours = step_time(m, layout, hw, BF16, MESHTRAIN).compute
    megatron = step_time(m, layout, hw, BF16, FRAMEWORKS["megatron-core"]).compute
    assert megatron - ours == pytest.approx(2 * m.seq_len * m.vocab * (52 - 24) / 1e12, rel=1e-9)


def test_materialized_softmax_traffic_excludes_the_score_gemms_own():
    # per score: softmax reads + writes (2e), dropout reads + writes + 1-byte mask (2e + 1); the QK^T write
    # and the AV read are in those GEMMs' roofline, not counted twice
    m, e = preset("megatron-7.5b"), 2
    _, core = _elementwise_bytes_per_token(m, Layout(dp=1, tp=4), e, materialized=True)
    assert core == m.heads * m.seq_len * (2 * e + 2 * e + 1) / 4
    assert _elementwise_bytes_per_token(m, Layout(dp=1, tp=4), e, materialized=False)[1] == 0.0


def test_tp_beyond_a_node_pays_the_inter_node_link():
    m, hw = preset("llama3-70b"), get_hardware("H100")
    inside = step_time(m, Layout(dp=2, tp=8), hw, BF16, MESHTRAIN).tp_comm
    across = step_time(m, Layout(dp=1, tp=16), hw, BF16, MESHTRAIN).tp_comm
    assert across > 4 * inside  # one NIC per rank for tp (it shares the NICs with data-parallel traffic)


def test_ring_collectives_use_the_nics_of_the_group_on_each_node():
    lay = Layout(dp=32, tp=4)  # a dp group (fixed tp rank) holds 2 ranks of each 8-GPU node
    assert lay.ranks_per_node("dp", 8) == 2 and lay.ranks_per_node("tp", 8) == 4
    assert Layout(dp=32).ranks_per_node("dp", 8) == 8 and Layout(dp=4, tp=8, pp=2).ranks_per_node("pp", 8) == 1
    net = get_hardware("A100").network
    one, two = net.link(True, "reduce-scatter", 1)[0], net.link(True, "reduce-scatter", 2)[0]
    assert two == pytest.approx(2 * one)
    assert net.link(True, "all-reduce", 8)[0] == pytest.approx(min(0.8 * 300e9, 8 * one))  # bounded by NVLink
    assert net.link(True, "p2p", 8)[0] == one and net.link(True, "all-to-all", 8)[0] == one  # own NIC


def test_divisibility_rules_name_the_value():
    m = preset("llama3-70b")  # 64 heads, 8 kv heads
    assert any("tp = 3" in e for e in divisibility_errors(m, Layout(dp=1, tp=3)))
    assert any("n_head = 64 is not divisible by tp*sp = 128" in e for e in divisibility_errors(m, Layout(dp=1, tp=8, sp=16)))
    assert any("multiple of pp" in e for e in divisibility_errors(
        m, Layout(dp=1, pp=4, gradient_accumulation_steps=6, pp_schedule="interleaved-1f1b", virtual_stages=2)))
    assert divisibility_errors(m, Layout(dp=4, tp=8, pp=4, sp=2, gradient_accumulation_steps=8)) == []


def test_model_spec_rejects_impossible_shapes():
    with pytest.raises(ConfigError, match="divisible by heads"):
        ModelSpec("x", layers=2, hidden=100, heads=3, vocab=10, seq_len=8)
    with pytest.raises(ConfigError, match="activation"):
        ModelSpec("x", layers=2, hidden=64, heads=4, vocab=10, seq_len=8, activation="relu")


def test_device_peak_errors_and_catalog_aliases():
    hw = get_hardware("a100-80gb")
    assert hw.device.name == "A100-SXM-80GB" and hw.device.memory_bytes == 80 * GiB
    with pytest.raises(ConfigError, match="did you mean"):
        get_hardware("H10O-SXM-80GB")
    assert math.isclose(hw.device.peak("bfloat16"), 312e12)


def test_local_sgd_all_reduces_the_weights_every_h_steps():
    """Local SGD: one all-reduce of the weights per H steps replaces the per-step gradient all-reduce,
    and only two scalars are all-reduced every step (the loss mean and the trainer's stop check)."""
    m, hw, prec = preset("gpt2-small"), get_hardware("A100-80GB"), PRECISIONS["fp32"]
    layout = Layout(dp=32, local_sgd_steps=8)
    bw, lat = hw.network.link(True, "all-reduce", ranks_per_node=8)
    weights = m.num_params() * 4
    expected = ring_time("all-reduce", 32, weights, bw, lat) / 8 + 2 * ring_time("all-reduce", 32, 8, bw, lat)
    assert step_time(m, layout, hw, prec, FRAMEWORKS["meshtrain"]).dp_comm == pytest.approx(expected, rel=1e-9)


def test_diloco_exchanges_a_workers_share_between_workers_every_h_steps():
    """2 nodes x 8 over 10 Gbit/s, DiLoCo with one worker per node: every step the worker's own DDP (inside the
    node), and every H steps each rank's 1/8 of the weights all-reduced with its peer in the other node (a ring
    of 2 over one NIC), plus the outer SGD step; bf16 halves the exchange, int8 all-gathers codes; F fragments
    of 1/F each every H/F steps cost the same, and a delay hides what fits behind tau steps of compute."""
    from dataclasses import replace as changed

    from meshtrain.planner.cost import OUTER_VALUE_BYTES, diloco_time

    m, prec, fw = preset("gpt2-small"), PRECISIONS["bf16"], FRAMEWORKS["meshtrain"]
    hw = get_hardware("A100-80GB")
    hw = changed(hw, network=changed(hw.network, inter_node_bandwidth=10e9 / 8, nics_per_node=1))
    ddp = Layout(dp=16, micro_batch_size=4)
    diloco = changed(ddp, diloco_group=8, diloco_inner_steps=32)
    inner = changed(ddp, dp=8)
    bw, lat = hw.network.link(True, "all-reduce", ranks_per_node=1)
    share = m.num_params() / 8
    exchange = ring_time("all-reduce", 2, share * 4, bw, lat) * 8  # the node's 8 ranks share its one NIC
    outer_step = share * 4 * 7 / hw.device.bandwidth()
    got = diloco_time(m, diloco, hw, prec, step_compute=0.0)
    assert got == pytest.approx((exchange + outer_step) / 32, rel=1e-9)
    inner_dp = step_time(m, inner, hw, prec, fw).dp_comm
    assert step_time(m, diloco, hw, prec, fw).dp_comm == pytest.approx(inner_dp + got, rel=1e-9)
    assert step_time(m, diloco, hw, prec, fw).total < step_time(m, ddp, hw, prec, fw).total
    bf16 = diloco_time(m, changed(diloco, diloco_precision="bf16"), hw, prec, 0.0)
    assert bf16 == pytest.approx((ring_time("all-reduce", 2, share * 2, bw, lat) * 8 + outer_step) / 32, rel=1e-9)
    int8 = diloco_time(m, changed(diloco, diloco_precision="int8"), hw, prec, 0.0)
    gathered = ring_time("all-gather", 2, 2 * share * OUTER_VALUE_BYTES["int8"], bw, lat) * 8
    assert int8 == pytest.approx((gathered + outer_step) / 32, rel=1e-9)
    streamed = changed(diloco, diloco_fragments=4)
    assert diloco_time(m, streamed, hw, prec, 0.0) == pytest.approx(
        4 * (ring_time("all-reduce", 2, share / 4 * 4, bw, lat) * 8 + outer_step / 4) / 32, rel=1e-9)
    fragment = ring_time("all-reduce", 2, share, bw, lat) * 8
    hidden = diloco_time(m, changed(streamed, diloco_delay=1), hw, prec, step_compute=fragment)
    assert hidden == pytest.approx(outer_step / 32, rel=1e-9)  # the exchange fits behind one step


def test_hierarchical_all_reduce_is_reduce_leaders_ring_broadcast():
    """2 nodes x 8: inside the node an all-reduce's and an all-gather's worth of traffic on NVLink, between
    the 2 leaders a ring all-reduce over one NIC each. With one NIC per device the flat ring (8 NICs per
    node) is faster; with one NIC per node the hierarchical one crosses it with half the bytes."""
    from meshtrain.planner.cost import hierarchical_allreduce_time

    m, hw, prec = preset("gpt2-small"), get_hardware("A100-80GB"), PRECISIONS["fp32"]
    S = 25 * 2**20
    intra_bw, intra_lat = hw.network.link(False, "all-reduce")
    inter_bw, inter_lat = hw.network.link(True, "all-reduce", ranks_per_node=1)
    expected = (ring_time("all-reduce", 8, S, intra_bw, intra_lat) + ring_time("all-gather", 8, S, intra_bw, intra_lat)
                + ring_time("all-reduce", 2, S, inter_bw, inter_lat))
    assert hierarchical_allreduce_time(hw, S, 16, 8) == pytest.approx(expected, rel=1e-12)
    no_overlap = replace(FRAMEWORKS["meshtrain"], dp_comm_overlap=False)  # compare the wire times themselves
    flat = step_time(m, Layout(dp=16), hw, prec, no_overlap)
    hier = step_time(m, Layout(dp=16, hierarchical_allreduce=True), hw, prec, no_overlap)
    assert hier.dp_comm > flat.dp_comm  # 8 NICs per node: the flat ring's parallel NICs win (docs/planner.md)
    one_nic = replace(hw, network=replace(hw.network, nics_per_node=1))
    flat = step_time(m, Layout(dp=16), one_nic, prec, no_overlap)
    hier = step_time(m, Layout(dp=16, hierarchical_allreduce=True), one_nic, prec, no_overlap)
    assert hier.dp_comm < flat.dp_comm


def test_parameter_server_is_bound_by_the_slower_of_workers_and_server():
    """Seconds per received gradient = max(worker cycle / W, server update): falls with more workers
    until the server's update bounds it, and more servers lower that bound."""
    m, hw, prec = preset("gpt2-small"), get_hardware("A100-80GB"), PRECISIONS["fp32"]
    fw = FRAMEWORKS["meshtrain"]

    def t(workers: int, servers: int = 1):  # 32 samples per gradient: a worker's cycle >> one AdamW update
        return step_time(m, Layout(dp=workers, ps_servers=servers, micro_batch_size=32), hw, prec, fw)

    assert t(1).compute > 0 and t(2).total == pytest.approx(t(1).total / 2, rel=1e-9)  # worker-bound: W in parallel
    assert t(4096).compute == 0 and t(4096).optimizer > 0  # server-bound
    assert t(8192).total == t(4096).total  # more workers no longer help
    assert t(4096).total / 2 < t(4096, servers=2).total < t(4096).total  # two servers split each update (+ latency)
    layout = Layout(dp=3, ps_servers=1, micro_batch_size=4)
    assert layout.world_size == 4 and layout.global_batch_size == 4  # one worker's batch per update


def _simulated_overlap(comm: float, window: float, slowdown: float, dt: float) -> float:
    """Seconds added to ``window`` of compute by ``comm`` seconds of collective started beside it, by stepping time:
    compute progresses at 1 / (1 + slowdown) per second while the collective runs, at 1 after."""
    t, work, left = 0.0, window, comm
    while work > 0 or left > 0:
        work -= dt / (1 + slowdown) if left > 0 else dt
        left -= dt
        t += dt
    return t - window


@settings(max_examples=60, deadline=None)
@given(comm=st.floats(0, 4), window=st.floats(0, 4), slowdown=st.floats(0, 1))
def test_hidden_communication_slows_compute_as_a_time_stepped_simulation_does(comm, window, slowdown):
    """``cost.overlapped`` (closed form) against stepping time in 1 ms ticks: the two agree to two ticks (each of the
    two loops can overshoot its end by one tick)."""
    dt = 1e-3
    assert overlapped(comm, window, slowdown) == pytest.approx(_simulated_overlap(comm, window, slowdown, dt), abs=2 * dt)


@given(comm=st.floats(0, 100), window=st.floats(0, 100))
def test_without_a_slowdown_overlap_costs_what_sticks_out(comm, window):
    assert overlapped(comm, window, 0.0) == max(0.0, comm - window)


def test_hidden_fsdp_traffic_costs_its_slowdown_share():
    """ZeRO-3 on two H100 nodes, its gathers and reduce-scatters hidden behind compute: the dp time with the published
    slowdown exceeds the one without by the slowdown's share of the collectives' time (the part hidden), and the step
    by exactly that much; with no overlap at all the collectives count whole."""
    m, layout, fw = preset("llama3-8b"), Layout(dp=16, zero_stage=3, micro_batch_size=2, recompute="full"), MESHTRAIN
    hw = get_hardware("H100")
    free = replace(hw, device=replace(hw.device, overlap_slowdown=0.0))
    wire = replace(hw, device=replace(hw.device, comm_overlap=False))
    t, t0, tw = (step_time(m, layout, h, BF16, fw) for h in (hw, free, wire))
    hidden = tw.dp_comm - t0.dp_comm  # all of the collectives' time that the overlap hid
    assert hidden > 0 and t0.dp_comm < 0.1 * tw.dp_comm  # mostly hidden: the case this is about
    k = hw.device.overlap_slowdown / (1 + hw.device.overlap_slowdown)
    assert t.dp_comm - t0.dp_comm == pytest.approx(k * hidden, rel=1e-6)
    assert t.total - t0.total == pytest.approx(k * hidden, rel=1e-6)


def test_megatron_deepspeed_runs_what_deepspeeds_pipeline_engine_ran():
    """The 2021 stack of Megatron-Turing NLG: 1F1B only, whole-block recomputation only, ZeRO 0-1, no sequence
    parallelism; the trainer's own framework allows each of these."""
    from meshtrain.planner.layout import framework_errors
    fw, m = FRAMEWORKS["megatron-deepspeed"], preset("megatron-1.7b")
    for bad in (Layout(pp=2, gradient_accumulation_steps=4, pp_schedule="interleaved-1f1b", virtual_stages=2),
                Layout(dp=2, recompute="selective"), Layout(dp=2, zero_stage=3),
                Layout(tp=2, tp_sequence_parallel=True)):
        assert framework_errors(fw, bad, m) and not framework_errors(MESHTRAIN, bad, m), bad
    assert framework_errors(fw, Layout(dp=2, zero_stage=1, recompute="full"), m) == []
