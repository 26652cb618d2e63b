"""FLOPs, communication, pipeline bubble and time per step of one layout.

Notation: B global batch (samples), b micro_batch_size, s seq_len, L layers, h hidden, q = a*d query
width (= h), kv key/value width, f MLP width, m = 2 (GELU) or 3 (SwiGLU) MLP matrices, V vocab.

FLOPs (a multiply-add is 2 FLOPs), forward, per token and layer::

    dense     2*(h*(q + 2kv) + q*h + m*h*f)      = 24h^2 for MHA, f = 4h, GELU
    attention 4*s*q                              QK^T and AV over the full s x s (non-causal)
    logits    2*h*V                              once per token

Model FLOPs per step = 3 * B*s * (L*(dense + attention) + logits) (forward + 2x backward): Korthikanti
et al. 2022, Eq. 7, ``72*B*s*L*h^2*(1 + s/(6h) + V/(12*L*h))``, generalised as Megatron-LM's
``num_floating_point_operations`` does. Hardware FLOPs add the recomputed forward: full adds
``B*s*L*(dense + attention)`` (Narayanan et al. 2021, Eq. 3, factor 96), selective adds
``B*s*L*attention``. Attention is counted non-causal (the convention of these papers and of MFU as
Megatron and MosaicML report it); FlashAttention *executes* only the causal half, which the time model uses.
meshtrain's "selective" (``Framework.selective = "op-level"``, :mod:`meshtrain.parallel.recompute`) recomputes
no GEMM and no attention kernel, only the element-wise kernels (and ring attention's passes and merges);
torchtitan's ("op-level-alternate") also every second weight GEMM (:func:`recomputed_gemm_fraction`).

Time is a roofline per kernel class on the busiest stage: GEMMs at the device's achievable FLOP/s
plus the time to move their operands (:func:`gemm_traffic_bytes`), element-wise kernels (norms,
residual adds, activation functions, softmax, cross-entropy) at its achievable memory bandwidth, plus
ring collectives on the link their mesh axis uses (:func:`ring_time`).
Takeaway: compute sets the step time until tp leaves the node (4-6 collectives per layer on the slow
link), a pipeline runs short of micro-batches (bubble (pp-1)/(v*GA)), or data-parallel traffic
outgrows what backward hides.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, replace

from meshtrain import axes
from meshtrain.errors import ConfigError
from meshtrain.planner.hardware import FP8_PEAKS, Hardware
from meshtrain.rules.pipeline import RULES, bubble_fraction
from meshtrain.planner.layout import Framework, Layout
from meshtrain.planner.memory import (FP8_CACHED_BYTES, Precision, fsdp_unit_shape, memoized, most_blocks,
                                     muon_groups_of, muon_params, nf4_params, stage_layers, stage_loads, stage_params,
                                     torchtitan_gemms, trained_params)
from meshtrain.planner.model_specs import (NF4_BYTES, ModelSpec, attention_flops_per_token,
                                           dense_flops_per_token, head_flops_per_token)
from meshtrain.planner.optimizer import OptimizerPlan, muon_work


def expert_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of a mixture of experts' MLP that tensor parallelism replicates
    (``meshtrain.models.moe.spec.tp_names``): the k experts, the router and a gated shared expert (0 for a dense
    model); DeepSeek's ungated shared experts are split by tp (:attr:`ModelSpec.shared_tp_split`)."""
    if not model.experts:
        return 0.0
    shared = 0.0 if model.shared_tp_split else model.shared_params
    return routed_flops_per_token(model) + 2.0 * (model.router_params + shared)


def moe_share(model: ModelSpec) -> float:
    """The share of the layers with experts, by which the per-layer (mean) expert terms are scaled: 1 unless the
    model has dense first layers (:attr:`ModelSpec.dense_layers`)."""
    return model.moe_fraction if model.dense_layers else 1.0


def routed_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs per token of the k routed experts alone, ``2*m*h*k*f`` (0 for a dense model): the work that
    :attr:`ModelSpec.expert_imbalance` makes the busiest rank wait for."""
    return 2.0 * model.mlp_matrices * model.hidden * model.active_ffn * moe_share(model) if model.experts else 0.0


def expert_gemm_traffic_bytes(model: ModelSpec, tokens: float, ep: int, element_bytes: int) -> float:
    """HBM bytes of one MoE layer's routed-expert GEMMs forward on the busiest rank (:func:`gemm_traffic_bytes`'
    roofline, per expert): its ``rows = tokens * k * imbalance`` (:func:`expert_imbalance`) token copies read and the outputs written
    once over all its experts, and each of its ``E/ep`` experts' weights read once: ``e*(rows*(2h + m*f) + (E/ep)*m*h*f)``
    (up: rows x h in, rows x (m-1)f out; down: rows x f in, rows x h out). Unlike one dense MLP of width k*f, the weights read are those of E/ep experts,
    not k: for fine-grained experts (Qwen3-30B-A3B: E/k = 16) at a few thousand tokens per rank the weight traffic
    outweighs the rows'. Units: ``tokens`` a count per rank, ``element_bytes`` bytes; returns bytes."""
    if not model.experts:
        return 0.0
    h, f, m = model.hidden, model.ffn_hidden, model.mlp_matrices
    rows, local = tokens * model.experts_per_token * expert_imbalance(model, tokens, ep), model.experts / ep
    up = rows * h + local * h * (m - 1) * f + rows * (m - 1) * f  # gate and up fused for SwiGLU
    down = rows * f + local * f * h + rows * h
    return element_bytes * (up + down) * moe_share(model)


