"""The planner's two MoE terms against direct computations: the grouped GEMM's idle tile rows per expert
(``cost.grouped_gemm_padding_rows``) and the busiest expert rank's load (``cost.predicted_expert_imbalance``), each
checked against the binomial's exact sum or against routings simulated with torch, and their place in the step time."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.planner.cost import (binomial_tile_waste, expected_max_standard_normal, expert_imbalance,
                                    grouped_gemm_padding_rows, predicted_expert_imbalance, routed_flops_per_token,
                                    step_time)
from meshtrain.planner.hardware import Device, Hardware, Network, get_hardware
from meshtrain.planner.layout import FRAMEWORKS, Layout
from meshtrain.planner.memory import PRECISIONS
from meshtrain.planner.model_specs import from_table, preset


def _moe(experts: int, k: int):
    return from_table({"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 64, "ffn_hidden": 96,
                       "activation": "swiglu", "experts": experts, "experts_per_token": k})


def _route(trials: int, tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    """(trials, tokens, k) expert ids: each token's k distinct experts, uniformly at random (the top k of i.i.d.
    uniform scores is a uniform k-subset)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(trials, tokens, experts, generator=g).topk(k, dim=-1).indices


def test_expected_max_of_normals_matches_the_closed_forms():
    """E[max of n standard normals]: 0, 1/sqrt(pi) and 3/(2 sqrt(pi)) for n = 1, 2, 3 (David and Nagaraja 2003,
    Sec. 3.2). Tolerance 1e-7: the trapezoid rule's error at step 1e-3 on a smooth integrand is ~h^2/12 * max|f''|
    ~ 1e-7 * O(1), and the tails beyond 12 carry < 1e-30."""
    assert expected_max_standard_normal(1) == 0.0
    assert expected_max_standard_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-7)
    assert expected_max_standard_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-7)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 4000), p=st.floats(0.002, 0.6), tile=st.sampled_from([16, 64, 128]))
def test_tile_waste_is_the_binomials_exact_expectation(n, p, tile):
    """E[tile*ceil(X/tile) - X] for X ~ Binomial(n, p) against the sum over every x in 0..n of torch's binomial
    probabilities (no truncation, no shortcut). Tolerance: the function drops the mass beyond 12 standard deviations
    (< 1e-30) and, once sd >= tile, takes X mod tile as uniform, off by at most exp(-2 pi^2 sd^2/tile^2) < 3e-9 in
    probability per residue, so < tile * 3e-9 in rows; 1e-6 rows covers both and fp64 summation."""
    x = torch.arange(n + 1, dtype=torch.float64)
    probs = torch.distributions.Binomial(n, torch.tensor(p, dtype=torch.float64)).log_prob(x).exp()
    direct = float((probs * ((-x) % tile)).sum() / probs.sum())
    assert binomial_tile_waste(n, p, tile) == pytest.approx(direct, abs=1e-6)


@settings(max_examples=6, deadline=None)
@given(experts=st.sampled_from([8, 16, 64]), k=st.integers(1, 4), ep=st.sampled_from([1, 2, 4, 8]),
       tokens=st.integers(16, 96), seed=st.integers(0, 2**16))