@functools.lru_cache(maxsize=None)
def expected_max_standard_normal(n: int) -> float:
    """E[max of ``n`` independent standard normals], ``integral x * n*phi(x)*Phi(x)^(n-1) dx`` (the density of the
    maximum, order statistics: David and Nagaraja 2003, "Order Statistics", Eq. 2.1.1), by the trapezoid rule on
    [-12, 12] in steps of 1/1000 (the tails beyond hold under 1e-30 of the mass): 0 for n = 1, ``1/sqrt(pi)`` for 2,
    1.4236 for 8, 2.0697 for 32."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-12000, 12001):
        x = i * step
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        total += (0.5 if abs(i) == 12000 else 1.0) * x * n * pdf * cdf ** (n - 1)
    return total * step


def predicted_expert_imbalance(model: ModelSpec, tokens: float, ep: int) -> float:
    """The expected busiest expert rank's routed rows over the mean, for balanced routing: each of the ``n = tokens*ep``
    tokens an ep group routes per micro-batch and MoE layer picks ``k`` of the E experts uniformly without replacement,
    the E experts sitting E/ep on each rank. A rank's load is a sum of n hypergeometric counts (k draws from E, E/ep of
    them its own): mean ``n*k/ep``, variance ``n*k*(1/ep)*(1 - 1/ep)*(E - k)/(E - 1)``; the ep loads sum to ``n*k``, so
    any two correlate at ``-1/(ep - 1)`` (the multivariate hypergeometric's covariance). For many tokens they are
    jointly normal (central limit theorem), and the maximum of ep equicorrelated normals of correlation rho is
    ``mean + sigma*sqrt(1 - rho)*m_ep`` (m_ep = :func:`expected_max_standard_normal`; Owen and Steck 1962, the
    equicorrelated case), so ``1 + sigma*sqrt(ep/(ep - 1))*m_ep/mean``.

    This is the floor that sampling alone sets, what a router balanced in expectation (an auxiliary loss, GShard,
    Lepikhin et al. 2020, Sec. 2.2, or DeepSeek's auxiliary-loss-free bias, Wang et al. 2024, arXiv:2408.15664) still
    shows per micro-batch: a trained router's own skew comes on top (Wang et al. report MaxVio, the busiest expert's
    load over the mean minus 1, per batch, of 0.04-0.7 for single experts), which only a run's statement gives
    (:attr:`ModelSpec.expert_imbalance`). Units: ``tokens`` the tokens one rank routes per micro-batch (a count).
    Takeaway: small for the published runs' shapes: Qwen3-235B at ep 32 with 2,048 tokens per rank 1.016, at ep 8
    with 1,024 1.015; Qwen3-30B-A3B at ep 8 with 16k 1.004."""
    E, k = model.experts, model.experts_per_token
    n = tokens * ep
    if not E or ep <= 1 or k >= E or n <= 0:
        return 1.0
    p = 1.0 / ep
    mean, var = n * k * p, n * k * p * (1 - p) * (E - k) / (E - 1)
    return 1.0 + math.sqrt(var * ep / (ep - 1)) * expected_max_standard_normal(ep) / mean


def expert_imbalance(model: ModelSpec, tokens: float, ep: int) -> float:
    """The busiest expert rank's rows over the mean that the time model charges: the stated
    :attr:`ModelSpec.expert_imbalance` (a published or measured one), else :func:`predicted_expert_imbalance`."""
    return model.expert_imbalance or predicted_expert_imbalance(model, tokens, ep)


@functools.lru_cache(maxsize=4096)
def binomial_tile_waste(n: int, p: float, tile: int) -> float:
    """E[tile*ceil(X/tile) - X] for X ~ Binomial(n, p): the idle rows of the last tile of one expert's grouped GEMM
    (:data:`meshtrain.planner.hardware.GROUPED_GEMM_TILE_ROWS`). Summed over the binomial's probabilities within 12
    standard deviations of its mean; once the standard deviation reaches a tile, X mod tile is uniform to within
    ``exp(-2*pi^2*sd^2/tile^2)`` < 3e-9 (Poisson summation of the normal density), so ``(tile - 1)/2``. 0 for tile <= 1."""
    if tile <= 1 or n <= 0 or p <= 0:
        return 0.0
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    if sd >= tile:
        return (tile - 1) / 2
    lo, hi = max(0, math.floor(mean - 12 * sd)), min(n, math.ceil(mean + 12 * sd))
    log_c = math.lgamma(n + 1)
    mass = waste = 0.0
    for x in range(lo, hi + 1):
        pmf = math.exp(log_c - math.lgamma(x + 1) - math.lgamma(n - x + 1) + x * math.log(p)
                       + ((n - x) * math.log1p(-p) if p < 1 else 0.0)) if p < 1 or x == n else 0.0
        mass += pmf
        waste += pmf * (-x % tile)
    return waste / mass


def grouped_gemm_padding_rows(model: ModelSpec, tokens: float, ep: int, tile: int) -> float:
    """Expected rows a rank's grouped expert GEMM runs beyond its routed ones, per micro-batch and MoE layer: each of
    its E/ep experts gets ``X ~ Binomial(tokens*ep, k/E)`` rows (every token of the ep group picks it with
    probability k/E) and runs ``ceil(X/tile)`` whole tiles, so ``E/ep * E[tile*ceil(X/tile) - X]``
    (:func:`binomial_tile_waste`; the M-occupancy ``(M/B_M)/ceil(M/B_M)`` of DeepGEMM issue #211, taken in
    expectation over the routing). Computed at the balanced mean (the waste is under a tile per expert whatever its
    rows). 0 for a dense model or ``tile`` <= 1. Units: ``tokens`` the tokens one rank routes per micro-batch; returns
    rows. Takeaway: at the Qwen3-235B tp4 row's 512 rows per expert (sd 22 < 128) the waste is 62 rows, 12% of them; at
    thousands of rows per expert (sd >= 128) 63.5 rows, 1-2%."""
    E, k = model.experts, model.experts_per_token
    if not E or tile <= 1:
        return 0.0
    return E / ep * binomial_tile_waste(round(tokens * ep), k / E, tile)


def layer_gemm_shapes(model: ModelSpec, tp: int) -> tuple[tuple[float, float], ...]:
    """(K, N) of one layer's weight GEMMs on one tp rank whose rows are the layer's tokens: QKV ``h -> (q + 2kv)/t``,
    out-projection ``q/t -> h``, MLP up ``h -> (m-1)f/t`` (gate and up fused for SwiGLU), MLP down ``f/t -> h``
    (column- then row-parallel, Shoeybi et al. 2019, Sec. 3). A mixture of experts: the router ``h -> E`` (whole: tp
    replicates it) and a shared expert (whole with a gate, split without: :attr:`ModelSpec.shared_tp_split`); the
    routed experts' GEMMs are :func:`expert_gemm_traffic_bytes`'."""
    h, kv, f, t, q = model.hidden, model.kv_dim, model.active_ffn, tp, model.q_dim
    attention = ((h, (q + 2 * kv) / t), (q / t, h))
    if model.kv_lora_rank:  # MLA: the down-projections (q's, kv's and the shared RoPE key, replicated), the up-projections
        rq, rkv, dr, a = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim, model.heads
        up_q = ((rq, q / t),) if rq else ((h, q / t),)
        attention = ((h, rq + rkv + dr), *up_q, (rkv, a * (model.head_dim - dr + model.v_head_dim) / t),
                     (model.v_dim / t, h))
    if model.experts:
        S = model.shared_ffn / (t if model.shared_tp_split else 1)
        shared = ((h, (model.mlp_matrices - 1) * S), (S, h)) if model.shared_ffn else ()
        return (*attention, (h, model.experts), *shared)
    return (*attention, (h, (model.mlp_matrices - 1) * f / t), (f / t, h))


def gemm_traffic_bytes(rows: float, shapes: tuple[tuple[float, float], ...], element_bytes: int) -> float:
    """HBM bytes of the forward GEMMs ``(rows x K) @ (K x N)`` for each (K, N) of ``shapes``: each reads
    both operands and writes its result once, ``e*(rows*K + K*N + rows*N)``.

    The time model adds these bytes at the memory bandwidth to the GEMM's FLOP time (the "no overlap"
    roofline, one of the two processing modes of Calculon, Isaev et al. 2023, Sec. 3): a GEMM of
    arithmetic intensity I = FLOPs/bytes then runs at ``matmul_efficiency * I / (I + I*)`` of peak, with
    I* = achievable FLOP/s / achievable bytes/s the device's ridge point (A100 ~134, H100 ~188 FLOP/byte
    with the catalog constants). No new constant: it reuses ``matmul_efficiency`` and
    ``memory_efficiency``. Units: rows, K, N are counts, ``element_bytes`` bytes; returns bytes.
    Takeaway: per-rank GEMMs with few rows (micro-batch tokens ~2k) or a narrow side (hidden/tp ~1k)
    run 12-25% below the large-GEMM rate (I ~ 600-1000 FLOP/byte); 16k x 6k x 6k ones ~7%.
    """
    total = 0.0
    for k, n in shapes:
        total += rows * k + k * n + rows * n
    return element_bytes * total


def model_flops(model: ModelSpec, samples: int) -> float:
    """Model FLOPs of forward + backward over ``samples`` sequences (Korthikanti et al. 2022, Eq. 7): the forward's
    three times; with LoRA adapters the weight GEMMs' twice (a frozen GEMM's backward computes its input's gradient
    only; the adapters' own r/h of the GEMMs left out) and attention's three times (both its operands are
    activations), so that MFU counts the work a LoRA step needs."""
    weights = model.layers * dense_flops_per_token(model) + head_flops_per_token(model)
    passes = 2.0 if model.adapter_layer_params else 3.0
    return samples * model.seq_len * (passes * weights + 3.0 * model.layers * attention_flops_per_token(model))


def recomputed_gemm_fraction(model: ModelSpec, selective: str) -> float:
    """Share of a layer's forward weight-GEMM FLOPs that ``recompute = "selective"`` runs again: none for
    "attention-core" and meshtrain's "op-level"; torchtitan's "op-level-alternate" recomputes every second GEMM,
    the 2nd, 4th and 6th (wk, wo, w3 of a SwiGLU Llama: :func:`meshtrain.planner.memory.torchtitan_gemms`),
    ~37% of them for Llama 3 8B."""
    if selective != "op-level-alternate":
        return 0.0
    gemms = torchtitan_gemms(model)
    return sum(k * n for k, n in gemms[1::2]) / sum(k * n for k, n in gemms)


def hardware_flops(model: ModelSpec, samples: int, recompute: str, selective: str = "attention-core",
                   mla_up_proj: bool = False) -> float:
    """Model FLOPs plus the recomputed forward (Narayanan et al. 2021, Eq. 3 for ``full``); ``selective``:
    ``Framework.selective`` ("op-level" recomputes no GEMM: no extra FLOPs; "op-level-alternate" the GEMMs of
    :func:`recomputed_gemm_fraction`); ``mla_up_proj`` (``Framework.mla_up_proj_recompute``): MLA's up-projections
    again in every layer's backward, :func:`mla_up_proj_flops_per_token` (within the full forward under ``full``);
    plus, with DPO's frozen reference copy (:attr:`ModelSpec.reference_copy`), its forward: a third of the model FLOPs
    (which, like recomputation, MFU does not count)."""
    tokens = samples * model.seq_len
    attention_again = attention_flops_per_token(model) if selective == "attention-core" else 0.0
    attention_again += recomputed_gemm_fraction(model, selective) * dense_flops_per_token(model)
    up = mla_up_proj_flops_per_token(model) if mla_up_proj and model.kv_lora_rank else 0.0
    extra = {"none": up, "selective": attention_again + up,
             "full": dense_flops_per_token(model) + attention_flops_per_token(model)}[recompute]
    copy = model_flops(model, samples) / 3 if model.reference_copy else 0.0  # DPO's frozen copy: a forward more
    return model_flops(model, samples) + tokens * model.layers * extra + copy


def collective_time(hw: Hardware, kind: str, n: int, nbytes: float, spans_nodes: bool,
                    ranks_per_node: int = 1) -> float:
    """:func:`ring_time` on the link a group uses (measured per-kind numbers inside a node when calibrated;
    across nodes a ring uses the NICs of the group's ``ranks_per_node`` ranks on a node, :meth:`Network.link`).
    An all-to-all across nodes is not a ring: each rank sends ``S/n`` to every peer at once, the ``r - 1`` peers on
    its node over the node's link and the ``n - r`` others through its own NIC, both links busy together, so it
    takes the longer of ``(r-1)/n * S/B_node + (r-1)*alpha_node`` and ``(n-r)/n * S/B_nic + (n-r)*alpha_nic``
    (``r = ranks_per_node``; the pairwise exchange of Thakur et al. 2005, Sec. 3, split by link)."""
    if kind == "all-to-all" and spans_nodes and ranks_per_node > 1:
        r = min(ranks_per_node, n)
        node_bw, node_lat = hw.network.link(False, kind)
        nic_bw, nic_lat = hw.network.link(True, kind, 1)
        return max((r - 1) / n * nbytes / node_bw + (r - 1) * node_lat,
                   (n - r) / n * nbytes / nic_bw + (n - r) * nic_lat)
    bandwidth, latency = hw.network.link(spans_nodes, kind, ranks_per_node)
    return ring_time(kind, n, nbytes, bandwidth, latency)


P2P_KINDS = ("p2p", "send-recv")
"""Point-to-point kinds: one send (pipeline stages), or a send and a receive on every rank (a ring shift)."""


def ring_time(kind: str, n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds for one ring collective of ``nbytes`` (the full buffer) over ``n`` ranks.

    all-reduce ``2(n-1)/n * S/B + 2(n-1)*alpha``; all-gather, reduce-scatter and all-to-all
    ``(n-1)/n * S/B + (n-1)*alpha``; p2p and send-recv (every rank sends S to the next and receives S
    from the previous at once) ``S/B + alpha`` (Patarasuk & Yuan 2009; Thakur et al. 2005).
    """
    if kind in P2P_KINDS:
        return nbytes / bandwidth + latency
    if n <= 1:
        return 0.0
    steps = 2 if kind == "all-reduce" else 1
    return steps * ((n - 1) / n * nbytes / bandwidth + (n - 1) * latency)


@dataclass
class StepTime:
    """Seconds per optimizer step on the busiest stage, by cause; ``total`` is the step time."""

    compute: float
    tp_comm: float
    sp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    ep_comm: float = 0.0
    """Expert parallelism's token all-to-alls (:func:`layer_collectives`)."""

    @property
    def total(self) -> float:
        return (self.compute + self.tp_comm + self.sp_comm + self.pp_comm + self.bubble + self.dp_comm
                + self.optimizer + self.ep_comm)

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"total": self.total}