def test_padding_rows_are_the_simulated_routings_idle_tile_rows(experts, k, ep, tokens, seed):
    """A rank's idle grouped-GEMM rows per micro-batch: route ``tokens*ep`` tokens (the ep group's) k of E experts each,
    count each of the rank's E/ep experts' rows X, and sum ``tile*ceil(X/tile) - X`` over them; the mean over 400
    routings against :func:`grouped_gemm_padding_rows` with tile 16 (small, so that few rows per expert exercise it).
    Tolerance: 4 standard errors of the simulated mean (its own sample spread / sqrt(400)), plus 1e-9."""
    model, tile, trials = _moe(experts, k), 16, 400
    ids = _route(trials, tokens * ep, experts, k, seed)
    counts = torch.stack([torch.bincount(t.flatten(), minlength=experts) for t in ids])  # (trials, E)
    local = counts[:, : experts // ep].to(torch.float64)  # rank 0's experts
    idle = (tile * torch.ceil(local / tile) - local).sum(dim=1)
    se = float(idle.std()) / math.sqrt(trials)
    assert grouped_gemm_padding_rows(model, tokens, ep, tile) == pytest.approx(float(idle.mean()),
                                                                               abs=4 * se + 1e-9)


def _hypergeometric_moments(experts: int, own: int, k: int) -> tuple[float, float, float]:
    """(mean, variance, third central moment) of the count of a token's k experts (drawn without replacement from
    ``experts``) that are among ``own``, from the exact probabilities C(own, j) C(E-own, k-j) / C(E, k)."""
    total = math.comb(experts, k)
    pmf = {j: math.comb(own, j) * math.comb(experts - own, k - j) / total for j in range(0, min(own, k) + 1)}
    mean = sum(j * q for j, q in pmf.items())
    var = sum((j - mean) ** 2 * q for j, q in pmf.items())
    return mean, var, sum((j - mean) ** 3 * q for j, q in pmf.items())


@settings(max_examples=6, deadline=None)
@given(experts=st.sampled_from([8, 16, 32]), k=st.integers(1, 4), ep=st.sampled_from([2, 4, 8]),
       tokens=st.integers(64, 160), seed=st.integers(0, 2**16))
def test_predicted_imbalance_is_the_simulated_busiest_rank(experts, k, ep, tokens, seed):
    """The busiest ep rank's load over the mean: route ``tokens*ep`` tokens k of E experts each (uniform, without
    replacement), sum each rank's E/ep experts' rows, take the maximum over the ranks; the mean over 1,500 routings
    against ``mean * predicted_expert_imbalance``.

    Tolerance, in rows: 4 standard errors of the simulated mean; plus the Gaussian limit's first correction, the
    Cornish-Fisher term ``gamma*(z^2 - 1)/6`` sigma of a skewed sum's quantile z, with gamma the rank load's exact
    skewness (n times a token's third central moment over sigma^3, from the hypergeometric's probabilities) and z up to
    ``m_ep + 1``; plus half a row (the loads are integers: rounding a continuous maximum moves it by at most 0.5)."""
    model, trials, n = _moe(experts, k), 1500, tokens * ep
    ids = _route(trials, n, experts, k, seed)
    per_rank = experts // ep
    loads = torch.stack([torch.bincount((t // per_rank).flatten(), minlength=ep) for t in ids]).to(torch.float64)
    busiest = loads.max(dim=1).values
    mean = n * k / ep
    _, var1, mu3 = _hypergeometric_moments(experts, per_rank, k)
    sigma = math.sqrt(n * var1)
    gamma = n * mu3 / sigma**3 if sigma else 0.0
    z = expected_max_standard_normal(ep) + 1
    tol = 4 * float(busiest.std()) / math.sqrt(trials) + abs(gamma) * (z * z - 1) / 6 * sigma + 0.5
    assert mean * predicted_expert_imbalance(model, tokens, ep) == pytest.approx(float(busiest.mean()), abs=tol)
    assert predicted_expert_imbalance(model, tokens, 1) == 1.0


def test_a_stated_imbalance_overrides_the_prediction():
    """``expert_imbalance`` 0 (the default) predicts; a stated value (a published run's) is taken as it is."""
    model = preset("mixtral-8x7b")
    assert model.expert_imbalance == 0
    assert expert_imbalance(model, 4096, 8) == predicted_expert_imbalance(model, 4096, 8) > 1
    assert expert_imbalance(replace(model, expert_imbalance=1.3), 4096, 8) == 1.3


def test_the_step_charges_the_idle_tile_rows_and_the_predicted_imbalance():
    """On a device with free memory traffic and a network without latency the terms isolate: against a stated
    imbalance of 1 and no tiles, the predicted imbalance x adds ``(x - 1) * routed`` FLOPs per token and the tiles
    ``padding * routed / k`` FLOPs per micro-batch and MoE layer, each three times (forward and backward) at the GEMM
    rate; the dispatch's all-to-all rows grow by x. A calibrated CPU (a measured matmul table) charges no tiles."""
    def device(tile: int) -> Device:
        return Device("ideal", {"bfloat16": 1e15, "float32": 1e14}, memory_bytes=1e13, memory_bandwidth=1e30,
                      matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=0.0,
                      grouped_gemm_tile=tile)
    net = Network(8, 1e11, 1e10, 0.0, 0.0, 1.0, 1.0)
    fw, prec = FRAMEWORKS["meshtrain"], PRECISIONS["bf16"]
    layout = Layout(dp=8, ep=8, micro_batch_size=1, gradient_accumulation_steps=1)
    predicted, stated = preset("mixtral-8x7b"), replace(preset("mixtral-8x7b"), expert_imbalance=1.0)
    base = step_time(stated, layout, Hardware(device(0), net), prec, fw)
    now = step_time(predicted, layout, Hardware(device(128), net), prec, fw)
    tokens, k = predicted.seq_len, predicted.experts_per_token
    x = predicted_expert_imbalance(predicted, tokens, 8)
    routed = routed_flops_per_token(predicted)
    extra = (tokens * (x - 1) * routed + grouped_gemm_padding_rows(predicted, tokens, 8, 128) * routed / k)
    rate = device(0).matmul_flops("bfloat16", predicted.hidden)
    assert now.compute - base.compute == pytest.approx(3 * predicted.layers * extra / rate, rel=1e-9)
    assert now.ep_comm == pytest.approx(x * base.ep_comm, rel=1e-9)
    cpu = get_hardware("cpu").device
    assert cpu.grouped_gemm_tile_rows("bfloat16") == (0 if cpu.matmul_table.get("bfloat16") else 128)
    assert get_hardware("H100").device.grouped_gemm_tile_rows("bfloat16") == 128