@dataclass
class MicroBatch:
    """Seconds of one micro-batch on the busiest stage (:func:`micro_batch`): its compute forward and backward
    (recomputation included) and its tp, sp, pipeline (p2p) and ep communication."""

    forward: float
    backward: float  # includes recomputation
    tp: float
    sp: float
    p2p: float
    ep: float = 0.0


def _elementwise_bytes_per_token(model: ModelSpec, layout: Layout, e: int, materialized: bool,
                                 eager: tuple[float, float, float, float] | None = None) -> tuple[float, float]:
    """(layer, attention-core) HBM bytes of one layer's forward element-wise kernels per token.

    ``eager``: ``Framework.eager_elementwise``, the bytes an eager block's kernels move counted per operator
    (forward + backward, 16-bit): a third of them is charged here, as a forward (backward = 2x forward in
    :func:`_compute`), scaled to the element size ``e``; the h-wide part (norms, residual adds) as replicated.

    Norms read+write h twice; two residual adds read 2h, write h; activation function reads m-1 of f
    and writes f; attention reads Q, K, V and writes O; dropout masks 1 byte. Materialized attention
    also reads and writes every score in the fused softmax, and in dropout (+ its 1-byte mask): 2e (+ 2e + 1)
    per score. The scores the QK^T GEMM writes and the AV GEMM reads (2e) are those GEMMs' own traffic,
    charged in their roofline (:func:`_compute`), not here.
    """
    h, f, t, seq = model.hidden, model.active_ffn, layout.tp, (layout.tp if layout.tp_sequence_parallel else 1)
    replicated = e * (4 * h + 6 * h) + (2 * h if model.dropout else 0)
    sharded = e * ((model.mlp_matrices - 1) * f + f + 2 * h + 2 * model.kv_dim)
    if eager is not None:  # the framework's eager count (Framework.eager_elementwise), forward + backward: a third
        a, b, c, d = eager
        if model.kv_heads == model.heads:  # no grouped K/V: no repeat_kv copies nor their backward sums
            a, b = a + b - d, 0.0
        replicated = (a * h) / 3 * e / 2
        sharded = (b * model.kv_dim + c * f) / 3 * e / 2 + e * (2 * h + 2 * model.kv_dim)  # + the attention kernel's IO
    core = 0.0
    if materialized:
        per_score = 2 * e + (2 * e + 1 if model.dropout else 0)
        core = model.heads * model.seq_len * per_score / (t * layout.sp)
    return replicated / seq + sharded / t, core


def _compute(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision,
             fw: Framework) -> tuple[float, float, float, float, float]:
    """(one block's forward, its recomputation per backward pass, the head's forward, the host time of a micro-step's
    forward, one block's weight-GEMM time forward and backward) for one micro-batch; :func:`micro_batch` adds them up
    for the busiest pipeline rank (of :func:`meshtrain.planner.memory.stage_loads`). GEMMs at the GEMM rate plus their operand traffic (:func:`gemm_traffic_bytes`; the
    rows of every GEMM are the micro-batch's tokens, all-gathered over tp with sequence parallelism),
    attention at the attention rate (or, materialized, the slower of its FLOPs and its score traffic),
    element-wise kernels at the memory bandwidth, the head's logits GEMM and cross-entropy, and the host
    time not hidden behind kernels. Backward = 2x forward (two GEMMs per forward GEMM, same traffic)."""
    dev, t, dtype = hw.device, layout.tp, prec.compute_dtype  # one block; micro_batch counts the rank's
    tokens = layout.micro_batch_size * model.seq_len / layout.sp
    k = max(1, model.hidden // t)
    rate, bw = dev.matmul_flops(dtype, k), dev.bandwidth()
    # Ring attention over R ranks (R = sp; USP's sp/sp_ulysses, on 1/sp_ulysses of the heads: sp_degrees) runs one
    # (c x c) chunk pair at a time (c = s/(2R)), only the pairs not entirely in the future: (2R+1)/(4R) of all, each
    # without a causal half except the diagonal ones (counted in that fraction). Each pair is the fused attention
    # kernel at length c on a CPU (the trainer's RingAttention) and in frameworks whose context parallelism calls it
    # per chunk (Framework.ring_fused); else plain GEMMs and softmax with the scores materialized, never kept.
    ring = (ring_ranks := sp_degrees(layout)[1]) > 0
    ring_fused = ring and (dev.name.startswith("cpu") or fw.ring_fused)
    materialized = fw.attention == "materialized" or (ring and not ring_fused)
    executed = (2 * ring_ranks + 1) / (4 * ring_ranks) if ring else 1.0
    attn_rate = dev.matmul_flops(dtype, model.head_dim) if ring else rate
    if fw.fp8 and "float8" not in dev.peak_flops:
        raise ConfigError(f"stack option fp8 needs FP8 tensor cores, which {dev.name} lacks (FP8 devices: "
                          f"{', '.join(FP8_PEAKS)}): drop +fp8 or pick such a --gpu")
    linear = dev.matmul_flops("float8", k) if fw.fp8 else rate  # the Linear GEMMs' (FP8: V3 report, Sec. 3.3.1)
    dense = _weight_gemms_forward(model, layout, hw, prec, fw, tokens, linear)
    attn_flops = executed * tokens * attention_flops_per_token(model, causal=not (materialized or ring)) / t
    layer_bytes, core_bytes = _elementwise_bytes_per_token(model, layout, prec.activation_bytes, materialized,
                                                           fw.eager_elementwise if model.norm == "rmsnorm" else None)
    core = executed * tokens * core_bytes / bw
    if materialized:
        scores = executed * tokens * model.heads * model.seq_len / (t * layout.sp)
        score_io = scores * 2 * prec.activation_bytes
        attn = max(attn_flops / attn_rate, score_io / bw)
    else:
        length = model.seq_len // (2 * ring_ranks) if ring_fused else model.seq_len
        attn = attn_flops / dev.attention_flops(prec.compute_dtype, length, k, fw.attention)
    elementwise = tokens * layer_bytes / bw
    head = _head_forward(model, layout, hw, prec, fw, tokens, rate)
    ops = _layer_host_s(dev, layout) / 3  # host time of forward + backward, a third here
    block = dense + attn + core + elementwise + ops
    gemms_again = recomputed_gemm_fraction(model, fw.selective) * dense  # torchtitan's every second GEMM
    selective = (elementwise + (core if ring else 0.0) + gemms_again if fw.per_operator_selective
                 else attn + core)
    recompute = {"none": 0.0, "selective": selective, "full": dense + attn + core + elementwise}[layout.recompute]
    passes = recompute_passes(layout)
    # the recompute-modules options (within "full"): their GEMMs and element-wise kernels once more in each backward,
    # charged as a negative share of not_in_backward where recompute "none" runs no recomputation pass
    modules = tokens * recompute_modules_work(model, layout, fw, prec.activation_bytes, linear, bw) \
        if layout.recompute != "full" else 0.0
    recompute += modules
    gemm = 3 * dense + passes * {"none": 0.0, "selective": gemms_again, "full": dense}[layout.recompute]
    dequant, not_in_backward = _adapter_costs(model, layout, dense, bw)
    not_in_backward -= 0.0 if passes else modules
    block += dequant
    if layout.recompute == "full":  # selective recomputation runs no GEMM again here
        recompute += dequant
    return block, recompute, head, dev.microstep_host_s / 3, gemm, not_in_backward


def _weight_gemms_forward(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework,
                          tokens: float, rate: float) -> float:
    """Seconds of one block's weight GEMMs forward for ``tokens`` tokens of one micro-batch at the GEMM ``rate``
    (FLOP/s), with their operand traffic (:func:`gemm_traffic_bytes`). A mixture of experts' MLP is not split by tp in
    meshtrain: every tp rank runs it on the same tokens (folded into tp, each tp rank routes its own tokens/tp:
    ``Framework.expert_folding``); the busiest expert rank's routed rows are :func:`expert_imbalance` times the mean
    (stated or predicted), and each expert's rows run in whole tiles of the grouped GEMM
    (:func:`grouped_gemm_padding_rows`)."""
    dev, dtype, t, e = hw.device, prec.compute_dtype, layout.tp, prec.activation_bytes
    routed, fold = routed_flops_per_token(model), fw.expert_fold(t)
    moe = expert_flops_per_token(model)  # replicated over tp, and MLA's down-projections (every rank's latents whole)
    down = 2.0 * model.mla_down_params
    io = dev.gemm_traffic_seconds(dtype, gemm_traffic_bytes(tokens, layer_gemm_shapes(model, t), e)
                                  + expert_gemm_traffic_bytes(model, tokens / fold, layout.ep, e))
    imbalance = expert_imbalance(model, tokens / fold, layout.ep)
    per_token = (dense_flops_per_token(model) - moe - down) / t + down + (moe + (imbalance - 1) * routed) / fold
    padding = grouped_gemm_padding_rows(model, tokens / fold, layout.ep, dev.grouped_gemm_tile_rows(dtype))
    padded = padding * routed / max(1, model.experts_per_token)  # routed is k experts' FLOPs per token
    return (tokens * per_token + padded) / rate + io


def _head_forward(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework, tokens: float,
                  rate: float) -> float:
    """Seconds of the head's forward for ``tokens`` tokens of one micro-batch at the GEMM ``rate`` (FLOP/s): the logits
    GEMM with its operand traffic and a third of the cross-entropy's traffic (``Framework.cross_entropy_bytes`` per
    logit; the rest is backward), scaled by the multi-token prediction depths' share (:func:`head_flops_per_token`)."""
    t, e, bw = layout.tp, prec.activation_bytes, hw.device.bandwidth()
    io = hw.device.gemm_traffic_seconds(prec.compute_dtype,
                                        gemm_traffic_bytes(tokens, ((model.hidden, model.vocab / t),), e))
    head = tokens * (2.0 * model.hidden * model.vocab / t / rate + model.vocab / t * fw.cross_entropy_bytes / 3 / bw)
    return (head + io) * head_flops_per_token(model) / (2.0 * model.hidden * model.vocab)


def recompute_modules_work(model: ModelSpec, layout: Layout, fw: Framework, e: float, rate: float,
                           bandwidth: float) -> float:
    """Seconds per token one block's backward spends running again what the framework's recompute modules dropped
    (Megatron-Core's ``--recompute-modules``; DeepSeek-V3 report, Sec. 3.2.3 and 3.3.3): MLA's up-projections
    (:func:`mla_up_proj_flops_per_token` at the Linear ``rate``, FLOP/s), the two RMSNorms (read and write h each)
    and the experts' SwiGLU (read the gate's and up's outputs, write their product: 3 of the k*f + S wide rows),
    these at the element-wise ``bandwidth`` (bytes/s; ``e`` bytes an element). Split over tp as the layer is."""
    t, flops, nbytes = layout.tp, 0.0, 0.0
    if fw.mla_up_proj_recompute and model.kv_lora_rank:
        flops += mla_up_proj_flops_per_token(model) / t
    if fw.norm_recompute:
        nbytes += 4 * model.hidden * e / (t if layout.tp_sequence_parallel else 1)
    if fw.moe_act_recompute and model.experts:
        nbytes += 3 * (model.active_ffn + model.shared_ffn) * e * moe_share(model) / t
    return flops / rate + nbytes / bandwidth


def mla_up_proj_flops_per_token(model: ModelSpec) -> float:
    """FLOPs per token of MLA's up-projections (DeepSeek-V2 report, arXiv:2405.04434, Eq. 10-13), which
    recomputation from the kept latents runs again (V3 report Sec. 3.2.3): ``q_b`` (``q_lora_rank`` ->
    heads x (dn + dr); none without a q latent) and ``kv_b`` (``kv_lora_rank`` -> heads x (dn + dv)), 2 FLOPs a MAC."""
    up = model.q_lora_rank * model.q_dim + model.kv_lora_rank * (model.q_dim - model.heads * model.qk_rope_head_dim
                                                                 + model.v_dim)
    return 2.0 * up


def _adapter_costs(model: ModelSpec, layout: Layout, dense: float, bandwidth: float) -> tuple[float, float]:
    """(seconds of one block's NF4 dequantization per pass, seconds of twice the block's forward its backward does
    not run) with LoRA / QLoRA; (0, 0) without. A frozen GEMM's backward computes its input's gradient only, one GEMM
    instead of two (the adapters' own GEMMs, r/h of the block's, are left out); QLoRA dequantizes each NF4 weight in
    the forward, the backward and a recomputed forward (read the 4-bit data, write fp32 weights:
    :mod:`meshtrain.adapters.nf4`). ``dense``: the block's weight-GEMM seconds forward."""
    dequant = model.nf4_layer_params / layout.tp * (NF4_BYTES + 4) / bandwidth
    return dequant, (dense if model.adapter_layer_params else 0.0) + dequant


def ep_ranks_per_node(layout: Layout, fw: Framework, devices_per_node: int) -> int:
    """Ranks of one ep group on a node (fewer than ``ep``: the group crosses nodes): its ``ep`` ranks sit at sp's
    stride (tp ranks apart) in meshtrain, consecutively when folded into tp (``Framework.expert_folding``)."""
    if layout.ep == 1 or fw.expert_folding:
        return min(layout.ep, devices_per_node)
    return layout.ranks_per_node("ep", devices_per_node)


def recompute_passes(layout: Layout) -> int:
    """How often backward recomputes a block's forward per micro-batch: once, but twice under the zero-bubble
    schedules with full recomputation, whose input-gradient and weight-gradient passes are two backwards
    through each block and each recomputes it (torch's non-reentrant checkpoint recomputes per backward;
    selective recomputation does not run there, :func:`meshtrain.planner.layout.selective_runs`)."""
    if layout.recompute == "none":
        return 0
    return 2 if layout.pp > 1 and layout.pp_schedule in ("zero-bubble", "zbv") else 1


def _layer_host_s(dev, layout: Layout) -> float:
    """Host seconds per layer and micro-step: the plain model's, plus what tp and sp add (calibrated on
    CPU; 0 on GPUs, whose host runs ahead of the kernels)."""
    extra = 0.0
    if layout.tp > 1:
        extra += dev.tp_seqpar_layer_host_s if layout.tp_sequence_parallel else dev.tp_layer_host_s
    ulysses, ring_ranks = sp_degrees(layout)  # USP: both modules' host time
    extra += (dev.ring_layer_host_s if ring_ranks > 1 else 0.0) + (dev.ulysses_layer_host_s if ulysses > 1 else 0.0)
    return dev.layer_host_s + extra


def sp_degrees(layout: Layout) -> tuple[int, int]:
    """(ranks of an all-to-all of heads, ranks of a ring of K/V; 0: no ring attention) of ``layout``'s sequence
    parallelism: (sp, 0) under Ulysses, (1, sp) under ring attention, (sp_ulysses, sp / sp_ulysses) under USP (Fang and
    Zhao 2024, arXiv:2405.07719: Ulysses inside, ring across), (1, 0) at sp = 1."""
    if layout.sp == 1:
        return 1, 0
    if layout.sp_mode == "ring":
        return 1, layout.sp
    if layout.sp_mode == "usp":
        return layout.sp_ulysses, layout.sp // layout.sp_ulysses
    return layout.sp, 0


def micro_batch(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework,
                memo: dict | None = None) -> MicroBatch:
    """:class:`MicroBatch`: compute and the tp/sp/pp/ep communication of one micro-batch on the busiest stage."""
    key = ("layer work", recompute_passes(layout), layout.tp, layout.sp, layout.sp_mode, layout.sp_ulysses,
           layout.tp_sequence_parallel, layout.micro_batch_size, layout.recompute, layout.ep,
           ep_ranks_per_node(layout, fw, hw.network.devices_per_node))
    block, recompute, head, host, tp, sp, ep, frozen = memoized(memo, key, _layer_work, model, layout, hw, prec, fw)
    # the busiest pipeline rank: its blocks (with their collectives) and, on the loss's rank, the head
    passes, per_block = recompute_passes(layout), tp + sp + ep
    blocks, heads = max(stage_loads(model, layout, fw),
                        key=lambda load: load[0] * (3 * block + passes * recompute + per_block) + load[1] * 3 * head)
    forward = blocks * block + heads * head + host
    backward = 2 * forward + passes * blocks * recompute - blocks * frozen
    tp, sp, ep = blocks * tp, blocks * sp, blocks * ep
    if layout.pp > 1 and layout.pp_schedule in ("zero-bubble", "zbv"):
        backward *= hw.device.split_backward_factor  # their backward runs as an input pass and a weight pass
    # Pipeline: one activation forward and one gradient backward per chunk boundary, split over tp
    # (scatter/gather optimisation, Narayanan et al. 2021, Sec. 4.1).
    # On a calibrated CPU each action of torch's schedule (a forward, a backward, or a zero-bubble half of
    # one, per chunk) also costs its measured host time.
    p2p = 0.0
    if layout.pp > 1:
        key = ("p2p", *axes.degrees_of(layout), layout.micro_batch_size)
        send = memoized(memo, key, _stage_send_time, model, layout, hw, prec)
        actions = 3 if layout.pp_schedule in ("zero-bubble", "zbv") else 2
        p2p = layout.virtual_stages * (2 * send + actions * hw.device.pipeline_action_host_s)
    return MicroBatch(forward, backward, tp, sp, p2p, ep)


def _stage_send_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision) -> float:
    """Seconds of one micro-batch's activations (or their gradient) sent to the next pipeline stage, split over tp."""
    act = layout.micro_batch_size * model.seq_len / layout.sp * model.hidden * prec.activation_bytes
    return collective_time(hw, "p2p", 2, act / layout.tp, layout.spans_nodes("pp", hw.network.devices_per_node))


def _layer_work(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision,
                fw: Framework) -> tuple[float, ...]:
    """One block's and the head's parts of :class:`MicroBatch` (:func:`_compute`), and one block's tp, sp and ep
    collectives: (block forward, block recomputation, head forward, host time, block tp, block sp, block ep, the part
    of twice the block's forward its backward does not run: frozen weights' gradients, :func:`_compute`)."""
    block, recompute, head, host, gemm, frozen = _compute(model, layout, hw, prec, fw)
    net = hw.network
    # Tensor parallelism: 2 all-reduces per layer forward, 2 backward, 2 more when fully recomputed
    # (Shoeybi et al. 2019, Sec. 3); with sequence parallelism each is an all-gather + reduce-scatter pair
    # (Korthikanti et al. 2022, Sec. 4.2.2), of the same ring time on a modelled link, each at its own
    # measured rate on a calibrated CPU. Overlapped, they hide behind the GEMMs they feed.
    # A tp group that spans nodes is charged one NIC per rank, not the ring over all its NICs that
    # dp_time uses: its all-reduces run between the GEMMs, on NICs that data-parallel traffic uses at the
    # same time (not modelled otherwise); Narayanan et al. 2021, Fig. 13, measured tp = 16/32 across
    # nodes far slower than tp = 8 inside one.
    comm: dict[str, float] = defaultdict(float)  # by axis
    for c in layer_collectives(model, layout, prec, fw.expert_fold(layout.tp), fw.fp8):
        if c.axis == "ep":  # an all-to-all: the peers on this rank's node over the node's link, the rest by NIC
            local = ep_ranks_per_node(layout, fw, net.devices_per_node)
            comm[c.axis] += c.count * dispatch_time(hw, model, c.ranks, c.nbytes, local, fw.ep_dispatch)
            continue
        spans = layout.spans_nodes(c.axis, net.devices_per_node)
        comm[c.axis] += c.count * collective_time(hw, c.kind, c.ranks, c.nbytes, spans)
    tp, sp, ep = comm["tp"], comm["sp"], comm["ep"]
    if fw.tp_comm_overlap:  # per block: overlapped() scales with the blocks, so a stage's is blocks times a block's
        tp = overlapped(tp, gemm, hw.device.overlap_slowdown)
    if fw.ep_comm_overlap:  # beside another micro-batch's block, forward and backward (and any recomputation)
        ep = overlapped(ep, 3 * block + recompute_passes(layout) * recompute, hw.device.overlap_slowdown)
    return block, recompute, head, host, tp, sp, ep, frozen


def dispatch_nodes(model: ModelSpec, ep: int, ranks_per_node: int) -> float:
    """Expected number of distinct nodes (its own among them) that hold the experts of one token, for experts spread
    evenly over the ``ceil(ep / ranks_per_node)`` nodes of an ep group (E/N on each) and chosen uniformly, k of E
    without replacement: ``N * (1 - C(E - E/N, k) / C(E, k))`` (the chance that a node holds none of the k is the
    hypergeometric ``C(E - E/N, k) / C(E, k)``). Group-limited routing (:attr:`ModelSpec.expert_groups` G = N, one group
    per node, DeepSeek-V3's ``n_group = 8`` for its 8 nodes of ep 64, V3 report Sec. 2.1.2) picks M =
    ``expert_topk_groups`` groups first and the k experts inside their ``M*E/G``: ``M * (1 - C((M-1)*E/G, k) /
    C(M*E/G, k))``, at most M. Uniform routing is an assumption (a trained router is not uniform; expert imbalance
    is :attr:`ModelSpec.expert_imbalance`'s). Takeaway: Qwen3-235B (128 experts, k = 8) at ep 32 over 4 nodes reaches
    3.6 nodes per token where an all-to-all sends 8 copies, 6 of them off the node."""
    nodes = max(1, math.ceil(ep / max(1, ranks_per_node)))
    E, k = model.experts, model.experts_per_token
    if nodes == 1 or not E:
        return 1.0
    G, M = model.expert_groups, model.expert_topk_groups
    if G > 1 and G == nodes:
        per = E // G
        return M * (1 - math.comb((M - 1) * per, k) / math.comb(M * per, k))
    return nodes * (1 - math.comb(E - E // nodes, k) / math.comb(E, k))


def dispatch_time(hw: Hardware, model: ModelSpec, ep: int, nbytes: float, ranks_per_node: int,
                  mode: str = "all-to-all") -> float:
    """Seconds of one dispatch (or combine) of a rank's ``nbytes`` (its k copies of its tokens' hidden states) over an ep
    group of ``ep`` ranks, ``ranks_per_node`` of them on each node.

    "all-to-all": :func:`collective_time`'s all-to-all (every copy to its expert's rank; across nodes the copies to
    other nodes through the rank's NIC). "node-limited" (DeepEP; DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.2.2:
    "each token ... transmitted via IB to the GPUs with the same in-node index on its target nodes ... instantly
    forwarded via NVLink"): a token crosses once to each remote node holding one of its experts, ``(N-1)/N`` of
    :func:`dispatch_nodes`' D nodes, then its copies go to their GPUs inside the node, ``(r-1)/r`` of the k over NVLink;
    both links work at once: ``max(D*(N-1)/N * S/k / B_nic + (N-1)*alpha_nic, k*(r-1)/r * S/k / B_node + (r-1)*alpha_node)``
    with S = ``nbytes``, r = ``ranks_per_node``, N = ``ceil(ep / r)`` nodes. Inside one node both modes are the
    all-to-all. Takeaway: over 4 nodes of H100s Qwen3-235B's dispatch falls from 6 copies per token on the NIC to 2.7."""
    if mode != "node-limited" or ranks_per_node >= ep or not model.experts:
        return collective_time(hw, "all-to-all", ep, nbytes, ranks_per_node < ep, ranks_per_node)
    r, k = ranks_per_node, model.experts_per_token
    nodes = math.ceil(ep / r)
    per_token = nbytes / k
    node_bw, node_lat = hw.network.link(False, "all-to-all")
    nic_bw, nic_lat = hw.network.link(True, "all-to-all", 1)
    remote = dispatch_nodes(model, ep, r) * (nodes - 1) / nodes
    return max(remote * per_token / nic_bw + (nodes - 1) * nic_lat,
               k * (r - 1) / r * per_token / node_bw + (r - 1) * node_lat)


@dataclass(frozen=True)
class Collective:
    """``count`` calls of one collective per layer: ``kind`` over the ``ranks`` of mesh ``axis``, each on
    a buffer of ``nbytes`` (the full buffer, as :func:`ring_time` takes it: the all-reduced tensor, the
    gathered output, the scattered input, a rank's all-to-all buffer, one message)."""

    axis: str
    kind: str
    ranks: int
    nbytes: float
    count: int


def layer_collectives(model: ModelSpec, layout: Layout, prec: Precision, expert_fold: int = 1,
                      fp8_dispatch: bool = False) -> list[Collective]:
    """The tp and sp collectives of one transformer layer per micro-batch, forward + backward (+ the
    forward again under full recomputation); ``tests/test_collectives.py`` counts them in a profiler
    trace of the trainer.

    Tensor parallelism: 2 all-reduces of the (b, s/sp, h) activations forward (after the row-parallel
    attention output and MLP down-projection, Megatron's ``g``) and 2 backward (the column-parallel
    inputs, ``f``) (Shoeybi et al. 2019, Sec. 3). With sequence parallelism each becomes an all-gather
    plus a reduce-scatter of the same buffer (Korthikanti et al. 2022, Sec. 4.2.2).
    Ulysses: one all-to-all for each of Q, K, V and one for the output, forward, and the same 4
    reversed in backward (Jacobs et al. 2023, Sec. 3.1), each of the rank's (b, s/sp, width/tp) buffer.
    Ring attention (Liu et al. 2023, Sec. 3; the trainer's ``RingAttention``): ``sp-1`` send-recv passes
    of the stacked K and V forward; backward recomputes around the ring (FlashAttention-2 style, Dao
    2023): ``sp-1`` passes of K/V and ``sp`` of their gradients. Takeaway: ring moves ~3(sp-1) times a
    rank's K/V per layer, Ulysses ~2(2h + 2kv)/sp of its tokens' width: ring pays more wire and latency
    but keeps every head on every rank (no ``heads % (tp*sp)`` rule).
    USP (Fang and Zhao 2024, arXiv:2405.07719; :class:`meshtrain.parallel.sequence.USPAttention`): Ulysses' four
    all-to-alls over ``sp_ulysses`` ranks, of the same buffers, then ring attention's passes over the
    ``sp / sp_ulysses`` ring ranks, each of K/V of ``s/R`` tokens and ``1/sp_ulysses`` of the heads: the same bytes
    per pass as ring attention over sp, in fewer passes (:func:`sp_degrees`).
    Expert parallelism (GShard, Lepikhin et al. 2020, Sec. 2.2; :mod:`meshtrain.parallel.expert`): per MoE layer a
    dispatch and a combine all-to-all of the rank's ``k`` copies of its tokens, ``(b*s/sp) * k * h`` elements,
    forward, the same two reversed in backward, and the forward's again under full recomputation (the per-expert
    counts exchanged first are E integers: latency only, left out). Dropless routing: the busiest rank receives
    ``expert_imbalance`` times the rows it sends, and every rank waits for it (:attr:`ModelSpec.expert_imbalance`).
    ``expert_fold`` = tp where the framework folds ep into tp (each tp rank sends its own tokens/tp:
    :meth:`Framework.expert_fold`). ``fp8_dispatch`` (``Framework.fp8``): the dispatch and the backward's gradient
    to the down-projections in FP8 (:data:`~meshtrain.planner.memory.FP8_CACHED_BYTES` an element), the combines in
    16 bits (V3 report, Sec. 3.3.3, "Low-Precision Communication"): the four calls' mean element.
    """
    full = recompute_passes(layout) if layout.recompute == "full" else 0
    ring_again = recompute_passes(layout)  # any recomputation runs ring attention's forward again
    tokens = layout.micro_batch_size * model.seq_len / layout.sp
    act = tokens * model.hidden * prec.activation_bytes
    out: list[Collective] = []
    if layout.tp > 1:
        per_pass = 2 * (2 + full)  # forward, backward, recomputed forward: 2 each
        kinds = ("all-gather", "reduce-scatter") if layout.tp_sequence_parallel else ("all-reduce",)
        out += [Collective("tp", kind, layout.tp, act, per_pass) for kind in kinds]
    ulysses, ring_ranks = sp_degrees(layout)
    per_token = tokens * prec.activation_bytes / layout.tp
    if ring_ranks > 1:
        passes = (ring_ranks - 1) * (1 + ring_again) + (ring_ranks - 1) + ring_ranks
        out.append(Collective("sp", "send-recv", 2, 2 * model.kv_dim * per_token, passes))
    if ulysses > 1:
        out += [Collective("sp", "all-to-all", ulysses, width * per_token, 2 + full)
                for width in (model.hidden, model.kv_dim, model.kv_dim, model.hidden)]
    if layout.ep > 1 and model.experts:  # the busiest rank receives expert_imbalance times the mean
        rows = model.experts_per_token * expert_imbalance(model, tokens / expert_fold, layout.ep) / expert_fold
        element = (FP8_CACHED_BYTES + prec.activation_bytes) / 2 if fp8_dispatch else prec.activation_bytes
        out.append(Collective("ep", "all-to-all", layout.ep, act * rows * element / prec.activation_bytes, 2 * (2 + full)))
    return out


def layer_step_collectives(model: ModelSpec, layout: Layout, prec: Precision) -> list[Collective]:
    """The tp collectives of one layer per optimizer step: with sequence parallelism each norm weight
    (2 per layer; 4 with ``biases``, the LayerNorm shifts too) gets a partial gradient from each tp rank's
    tokens, summed by one all-reduce of h values before the gradient norm (Korthikanti et al. 2022,
    Sec. 4.2.2; ``parallel.reduce``)."""
    if layout.tp > 1 and layout.tp_sequence_parallel:
        return [Collective("tp", "all-reduce", layout.tp, model.hidden * prec.grad_bytes, 4 if model.biases else 2)]
    return []


def bubble_time(layout: Layout, mb: MicroBatch, fw: Framework | None = None) -> float:
    """Idle time of the busiest stage per step: a bubble fraction ``f`` of the step
    (:func:`meshtrain.rules.pipeline.bubble_fraction`, the trainer's schedules) leaves ``f/(1-f)`` of the
    busy time idle. Busy time is ``m`` micro-batch times (compute, tp/sp and p2p): ``(p-1)/v`` micro-batch
    times for GPipe, 1F1B and interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2), ``(p-1)/(3v)`` for
    zero-bubble at F = I = W (Qi et al. 2024), ``(p-1) * m`` for naive model parallelism.

    A framework's own schedule (``fw.pp_bubble``) replaces the layout's, idle per step as DeepSeek-V3's report gives it
    (arXiv:2412.19437, Table 2), with a micro-batch's forward F a third of its time, its backward B = 2F of which the
    weight-gradient part W = F, and an overlapped forward-and-backward pair F&B = F + B (compute-bound): DualPipe
    ``(p/2 - 1)(F&B + B - 3W)`` = ``(p - 2)/3`` micro-batch times, ZB1P (zero-bubble H1, Qi et al. 2024, which
    DeepSeek-V2 trained with) ``(p - 1)(F + B - 2W)`` = ``(p - 1)/3``, against 1F1B's ``(p - 1)(F + B)`` = ``p - 1``.
    Takeaway: DeepSeek-V3's pp 16 at 120 micro-batches idles 3.7% of the step instead of 11%."""
    if layout.pp == 1:
        return 0.0
    m, p = layout.gradient_accumulation_steps, layout.pp
    whole = mb.forward + mb.backward + mb.tp + mb.sp + mb.p2p + mb.ep
    if fw is not None and fw.pp_bubble:
        F, B, W = whole / 3, 2 * whole / 3, whole / 3
        return (p / 2 - 1) * (F + B + B - 3 * W) if fw.pp_bubble == "dualpipe" else (p - 1) * (F + B - 2 * W)
    f = bubble_fraction(layout.pp_schedule, p, m, layout.virtual_stages)
    return f / (1.0 - f) * m * whole


def dp_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework, mb: MicroBatch,
            memo: dict | None = None) -> float:
    """Exposed seconds of data-parallel communication per step, over the dp*sp ranks holding a replica.

    Stage 0 all-reduces gradients in the framework's buckets; 1 reduce-scatters gradients and all-gathers
    weights after the step; 2 (FSDP2, no reshard after forward) all-gathers weights once per
    micro-step and reduce-scatters once per step; 3 all-gathers before forward and before backward of
    every micro-step (Rajbhandari et al. 2020, Sec. 7: 1.5x the traffic of stage 0), except the last
    unit and the root, which keep their weights for backward; FSDP issues one collective per unit of
    blocks (:func:`meshtrain.planner.memory.fsdp_unit_shape`) and one for the root, each paying the
    link latency. Gradient reduction hides
    behind the last micro-batch's backward, weight gathers behind forward/backward compute, when the
    framework overlaps and the device can; across nodes these rings use the NICs of all the group's ranks
    on a node (:meth:`Network.link`); FSDP's host time per unit collective
    (``Device.fsdp_unit_overhead_s``) is never hidden. Scalar all-reduces add their latency every step:
    the loss mean and the trainer's stop check (:meth:`meshtrain.runtime.faults.StopRequest.agreed`), and with
    sharded gradients (FSDP) the gradient norm's sum of squares. zero_stage 1 is Megatron's distributed
    optimizer (a reduce-scatter, then an all-gather of the weights behind the next forward), except in a
    framework with ``zero1_ddp_only`` (meshtrain's ``ZeroRedundancyOptimizer``): DDP's all-reduce plus an
    unhidden all-gather's worth of fp32 parameter broadcasts after the step.

    Local SGD (``layout.local_sgd_steps = H``, Lin et al. 2020) replaces the gradient all-reduce by one
    all-reduce of the weights (PyTorch's ``PeriodicModelAverager`` flattens them into one buffer) every
    H steps, after the optimizer step (nothing to hide it behind), and the gradient norm is each
    replica's own: ``allreduce(weights) / H`` plus the loss mean's and the stop check's latency, in the
    steady state after the synchronous warm-up. Takeaway: dp communication falls by H.

    DiLoCo (``layout.diloco_group``): the dp time of one worker's layout (dp / workers inside it) plus
    :func:`diloco_time`'s outer exchange per step.
    """
    if layout.diloco_group:
        inner = replace(layout, dp=layout.dp // layout.diloco_workers, diloco_group=0)
        step = layout.gradient_accumulation_steps * (mb.forward + mb.backward)
        return dp_time(model, inner, hw, prec, fw, mb, memo) + diloco_time(model, layout, hw, prec, step, fw)
    if layout.dp * layout.sp == 1:
        return 0.0
    key = ("dp", *axes.degrees_of(layout), layout.zero_stage, layout.hierarchical_allreduce,
           layout.local_sgd_steps, stage_params(model, layout, fw), fsdp_unit_shape(model, layout, fw))
    c = memoized(memo, key, _dp_collectives, model, layout, hw, prec, fw)
    if c.whole is not None:
        return c.whole
    m, z = layout.gradient_accumulation_steps, layout.zero_stage
    overlap = fw.dp_comm_overlap and hw.device.comm_overlap

    def exposed(comm: float, window: float) -> float:
        return overlapped(comm, window, hw.device.overlap_slowdown) if overlap else comm

    if c.ddp:
        return c.scalars + exposed(c.reduce, mb.backward) + c.host
    reduce = exposed(c.reduce, mb.backward) + c.host
    if fw.grad_sync_every_microstep:
        reduce *= m
    if z == 1:
        return c.scalars + reduce + exposed(c.gather, mb.forward)
    per_micro = exposed(c.gather, mb.forward) + c.host
    if c.back_gather is not None:
        per_micro += exposed(c.back_gather, mb.backward) + c.back_host
    return c.scalars + reduce + m * per_micro


def overlapped(comm: float, window: float, slowdown: float) -> float:
    """Seconds a collective of ``comm`` seconds adds to ``window`` seconds of compute it runs beside.

    Compute runs ``1 + slowdown`` times longer while the collective runs (its kernels take SMs and memory bandwidth
    from the GEMMs; ``Device.overlap_slowdown``: Lee et al. 2025, arXiv 2507.03114, mean 18.9%). If the collective
    ends first (``comm <= window * (1 + slowdown)``), the compute did ``comm / (1 + slowdown)`` of its work in those
    ``comm`` seconds and the rest at full speed: ``comm * slowdown / (1 + slowdown)`` added. Otherwise the compute
    ends first and the step waits for the collective: ``comm - window`` added. Both cases are
    ``max(comm - window, comm * slowdown / (1 + slowdown))``; ``slowdown = 0`` is the classic ``max(0, comm - window)``.
    Takeaway: hiding communication is not free; a collective hidden behind compute still costs ~16% of its time."""
    return max(comm - window, comm * slowdown / (1 + slowdown), 0.0)


@dataclass(frozen=True)
class _DpCollectives:
    """Seconds of :func:`dp_time`'s parts before any hides behind compute: the scalar all-reduces, the gradient
    reduction (DDP's all-reduce, flat or hierarchical, or a reduce-scatter), the weight all-gather (and stage 3's
    second one before backward), the host time beside them; ``whole``: local SGD's whole dp time."""

    scalars: float
    reduce: float = 0.0
    gather: float = 0.0
    host: float = 0.0
    back_gather: float | None = None
    back_host: float = 0.0
    ddp: bool = False
    whole: float | None = None


def _dp_collectives(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework) -> _DpCollectives:
    """The parts of :func:`dp_time` that depend on neither the micro-batch's compute nor gradient accumulation."""
    n = layout.dp * layout.sp
    net = hw.network
    dpn = net.devices_per_node
    spans = layout.spans_nodes("dp", dpn) or (layout.sp > 1 and layout.spans_nodes("sp", dpn))
    per_node = layout.ranks_per_node("dp", dpn) * layout.ranks_per_node("sp", dpn) if spans else 1  # dp*sp group
    scalars = (3 if layout.zero_stage >= 2 else 2) * collective_time(hw, "all-reduce", n, 8, spans, per_node)
    p = stage_params(model, layout, fw)
    # gradients: of the trained parameters only (LoRA: the adapters); weights: the base's (QLoRA: NF4 bytes)
    value = 2 if prec.compute_dtype == "bfloat16" else prec.weight_bytes
    grads = trained_params(model, layout, fw) * prec.grad_bytes
    weights = p * value - nf4_params(model, layout) * (value - NF4_BYTES)
    z = layout.zero_stage
    units, per_unit = fsdp_unit_shape(model, layout, fw)
    back = max(units - 1, 0)  # stage 3 gathers again before backward: every unit but the last
    back_weights = back * per_unit * weights * model.layer_params() / layout.tp / p
    units += 1  # and the root: one collective each

    def collective(kind: str, nbytes: float, count: int) -> float:
        return count * collective_time(hw, kind, n, nbytes / count, spans, per_node)

    if layout.local_sgd_steps:
        average = collective_time(hw, "all-reduce", n, p * prec.weight_bytes, spans, per_node)
        return _DpCollectives(scalars, whole=scalars + average / layout.local_sgd_steps)  # + the loss mean and the stop check
    if z == 0 or (z == 1 and fw.zero1_ddp_only):  # DDP; its per-bucket cost beyond the wire (CPU) is never hidden
        buckets = fw.grad_buckets(grads)
        # zero_stage 1 as torch's ZeroRedundancyOptimizer: after the step each rank broadcasts the fp32
        # parameters it updated, the traffic of one all-gather, with nothing to hide behind
        host = hw.device.ddp_bucket_overhead_s * buckets + (collective("all-gather", p * 4, 1) if z == 1 else 0.0)
        if layout.hierarchical_allreduce and spans:
            return _DpCollectives(scalars, buckets * hierarchical_allreduce_time(hw, grads / buckets, n, per_node),
                                  host=host, ddp=True)
        return _DpCollectives(scalars, collective("all-reduce", grads, buckets), host=host, ddp=True)
    count = 1 if z == 1 else units
    host = hw.device.fsdp_unit_overhead_s * count if z >= 2 else 0.0  # per unit collective, never hidden
    return _DpCollectives(scalars, collective("reduce-scatter", grads, count), collective("all-gather", weights, count),
                          host, collective("all-gather", back_weights, back) if z == 3 and back else None,
                          hw.device.fsdp_unit_overhead_s * back)


OUTER_VALUE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 256}
"""Bytes per pseudo-gradient value crossing between DiLoCo's workers (int8: a 4-byte scale per 256 values,
:data:`meshtrain.parallel.diloco.INT8_BLOCK`)."""


def diloco_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, step_compute: float,
                fw: Framework | None = None) -> float:
    """Exposed seconds per inner step of DiLoCo's exchanges between its W workers (:mod:`meshtrain.parallel.diloco`).

    Every rank sends its share of the pseudo-gradient: its stage's tp shard of the weights, split over the worker's
    dp*sp ranks (FSDP's shard, or DDP replicas' slices), in ``diloco_precision``. fp32 and bf16 are a ring all-reduce
    over the W ranks at its place in each worker; int8 an all-gather of every worker's codes. A worker is a node (or
    more) in the intended use, so the ring crosses nodes, each rank through its own NIC (``nics_per_node`` NICs
    shared by a node's ranks, which exchange at once). The outer SGD step reads and writes weights, the outer copy,
    the momentum and the average (memory-bound). F fragments each exchange 1/F of it every H/F steps, and with a
    delay tau an exchange is hidden behind tau inner steps of compute (``step_compute`` seconds each; Douillard et al.
    2025, Sec. 2.3); per step: ``F * (exposed exchange + outer step) / H``. Takeaway: cross-node traffic falls by H
    against DDP's every-step all-reduce, and its peak by F.
    """
    W, F = layout.diloco_workers, layout.diloco_fragments
    net, dpn = hw.network, hw.network.devices_per_node
    worker = layout.world_size // W
    values = stage_params(model, layout, fw) / (layout.dp // W * layout.sp) / F
    payload = values * OUTER_VALUE_BYTES[layout.diloco_precision]
    spans = layout.world_size > dpn
    if layout.diloco_precision == "int8":
        exchange = collective_time(hw, "all-gather", W, W * payload, spans)
    else:
        exchange = collective_time(hw, "all-reduce", W, payload, spans)
    if spans and net.nics_per_node:
        exchange *= max(1.0, min(worker, dpn) / net.nics_per_node)  # the node's ranks share its NICs
    outer_step = values * 4 * 7 / hw.device.bandwidth()  # read weights, outer, momentum, average; write 3
    exposed = max(0.0, exchange - layout.diloco_delay * step_compute)
    return F * (exposed + outer_step) / layout.diloco_inner_steps


def hierarchical_allreduce_time(hw: Hardware, nbytes: float, ranks: int, per_node: int) -> float:
    """Seconds for one hierarchical all-reduce of ``nbytes`` over ``ranks`` ranks, ``per_node`` of them on
    each node (:mod:`meshtrain.parallel.hierarchical`): a reduce to the node's leader and a broadcast back,
    each moving the data of a ring all-reduce / all-gather inside the node, and a ring all-reduce between
    the ``ranks / per_node`` leaders over one NIC each. The trainer's hook runs them on a thread of its
    own, bucket after bucket, so like DDP's all-reduce they hide behind backward where the device can
    overlap. Takeaway: it beats the flat ring when one NIC serves the whole node (``nics_per_node = 1``);
    with a NIC per rank the flat ring's parallel NICs win."""
    intra = collective_time(hw, "all-reduce", per_node, nbytes, False) + collective_time(
        hw, "all-gather", per_node, nbytes, False)
    return intra + collective_time(hw, "all-reduce", ranks // per_node, nbytes, True, 1)


@dataclass(frozen=True)
class OptimizerTime:
    """Seconds of one optimizer step on the busiest rank, by part (:func:`optimizer_parts`): the memory-bound
    element-wise update and the host time per tensor, Muon's Newton-Schulz and its exchange of sharded matrices."""

    elementwise: float
    newton_schulz: float = 0.0
    exchange: float = 0.0

    @property
    def total(self) -> float:
        return self.elementwise + self.newton_schulz + self.exchange


def optimizer_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework | None = None,
                   memo: dict | None = None) -> float:
    """Seconds of the optimizer step: :func:`optimizer_parts`' total."""
    return optimizer_parts(model, layout, hw, prec, fw, memo).total


def optimizer_parts(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision,
                    fw: Framework | None = None, memo: dict | None = None) -> OptimizerTime:
    """The optimizer step, by part (``fw.optimizer``'s row; AdamW without a framework); ``memo``: as
    :func:`step_time`'s (Muon's matrix work, keyed by the degrees, the zero stage and the busiest rank's blocks).

    Element-wise, memory-bound: read and write weights and states, read gradients 3x (norm, clip, update) for each
    parameter this device updates (1/(dp*sp) of its stage with ZeRO >= 1), ``p (2 (w + o) + 3 g)`` bytes with o the
    precision's AdamW bytes per parameter, less twice the bytes of the states another row does not keep
    (:meth:`~meshtrain.planner.optimizer.OptimizerPlan.state_bytes`: SGD none, Muon one on its matrices), plus per
    Muon parameter what :class:`meshtrain.optim.muon.Muon`'s element-wise step moves beyond that, ``8 + g + 2 w + 2 e``
    (the fp32 update U written and read, the gradient read once more by U's lerp, the weight read and written once
    more by the decay before the update, U cast to the Newton-Schulz dtype of e bytes and the result O read); plus
    the host time per parameter tensor (FSDP2's sharded DTensor parameters at zero_stage >= 2 cost more).

    Muon: Newton-Schulz on the busiest rank's matrices at the GEMM rate in its dtype and the exchange of the
    matrix-sharded ones over their group's links (:func:`meshtrain.planner.optimizer.muon_work`), after the
    element-wise part (the trainer orthogonalizes after the momentum update). Takeaway: under FSDP2 and tp the
    owner exchange divides Newton-Schulz by the ranks sharing a matrix for the traffic of two all-to-alls of the
    rank's shards in bf16; DDP and pipeline replicas repeat it whole on every rank."""
    plan = fw.optimizer if fw is not None else OptimizerPlan()
    z, shard = layout.zero_stage, layout.dp * layout.sp
    p = trained_params(model, layout, fw) / (shard if z >= 1 else 1)  # LoRA: adapters
    nbytes = p * (2 * (prec.weight_bytes + prec.optimizer_bytes) + 3 * prec.grad_bytes)
    dev = hw.device
    if plan.name != "adamw":
        taken = muon_params(model, layout, fw)[1 if z >= 1 else 0] if fw is not None else 0.0
        nbytes -= 2 * (p * prec.optimizer_bytes - plan.state_bytes(p, taken, prec.optimizer_bytes))
        nbytes += taken * (2 * 4 + prec.grad_bytes + 2 * prec.weight_bytes + 2 * plan.ns_bytes)
    per_tensor = dev.sharded_tensor_update_host_s if z >= 2 else dev.tensor_update_host_s
    elementwise = nbytes / dev.bandwidth() + per_tensor * model.param_tensors() / layout.pp
    if not plan.muon:
        return OptimizerTime(elementwise)
    if layout.diloco_group:  # Muon runs inside a worker: its FSDP2 shards span the worker's dp / workers ranks
        layout = replace(layout, dp=layout.dp // layout.diloco_workers, diloco_group=0)
    blocks = most_blocks(model, layout, fw)
    key = ("muon", *axes.degrees_of(layout), layout.zero_stage, blocks)
    return OptimizerTime(elementwise, *memoized(memo, key, _muon_seconds, model, layout, hw, fw, blocks))


def _muon_seconds(model: ModelSpec, layout: Layout, hw: Hardware, fw: Framework, blocks: int) -> tuple[float, float]:
    """(Newton-Schulz, exchange) seconds of Muon on the busiest rank (:func:`meshtrain.planner.optimizer.muon_work`),
    each exchange over the links of the mesh axes that share its matrices."""
    work = muon_work(muon_groups_of(model, layout, blocks, fw), fw.optimizer, hw.device)
    dpn = hw.network.devices_per_node
    exchange = sum(collective_time(hw, kind, n, nbytes, any(layout.spans_nodes(a, dpn) for a in group_axes),
                                   _ranks_per_node(layout, group_axes, dpn))
                   for kind, n, group_axes, nbytes in work.exchanges)
    return work.seconds, exchange


def _ranks_per_node(layout: Layout, group_axes: tuple[str, ...], devices_per_node: int) -> int:
    """Ranks of a group along ``group_axes`` on one node (the product of each axis's, at most a node)."""
    ranks = 1
    for axis in group_axes:
        ranks *= layout.ranks_per_node(axis, devices_per_node)
    return min(ranks, devices_per_node)


def embedding_sync_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision) -> float:
    """A pipeline whose tied embedding and head sit on different ranks all-reduces their (V, h/tp)
    gradients once per step between the first and last stage (Megatron-LM's embedding group; the
    trainer's ``Pipeline.sync_tied_gradients``). None under a V placement (both on pipeline rank 0), nor with LoRA
    adapters (the embedding is frozen)."""
    if layout.pp == 1 or not model.tied_embeddings or RULES[layout.pp_schedule].placement == "v":
        return 0.0
    if model.adapter_layer_params:
        return 0.0
    nbytes = model.vocab * model.hidden / layout.tp * prec.grad_bytes
    return collective_time(hw, "all-reduce", 2, nbytes, layout.spans_nodes("pp", hw.network.devices_per_node))


def async_step_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework) -> StepTime:
    """Seconds per gradient a parameter server receives (:mod:`meshtrain.parallel.async_ps`), by cause.

    A worker's cycle is the forward and backward of its ``micro_batch_size * GA`` samples plus pulling
    the fp32 parameters and pushing the fp32 gradient (two point-to-point transfers of ``4 N`` bytes); W
    workers run their cycles side by side. Each of the S servers handles its ``N / S`` of every update
    in turn: receive the gradient shard, an AdamW step, send the parameter shard. The run goes at the
    slower of the two rates (queueing theory's bottleneck), ``max(cycle / W, server time)``; the
    breakdown names the side that bounds it: compute and ``dp_comm`` (the transfers) per worker cycle
    / W, or ``optimizer`` and ``dp_comm`` of one server update. Takeaway: more workers help until the
    server's update time is the bound; more servers split it.
    """
    single = replace(layout, dp=1, ps_servers=0, local_sgd_steps=0, hierarchical_allreduce=False)
    worker = step_time(model, single, hw, prec, fw)
    n = stage_params(model, single)
    transfer = collective_time(hw, "p2p", 2, 4 * n, False)
    cycle = worker.compute + 2 * transfer
    server_transfer = collective_time(hw, "p2p", 2, 4 * n / layout.ps_servers, False)
    server = worker.optimizer / layout.ps_servers + 2 * server_transfer
    if cycle / layout.dp >= server:
        return StepTime(compute=worker.compute / layout.dp, tp_comm=0.0, sp_comm=0.0, pp_comm=0.0, bubble=0.0,
                        dp_comm=2 * transfer / layout.dp, optimizer=0.0)
    return StepTime(compute=0.0, tp_comm=0.0, sp_comm=0.0, pp_comm=0.0, bubble=0.0, dp_comm=2 * server_transfer,
                    optimizer=worker.optimizer / layout.ps_servers)


def step_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision, fw: Framework,
              memo: dict | None = None) -> StepTime:
    """Seconds per optimizer step, by cause (see the module docstring for the model of each part).

    ``memo``: a dict shared by the calls for one model, hardware, precision and framework (a search's), in which
    the parts that depend on a few layout fields are kept, keyed by those fields and by the results of the
    memory helpers they use (:func:`stage_layers`, :func:`stage_params`, :func:`fsdp_unit_shape`): the same
    numbers, a few times faster over a search's layouts."""
    if layout.ps_servers:
        return async_step_time(model, layout, hw, prec, fw)
    mb = micro_batch(model, layout, hw, prec, fw, memo)
    m = layout.gradient_accumulation_steps
    tp_step = memoized(memo, ("tp step", stage_layers(model, layout), layout.tp, layout.tp_sequence_parallel),
                       _step_collectives_time, model, layout, hw, prec)
    # DPO's frozen reference copy (ModelSpec.reference_copy) runs each micro-batch forward once more before the policy:
    # the forward's compute again, and the forward's share of the tp/sp/ep collectives and p2p sends, which the
    # forward, the backward and a full recomputation's forward each run once (the same activations or their
    # gradients). Its ZeRO-3 gathers and a pipeline's forward-only pass's fill and drain are left out.
    copy = 1 / (2 + (layout.recompute == "full")) if model.reference_copy else 0.0
    return StepTime(compute=m * (mb.forward * (1 + (copy > 0)) + mb.backward),
                    tp_comm=m * mb.tp * (1 + copy) + tp_step, sp_comm=m * mb.sp * (1 + copy),
                    pp_comm=m * mb.p2p * (1 + copy) + embedding_sync_time(model, layout, hw, prec),
                    bubble=bubble_time(layout, mb, fw), dp_comm=dp_time(model, layout, hw, prec, fw, mb, memo),
                    optimizer=optimizer_time(model, layout, hw, prec, fw, memo), ep_comm=m * mb.ep * (1 + copy))


def _step_collectives_time(model: ModelSpec, layout: Layout, hw: Hardware, prec: Precision) -> float:
    """Seconds of the busiest stage's :func:`layer_step_collectives` per step."""
    return stage_layers(model, layout) * sum(
        c.count * collective_time(hw, c.kind, c.ranks, c.nbytes, layout.spans_nodes(c.axis, hw.network.devices_per_node))
        for c in layer_step_collectives(model, layout, prec))
