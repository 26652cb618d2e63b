"""Memory per device: parameters, gradients, optimizer states, activations, buffers, runtime overhead.

Notation: L layers (``ceil(L/pp)`` on the busiest stage), s sequence length, b micro_batch_size,
h hidden, a heads, f MLP width, t = tp, V vocabulary. All results are bytes on one device.

Model states (Rajbhandari et al. 2020, ZeRO, Sec. 3.1 and 5): each parameter costs weight + gradient +
optimizer bytes (bf16 mixed precision 2 + 4 + 12, fp16 2 + 2 + 12, fp32 4 + 4 + 8).
The bf16 row keeps fp32 main gradients (Megatron-LM reduces bf16 gradients in fp32), the fp16 row is
ZeRO's K = 12 with 2-byte gradients. ZeRO stage 1 shards the optimizer states, 2 also the gradients, 3 also the weights, over the dp*sp
ranks that hold the same parameters.

Activations (Korthikanti et al. 2022, Sec. 4 and Table 2), per layer and micro-batch::

    no parallelism          s*b*h*(34 + 5*a*s/h)        (2-byte activations, dropout, f = 4h, MHA)
    tp                      s*b*h*(10 + 24/t + 5*a*s/(h*t))
    tp + sequence parallel  s*b*h*(34/t + 5*a*s/(h*t))
    selective recompute     drops the 5*a*s/h attention-score term (Korthikanti's, "attention-core")
    full recompute          2*s*b*h (the layer input only; /t with sequence parallelism)

meshtrain's own "selective" is per-operator (``Framework.selective = "op-level"``): the layer input plus
the GEMM, attention-kernel and collective outputs (:func:`op_level_saved_bytes`).

generalised below to grouped-query attention, SwiGLU, other f, no dropout, FlashAttention (which keeps
no s x s scores; nor does the trainer's ring attention, which recomputes them in backward) and sp
(every term /sp). Pipeline stages hold several micro-batches at once: 1F1B
``min(pp, GA)``, GPipe ``GA``, interleaved ``pp + (pp-1)/v`` (Korthikanti et al. 2022, Sec. 4.2.3).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

from meshtrain.planner.hardware import Device, Hardware
from meshtrain.planner.stacks_table import load_stacks
from meshtrain.parallel.pipeline.balance import OPTIMIZER_FLOPS_PER_PARAM, chunk_ranks, split_layers
from meshtrain.rules.pipeline import RULES, loss_rank_in_flight, microbatches_in_flight
from meshtrain.planner.layout import Framework, Layout
from meshtrain.planner.model_specs import (NF4_BYTES, ModelSpec, attention_flops_per_token, dense_flops_per_token,
                                           head_flops_per_token, mla_saved_widths)
from meshtrain.planner.optimizer import MuonGroup, OptimizerPlan, block_matrices, muon_groups, muon_work
from meshtrain.rules.support import fsdp_units


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for weights, gradients, optimizer states; bytes per activation element."""

    name: str
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    compute_dtype: str
    weight_cast_bytes: int = 0
    """Per-parameter cache of low-precision weight copies during forward/backward (torch autocast)."""


PRECISIONS = {p.name: p for p in (
    Precision("bf16", 2, 4, 12, 2, "bfloat16"),            # Megatron-LM bf16: fp32 main grads, reduced in fp32
    Precision("fp16", 2, 2, 12, 2, "bfloat16"),            # ZeRO's K=12 (fp16 grads); fp16 peak = bf16 peak
    Precision("fp32", 4, 4, 8, 4, "float32"),              # the trainer without autocast
    Precision("bf16-autocast", 4, 4, 8, 2, "bfloat16", 2),  # the trainer with bf16 autocast, fp32 master
    Precision("fp8", 2, 4, 8, 2, "bfloat16"),  # DeepSeek-V3 (Sec. 3.3.3): fp32 master + grads, bf16 AdamW moments
)}
FP8_CACHED_BYTES = 1 + 4 / 128
"""Bytes per activation element a Linear caches in FP8 for its backward (``Framework.fp8``): one E4M3 byte and a fp32
scale per 1x128 tile (DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.3.2, "Fine-Grained Quantization")."""
E5M6_BYTES = 12 / 8
"""Bytes per element of the output projection's input under ``Framework.fp8``: the customized E5M6 format (1 sign,
5 exponent, 6 mantissa bits) the V3 report keeps it in, since the attention's backward reads it too (Sec. 3.3.3)."""


@dataclass
class MemoryBreakdown:
    """Bytes per device on the busiest pipeline stage; ``total`` is the predicted peak."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.overhead

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"total": self.total}


def stage_layers(model: ModelSpec, layout: Layout) -> int:
    """Layers on the busiest pipeline stage: ``ceil(L / pp)`` (uneven splits put fewer on the ends)."""
    return math.ceil(model.layers / layout.pp)


def pipeline_item_costs(model: ModelSpec, tokens: float) -> tuple[float, float, float]:
    """(embedding, one block, head) FLOPs per optimizer step for ``tokens`` tokens per pipeline rank, the costs the
    trainer balances its pipeline split by (each family's ``layer_costs``, :mod:`meshtrain.parallel.pipeline.balance`):
    forward FLOPs per token x 3 for forward and backward (Narayanan et al. 2021, Eq. 3, per layer; attention counted
    non-causal, ``4 s q``), and :data:`~meshtrain.models.family.OPTIMIZER_FLOPS_PER_PARAM` per parameter each part
    updates (the embedding's ``V h`` (+ ``s h``), a block's, the final norm and an untied head's). The head carries the
    multi-token prediction modules' projections and second pass through the head
    (:func:`~meshtrain.planner.model_specs.head_flops_per_token`; their blocks are among the blocks), as the family's
    ``layer_costs`` charge the last stage (DeepSeek-V3's one depth doubles the head's logits GEMM: 2 x 2hV per token)."""
    opt = OPTIMIZER_FLOPS_PER_PARAM
    block = 3 * (dense_flops_per_token(model) + attention_flops_per_token(model, causal=False)) * tokens
    head = 3 * head_flops_per_token(model) * tokens  # the logits, and each MTP depth's M_k and second head pass
    return (opt * model.embedding_params(), block + opt * model.layer_params(), head + opt * model.head_params())


def stage_loads(model: ModelSpec, layout: Layout, fw: Framework) -> tuple[tuple[int, bool], ...]:
    """``(blocks, holds the head)`` of the pipeline ranks as ``fw`` cuts the model (``Framework.pp_split``), each
    distinct load once, for :func:`meshtrain.planner.cost.micro_batch` to time and take the busiest of.

    - "uniform": ``((ceil(L / pp), True),)``, the busiest stage's blocks and the head charged together (Megatron-LM);
    - "balanced": the trainer's split (:func:`meshtrain.parallel.pipeline.balance.split_layers` of ``pp *
      virtual_stages`` chunks at :func:`pipeline_item_costs`, placed on ranks as the schedule places them,
      :func:`~meshtrain.parallel.pipeline.balance.chunk_ranks`), each rank's chunks summed;
    - "ends-as-blocks": ``L + 2`` items (embedding, blocks, head) spread over the chunks as DeepSpeed's
      ``partition_uniform`` spreads them (the first ``(L + 2) % chunks`` chunks one more), the embedding on the first
      chunk and the head on the last.

    ``pp = 1``: one rank with every block and the head."""
    return _pipeline(model, *_split_key(layout, fw))[0]


def rank_loads(model: ModelSpec, layout: Layout, fw: Framework) -> tuple[tuple[int, bool], ...]:
    """:func:`stage_loads` per pipeline rank, rank 0 first; "uniform" gives every rank ``ceil(L / pp)`` blocks and the
    head to the last chunk's rank (the last rank, rank 0 under ZB-V)."""
    return _pipeline(model, *_split_key(layout, fw))[1]


def _split_key(layout: Layout, fw: Framework | None) -> tuple[int, int, str, str, int]:
    """What the split depends on: (pp, virtual stages, placement, split, sequences per pipeline rank and step, as the
    trainer counts its tokens; 0 where the split does not weigh costs). No framework: the uniform split."""
    if layout.pp == 1:
        return 1, 1, "", "uniform", 0
    split = fw.pp_split if fw is not None else "uniform"
    tokens = layout.gradient_accumulation_steps * layout.micro_batch_size if split == "balanced" else 0
    return layout.pp, layout.virtual_stages, RULES[layout.pp_schedule].placement, split, tokens


@lru_cache(maxsize=4096)
def _pipeline(model: ModelSpec, pp: int, virtual: int, placement: str, split: str,
              tokens: int) -> tuple[tuple[tuple[int, bool], ...], tuple[tuple[int, bool], ...], tuple[int, int]]:
    """(distinct loads, loads per rank, (blocks of the loss's rank, blocks of the rank with the most micro-batches in
    flight)) of :func:`stage_loads`, :func:`rank_loads` and the activation memory (:func:`_activation_parts`). Rank 0
    holds the most micro-batches in flight and each later rank fewer, so the largest rank's blocks times rank 0's
    count bounds every rank's from above; under ZB-V (placement "v") every rank holds the same count, the loss's
    rank among them, so the largest rank's blocks stand for it too."""
    if pp == 1:
        return ((model.layers, True),), ((model.layers, True),), (model.layers, model.layers)
    if split == "uniform":  # the head on the last chunk's rank: pp - 1, or rank 0 under ZB-V's V
        n, head_rank = math.ceil(model.layers / pp), 0 if placement == "v" else pp - 1
        return ((n, True),), tuple((n, rank == head_rank) for rank in range(pp)), (n, n)
    loads = _split_loads(model, pp, virtual, placement, split, tokens * model.seq_len)
    most = max(blocks for blocks, _ in loads)
    loss = most if placement == "v" else next(blocks for blocks, head in loads if head)
    return tuple(dict.fromkeys(loads)), loads, (loss, most)


def _split_loads(model: ModelSpec, pp: int, virtual: int, placement: str, split: str,
                 tokens: int) -> tuple[tuple[int, bool], ...]:
    n_chunks = pp * virtual
    if split == "balanced":
        chunks = [(c.end_layer - c.first_layer, c.has_head)
                  for c in split_layers(model.layers, n_chunks, pipeline_item_costs(model, tokens))]
    else:  # "ends-as-blocks"
        size, extra = divmod(model.layers + 2, n_chunks)
        sizes = [size + (c < extra) for c in range(n_chunks)]
        chunks = [(sizes[c] - (c == 0) - (c == n_chunks - 1), c == n_chunks - 1) for c in range(n_chunks)]
    loads = [(0, False)] * pp
    for c, rank in enumerate(chunk_ranks(pp, n_chunks, placement)):
        loads[rank] = (loads[rank][0] + chunks[c][0], loads[rank][1] or chunks[c][1])
    return tuple(loads)


def stage_params(model: ModelSpec, layout: Layout, framework: Framework | None = None) -> float:
    """Parameters on one device of the pipeline rank that holds the most, before ZeRO sharding: its blocks of the
    framework's split (:func:`rank_loads`; without a framework Megatron's uniform one), plus the embedding on rank 0
    and the head on the last chunk's rank (rank 0 too under ZB-V, whose V puts the first and last chunk there; an
    untied copy of a tied head once they are on different stages), all split over tp (vocab-parallel embedding), but
    for a mixture of experts' routers and experts, which tp replicates and ep splits (each ep rank holds E/ep
    experts)."""
    return _rank_params(model, layout.tp, layout.ep, *_split_key(layout, framework))


def stage_params_floor(model: ModelSpec, tp: int, pp: int, ep: int = 1) -> float:
    """A lower bound of :func:`stage_params` over every split and schedule of ``pp`` stages: the average rank's
    parameters, ``ceil(L / pp)`` blocks (some rank holds that many), and one block with the larger end (each rank
    holds a block at least)."""
    layer, emb, head = _param_parts(model, tp, ep, pp)
    if pp == 1:
        return model.layers * layer + emb + head
    return max((model.layers * layer + emb + head) / pp, math.ceil(model.layers / pp) * layer, layer + max(emb, head))


def _param_parts(model: ModelSpec, tp: int, ep: int, pp: int) -> tuple[float, float, float]:
    """(one block's, the embedding's, the head's) parameters on one device."""
    replicated = model.tp_replicated_params  # over tp; the router and a gated shared expert over ep too
    layer = (model.layer_params() - model.expert_params() - replicated) / tp + model.expert_params() / ep + replicated
    untied = model.vocab * model.hidden if model.tied_embeddings and pp > 1 else 0  # the head's own copy
    norm = (2 if model.biases else 1) * model.hidden if model.final_norm else 0  # replicated over tp
    return layer, model.embedding_params() / tp, (model.head_params() - norm + untied) / tp + norm


def _rank_params(model: ModelSpec, tp: int, ep: int, pp: int, virtual: int, placement: str, split: str,
                 tokens: int) -> float:
    return _busiest_rank(model, tp, ep, pp, virtual, placement, split, tokens)[0]


@lru_cache(maxsize=4096)
def _busiest_rank(model: ModelSpec, tp: int, ep: int, pp: int, virtual: int, placement: str, split: str,
                  tokens: int) -> tuple[float, int]:
    """(parameters, blocks) of the pipeline rank that holds the most parameters (the first such rank)."""
    layer, emb, head = _param_parts(model, tp, ep, pp)
    loads = _pipeline(model, pp, virtual, placement, split, tokens)[1]
    return max(((blocks * layer + (emb if rank == 0 else 0.0) + (head if has_head else 0.0), blocks)
                for rank, (blocks, has_head) in enumerate(loads)), key=lambda load: load[0])


def most_blocks(model: ModelSpec, layout: Layout, framework: Framework | None = None) -> int:
    """Blocks of the pipeline rank that holds the most (:func:`rank_loads`): the busiest rank of a step's per-block
    work outside forward and backward (Muon's Newton-Schulz, :func:`muon_groups_of`)."""
    return _pipeline(model, *_split_key(layout, framework))[2][1]


def muon_groups_of(model: ModelSpec, layout: Layout, blocks: int, framework: Framework | None) -> list[MuonGroup]:
    """:func:`meshtrain.planner.optimizer.muon_groups` of ``blocks`` blocks of ``layout`` (none but with Muon)."""
    plan = framework.optimizer if framework is not None else OptimizerPlan()
    if not plan.muon or model.adapter_layer_params:
        return []
    return muon_groups(model, blocks, layout.tp, layout.dp * layout.sp, layout.ep, layout.zero_stage, plan.exchange)


def muon_params(model: ModelSpec, layout: Layout, framework: Framework) -> tuple[float, float]:
    """(Muon's parameters on the rank :func:`stage_params` counts, its ZeRO shard of them), the
    :func:`trained_params` Muon takes, counted as :func:`_state_memory` counts the trained ones: the rank's blocks'
    :func:`~meshtrain.planner.optimizer.block_matrices` (expert stacks / ep; sharded: of every expert, less what
    Megatron's folding spreads over tp); with LoRA every adapter (all matrices). (0, 0) without Muon."""
    if not framework.optimizer.muon:
        return 0.0, 0.0
    shard = layout.dp * layout.sp
    if model.adapter_layer_params:  # modules_to_save (embedding, head) go to AdamW, as without adapters
        t = trained_params(model, layout, framework) - saved_params(model, layout)
        return t, t / shard
    split = _split_key(layout, framework)
    mats = block_matrices(model)
    held = _busiest_rank(model, layout.tp, layout.ep, *split)[1] * mats.params(layout.tp, layout.ep)
    sharded = _busiest_rank(model, layout.tp, 1, *split)[1] * mats.params(layout.tp, 1) / shard
    sharded -= stage_layers(model, layout) * model.expert_params() * (1 - 1 / framework.expert_fold(layout.tp)) / shard
    return held, sharded


def fsdp_unit_shape(model: ModelSpec, layout: Layout, framework: Framework) -> tuple[int, int]:
    """``(units, blocks per unit)`` of the busiest stage under ZeRO-3/FSDP: its blocks grouped as the
    trainer groups them (:func:`meshtrain.rules.support.fsdp_units`); blocks left over stay in the root."""
    return _unit_shape(4 * model.layer_params() / layout.tp, stage_layers(model, layout), framework.fsdp_unit_bytes)


@lru_cache(maxsize=4096)
def _unit_shape(block_bytes: float, blocks: int, unit_bytes: float) -> tuple[int, int]:
    """:func:`fsdp_unit_shape` of ``blocks`` equal blocks (cached: the search asks it once per candidate)."""
    units, _ = fsdp_units([block_bytes] * blocks, unit_bytes)
    return len(units), (len(units[0]) if units else 0)


def layer_activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, framework: Framework,
                           recompute: str | None = None, composite_norms: bool = False) -> float:
    """Activation bytes one layer keeps for backward, per micro-batch, on one device.

    Korthikanti et al. 2022, Sec. 4.1 split into tp-replicated parts (norm inputs 4sbh, qkv and fc1
    inputs 2sbh each, two dropout masks sbh each) and tp-sharded parts (Q, K, V and the out-proj input, each at its
    own width: :func:`_attention_saved_bytes`; the MLP's hidden tensors, :func:`_mlp_saved_bytes`; and with
    materialized attention the scores 2as^2b + softmax mask as^2b + dropout out 2as^2b). Element size
    ``precision.activation_bytes``; masks 1 byte; under ``Framework.fp8`` the Linear inputs
    :data:`FP8_CACHED_BYTES`. What the framework's eager code keeps besides: K and V at the query width
    (``Framework.repeats_kv``), SwiGLU's fourth f-wide tensor (``swiglu_keeps_activation``), and with
    ``composite_norms`` (torch's RMSNorm on a CPU, which has no fused kernel there: ``aten._fused_rms_norm``
    dispatches to CUDA only) each RMSNorm's normalised input; with ``Framework.norm_recompute`` the norms' outputs
    (the qkv and fc1 inputs) are not kept.
    """
    recompute = recompute or layout.recompute
    b, s, h = layout.micro_batch_size, model.seq_len / layout.sp, model.hidden
    t, e = layout.tp, precision.activation_bytes
    cached = FP8_CACHED_BYTES if framework.fp8 else e  # a Linear's input kept for its weight gradient
    routed = s * b * (model.experts * 4 + model.experts_per_token * h * cached) if model.experts else 0.0  # fp32
    # router probabilities and the k copies of each token the experts take (mixture of experts, meshtrain.models.moe);
    # each tp rank routes its own s/tp tokens where the framework folds ep into tp (Framework.expert_folding)
    routed *= (model.moe_fraction if model.dense_layers else 1.0) / framework.expert_fold(t)  # MoE layers only
    sharded_seq = t if layout.tp_sequence_parallel else 1
    if recompute == "full":
        return s * b * h * e / sharded_seq
    if recompute == "selective" and framework.selective == "op-level":
        return s * b * h * e / sharded_seq + op_level_saved_bytes(model, layout, e) + routed
    if recompute == "selective" and framework.selective == "op-level-alternate":
        return s * b * h * e / sharded_seq + alternate_saved_bytes(model, layout, e) + routed
    masks = 2 if model.dropout else 0  # attention-output and MLP-output dropout masks, 1 byte each
    norms = 2 + (2 if composite_norms and model.norm == "rmsnorm" else 0)  # the 2 norms' inputs (+ normalised)
    first = 0 if framework.norm_recompute else 2 * cached  # the qkv and fc1 inputs: the norms' outputs
    replicated = s * b * (h * e * norms + h * first + masks * h)
    attention, latents = _attention_saved_bytes(model, framework, e)
    sharded = s * b * (attention + _mlp_saved_bytes(model, framework, e, cached)) + s * b * latents * t
    if framework.attention == "materialized" and recompute == "none":
        per_score = 2 * e + 1 if model.dropout else e  # softmax out (+ mask + dropout out)
        sharded += model.heads * s * model.seq_len * b * per_score / layout.sp
    return replicated / sharded_seq + sharded / t + routed


def _attention_saved_bytes(model: ModelSpec, framework: Framework, e: float) -> tuple[float, float]:
    """(tp-sharded, tp-replicated) bytes per token one layer's attention keeps: Q, K, V and the output (the
    out-projection's input), each at its own width (q = heads x head_dim, which is not h for Qwen3 or GLM-4.5; K and V
    at the query width where ``Framework.repeats_kv``); with MLA its heads and latents
    (:func:`~meshtrain.planner.model_specs.mla_saved_widths`, in place of Q, K, V). Under ``Framework.fp8`` the output
    in E5M6 (:data:`E5M6_BYTES`), q, k and v in 16 bits (the attention kernel runs in bf16, V3 report Sec. 3.3.1)."""
    out = E5M6_BYTES if framework.fp8 else e
    if model.kv_lora_rank:
        latents, heads = mla_saved_widths(model, framework.mla_up_proj_recompute)
        return (heads - model.v_dim) * e + model.v_dim * out, latents * e
    kv = model.q_dim if framework.repeats_kv else model.kv_dim
    return (model.q_dim + 2 * kv) * e + model.v_dim * out, 0.0


def _mlp_saved_bytes(model: ModelSpec, framework: Framework, e: float, cached: float) -> float:
    """Bytes per token one layer's MLP keeps, tp-sharded (a mean over the layers with ``dense_layers``). GELU: fc1's
    output and fc2's input. A SwiGLU of width w: the gate's and up's outputs (its inputs), silu's output where the
    framework keeps it (``swiglu_keeps_activation``) and the product (down's input, ``cached`` bytes: a Linear input).
    Routed experts (k of width f) and shared ones (S) under ``Framework.fp8`` keep the SwiGLU's inputs in FP8 too, and
    with ``Framework.moe_act_recompute`` not its product (recomputed from them, V3 report Sec. 3.3.3); the dense first
    layers (width D) keep the plain SwiGLU's."""
    if model.activation != "swiglu":
        return model.active_ffn * (e + cached)
    silu = e if framework.swiglu_keeps_activation else 0.0
    if not model.experts:
        return model.ffn_hidden * (2 * e + silu + cached)
    inputs = cached if framework.fp8 else e
    experts = (model.active_ffn + model.shared_ffn) * (2 * inputs + silu + (0.0 if framework.moe_act_recompute
                                                                             else cached))
    share = model.moe_fraction if model.dense_layers else 1.0
    return share * experts + (1 - share) * model.dense_ffn * (2 * e + silu + cached)


def backward_working_bytes(model: ModelSpec, layout: Layout, precision: Precision, framework: Framework) -> float:
    """Bytes one layer's backward allocates beyond what the layers keep, per micro-batch on one device: the larger of
    its MLP's and its attention's gradients alive at once (the layer's own saved tensors are freed as its backward
    goes, so they are not counted twice). ``s`` the sequence over sp, ``q`` the attention width, ``kv`` K/V's (the
    query width where ``Framework.repeats_kv``), both over tp, ``e`` the activation bytes:

    - the MLP (SwiGLU or GELU): the down projection's input gradient replaces its saved input, then the activation's
      or product's backward writes the gradients of its two f-wide inputs before its saved ones are freed, beside the
      h-wide gradients of the block's output and the MLP's input: ``s*b*(2f/t + 2h)*e``;
    - the attention, by sp mode (the kernel's fused backward, :class:`meshtrain.parallel.sequence.UlyssesAttention`,
      :class:`meshtrain.parallel.sequence.RingAttention`):

      - one rank or Ulysses: the output's gradient and dq, dk, dv: ``s*b*(2q + 2kv)*e``; Ulysses' all-to-alls add
        their send copies and receive buffers of the output's gradient and of dq, dk, dv: ``s*b*(4q + 4kv)*e`` in all;
      - ring (USP's ring of Ulysses-gathered heads, the same per rank): in fp32, the dq accumulator, K and V stacked,
        their gradients travelling with them, both received from the ring, and one chunk pair's dq, dk, dv (half the
        rows): ``s*b*(q + 8kv + (q + 2kv)/2)*4`` beside the output's gradient ``s*b*q*e``.

    Measured tensor by tensor with torch's ``MemTracker`` on the trainer's Llama at sp = 1, 2, 4 in every mode
    (``tests/test_planner_memory_mechanisms.py``, docs/planner.md "Memory").
    """
    b, s, h, t, e = layout.micro_batch_size, model.seq_len / layout.sp, model.hidden, layout.tp, precision.activation_bytes
    q = model.q_dim / t
    kv = q if framework.repeats_kv else model.kv_dim / t
    f = model.active_ffn / t
    mlp = s * b * (2 * f + 2 * h) * e
    ring = layout.sp // layout.sp_ulysses if layout.sp_mode == "usp" else layout.sp if layout.sp_mode == "ring" else 1
    if ring > 1:
        attention = s * b * ((q + 8 * kv + (q + 2 * kv) / 2) * 4 + q * e)
    elif layout.sp > 1:
        attention = s * b * (4 * q + 4 * kv) * e
    else:
        attention = s * b * (2 * q + 2 * kv) * e
    return max(mlp, attention)


def op_level_saved_bytes(model: ModelSpec, layout: Layout, e: int) -> float:
    """Bytes per layer and micro-batch that meshtrain's per-operator selective recomputation keeps besides the
    block's input (:mod:`meshtrain.parallel.recompute`): the outputs of

    - the weight GEMMs, ``s*b*e*((q + 2kv + (m-1)*f)/t + 2h)``: the column-parallel q, k, v and MLP up (SwiGLU:
      gate and up) outputs split over tp, the row-parallel attention and MLP down outputs whole (partial sums
      before their reduction; all-gathered rows s with sequence parallelism);
    - the attention kernel, ``s*b*q/t*e`` plus its fp32 log-sum-exp ``s*b*a/t*4``; ring attention keeps every
      chunk pair's, (2sp+1)/2 times that, in fp32 (:class:`meshtrain.parallel.sequence.ring.RingAttention`);
    - the collectives: tp's two all-reduces ``2*s*b*h*e``, or with sequence parallelism two all-gathers
      ``2*s*b*h*e`` and two reduce-scatters ``2*s*b*h*e/t``; Ulysses' all-to-alls of q, k, v and the output
      ``s*b*e*(2q + 2kv)/t``.

    ``s`` is the sequence over sp. Measured per operator on the trainer (docs/planner.md). Takeaway: it keeps
    about 11 of the ~16 activations of h per token a plain fp32 GPT block keeps (GELU MLP, no dropout), so it
    saves less than full recomputation but recomputes no GEMM.
    """
    b, s, h, t = layout.micro_batch_size, model.seq_len / layout.sp, model.hidden, layout.tp
    kv, up = model.kv_dim, (model.mlp_matrices - 1) * model.active_ffn
    gemms = s * b * e * ((model.q_dim + 2 * kv + up) / t + 2 * h)  # q is heads x head_dim wide
    ring = layout.sp > 1 and layout.sp_mode == "ring"
    pairs = (2 * layout.sp + 1) / 2 if ring else 1.0
    attention = pairs * s * b * (model.v_dim * (4 if ring else e) + model.heads * 4) / t
    collectives = 0.0
    if t > 1:
        collectives += 2 * s * b * h * e * (1 + 1 / t if layout.tp_sequence_parallel else 1)
    if layout.sp > 1 and not ring:
        collectives += s * b * e * (2 * h + 2 * kv) / t
    return gemms + attention + collectives


def torchtitan_gemms(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(K, N) of one block's weight GEMMs in the order they run in torchtitan's Llama
    (``models/llama3/model/model.py`` of pytorch/torchtitan): wq, wk, wv, wo, then w1, w3, w2 (SwiGLU) or w1, w2."""
    h, q, kv, f = model.hidden, model.q_dim, model.kv_dim, model.active_ffn
    mlp = ((h, f), (h, f), (f, h)) if model.mlp_matrices == 3 else ((h, f), (f, h))
    return ((h, q), (h, kv), (h, kv), (q, h)) + mlp


def torchtitan_gemm_outputs(model: ModelSpec, tp: int) -> tuple[float, ...]:
    """Output widths (elements per token on one tp rank) of :func:`torchtitan_gemms`: column-parallel outputs are
    split over tp; the row-parallel wo and w2 (the GEMMs whose output width is h after a sharded K) write whole
    rows of partial sums before their reduction."""
    gemms = torchtitan_gemms(model)
    row_parallel = {3, len(gemms) - 1}
    return tuple(n if i in row_parallel else n / tp for i, (_, n) in enumerate(gemms))


def alternate_saved_bytes(model: ModelSpec, layout: Layout, e: int) -> float:
    """Bytes per layer and micro-batch that torchtitan's op-level selective checkpointing keeps besides the
    block's input (``Framework.selective = "op-level-alternate"``; pytorch/torchtitan
    ``distributed/activation_checkpoint.py``, ``_custom_policy``): the outputs of

    - every other weight GEMM, counted per block in forward order, the 1st, 3rd, 5th and 7th
      (:func:`torchtitan_gemm_outputs`: wq, wv, w1 and w2 of a SwiGLU Llama); the 2nd, 4th and 6th are recomputed;
    - the attention kernel, ``s*b*q/t*e`` plus its fp32 log-sum-exp ``s*b*a/t*4``;
    - the reduce-scatters of sequence parallelism, ``2*s*b*h*e/t`` (all-gathers are not in the policy's list:
      recomputed, so sent again).

    ``s`` is the sequence over sp; ``b`` the micro-batch.
    """
    b, s, h, t = layout.micro_batch_size, model.seq_len / layout.sp, model.hidden, layout.tp
    outputs = torchtitan_gemm_outputs(model, t)
    gemms = s * b * e * sum(outputs[0::2])
    attention = s * b * (model.v_dim * e + model.heads * 4) / t
    collectives = 2 * s * b * h * e / t if t > 1 and layout.tp_sequence_parallel else 0.0
    return gemms + attention + collectives


def in_flight_microbatches(layout: Layout) -> float:
    """Micro-batches whose activations the first (fullest) stage holds at its peak
    (:func:`meshtrain.rules.pipeline.microbatches_in_flight`, the trainer's schedules)."""
    return microbatches_in_flight(layout.pp_schedule, layout.pp, layout.gradient_accumulation_steps,
                                  layout.virtual_stages)


def activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, framework: Framework,
                     composite_norms: bool = False) -> float:
    """Peak activation bytes on the busier of two ranks, each at its own peak:

    - the first rank: its stored layers x in-flight micro-batches (:func:`in_flight_microbatches`) and one layer
      being back-propagated: what recomputation brings back beyond its stored bytes, and its gradients
      (:func:`backward_working_bytes`);
    - the rank with the loss (the same one at pp = 1 and under zbv): its stored layers x its in-flight
      micro-batches (:func:`meshtrain.rules.pipeline.loss_rank_in_flight`), what each waiting micro-batch's loss
      keeps (the fp32 log-softmax, 4 bytes per logit; chunked, the logits), and the larger of the loss's backward
      (``Framework.loss_backward_bytes`` per logit, ``loss_parallel_bytes`` under tp, or the chunked loss's
      ``2e`` per logit and a chunk or two, :attr:`Framework.loss_chunk_bytes`) and one layer's backward: the logits are
      freed before the layers' backward begins, so the two never add up.

    Logits per micro-batch: ``b*s/sp`` tokens x ``V/t`` (vocab-parallel under tp). ``composite_norms``: as
    :func:`layer_activation_bytes` (a CPU).
    """
    per_layer = layer_activation_bytes(model, layout, precision, framework, composite_norms=composite_norms)
    return _activations(_activation_parts(model, layout, precision, framework, composite_norms), per_layer)


class ActivationParts(NamedTuple):
    """What :func:`activation_bytes` needs besides the stored bytes per layer (bytes; counts of layers and
    micro-batches)."""

    layers: float
    """The loss rank's layers."""
    whole: float
    """One layer's activations without recomputation."""
    working: float
    """One layer's backward gradients (:func:`backward_working_bytes`)."""
    waiting: float
    """What one micro-batch waiting for its loss's backward keeps."""
    held: float
    """The loss rank's micro-batches in flight."""
    loss: float
    """The loss's backward."""
    first: float
    """The first rank's micro-batches in flight, or 0 when the loss is on it."""
    first_layers: float
    """The first rank's layers."""


def _activation_parts(model: ModelSpec, layout: Layout, precision: Precision, framework: Framework,
                      composite_norms: bool) -> ActivationParts:
    """What :func:`activation_bytes` needs besides the stored bytes per layer, which alone depend on the recompute
    mode: (the loss rank's layers, one layer's backward, the bytes one waiting micro-batch's loss keeps, the loss
    rank's micro-batches, the loss's backward in bytes, the first rank's micro-batches or 0 when the loss is on it,
    the layers those count for). The layers are those of the framework's pipeline split (:func:`_pipeline`)."""
    n, n_first = _pipeline(model, *_split_key(layout, framework))[2]
    whole = layer_activation_bytes(model, layout, precision, framework, "none", composite_norms)
    working = backward_working_bytes(model, layout, precision, framework)
    logits = layout.micro_batch_size * model.seq_len / layout.sp * model.vocab / layout.tp
    m, v = layout.gradient_accumulation_steps, layout.virtual_stages
    held = loss_rank_in_flight(layout.pp_schedule, layout.pp, m, v)
    if layout.tp == 1 and framework.loss_chunk_bytes > 0:
        e = precision.activation_bytes
        chunks = 1 if e == 4 else 2  # the chunk's fp32 softmax, and its fp32 upcast of 16-bit logits
        waiting, loss = logits * e, logits * 2 * e + chunks * min(framework.loss_chunk_bytes, logits * 4)
    else:
        waiting = logits * 4
        loss = logits * (framework.loss_parallel_bytes if layout.tp > 1 else framework.loss_backward_bytes)
    first = 0.0 if layout.pp == 1 or layout.pp_schedule == "zbv" else in_flight_microbatches(layout)
    if framework.pp_bubble == "dualpipe" and layout.pp > 1:  # PP + 1 micro-batches of a stage on rank 0 (V3 report,
        first = float(min(m, layout.pp + 1))  # Table 2), the first stage of one direction and the last of the other
    return ActivationParts(n, whole, working, waiting, held, loss, first, n_first)


def _activations(parts: ActivationParts, per_layer: float) -> float:
    """:func:`activation_bytes` from :func:`_activation_parts` and the stored bytes per layer."""
    n, whole, transient, waiting, held, loss, first, n_first = parts
    working = whole - per_layer + transient  # the layer in backward: recomputed beyond what it kept, and its gradients
    loss_rank = n * held * per_layer + waiting * (held - 1) + max(working, loss)
    return loss_rank if not first else max(n_first * first * per_layer + working, loss_rank)


def memory_breakdown(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision,
                     framework: Framework) -> MemoryBreakdown:
    """Predicted peak bytes per device, by part.

    ZeRO sharding over ``dp*sp`` (Rajbhandari et al. 2020, Sec. 5). Gradients stay unsharded while
    gradient accumulation skips synchronisation (FSDP2 ``set_requires_gradient_sync(False)``; Megatron's
    distributed optimizer, stage 1, keeps a full gradient buffer anyway). Stage 2 as FSDP2 with
    ``reshard_after_forward=False`` holds unsharded weights through the step next to the shards; stage 3
    gathers two units of blocks at a time (current + prefetched; :func:`fsdp_unit_shape`) and holds the
    root's parameters (embedding, head and blocks left out of the units) through the step. In backward
    the root's gradients (head first, embedding last) and the current unit's are unsharded until their
    reduce-scatter, whose flat input copies a unit's gradients once more. Under a pipeline (pp > 1) torch's
    stages keep the whole stage's weights and gradients unsharded from the first backward on, and reduce the
    gradients once after the last micro-batch (``torch.distributed.pipelining.stage``, meshtrain's and
    torchtitan's pipelines). The peak is the larger of the forward/backward
    peak (activations, gathered weights) and the optimizer-step peak (PyTorch's foreach AdamW: one fp32
    temporary per parameter), on top of the model states and the runtime's fixed overhead.
    """
    return RecomputeMemory(model, layout, hw, precision, framework)(layout.recompute)


class ActivationMemory:
    """``activations(mode)`` = :func:`activation_bytes` of ``layout`` with recompute = ``mode``. What the modes share
    (the layer being back-propagated, the logits, the micro-batches in flight) is computed once, and each mode's
    bytes once. The activations do not depend on ``zero_stage`` nor on the gradient all-reduce, so one instance
    serves every layout that differs from ``layout`` only there (the search's candidate groups)."""

    def __init__(self, model: ModelSpec, layout: Layout, precision: Precision, framework: Framework,
                 composite_norms: bool) -> None:
        self.model, self.layout, self.precision, self.framework = model, layout, precision, framework
        self.composite_norms = composite_norms
        self.parts = _activation_parts(model, layout, precision, framework, composite_norms)
        self.by_mode: dict[str, float] = {}

    def __call__(self, mode: str) -> float:
        try:
            return self.by_mode[mode]
        except KeyError:
            per_layer = self.parts.whole if mode == "none" else layer_activation_bytes(
                self.model, self.layout, self.precision, self.framework, mode, self.composite_norms)
            value = self.by_mode[mode] = _activations(self.parts, per_layer)
            return value


def memoized(memo: dict | None, key: tuple, compute: Callable[..., Any], *args: Any) -> Any:
    """``compute(*args)``, kept in ``memo`` under ``key`` (no memo: computed every time): a search's memo of the parts
    that many layouts share (:func:`state_memory`, :func:`meshtrain.planner.cost.step_time`). A key holds every layout
    field the part reads and the results of the helpers it calls, so that it stays right when those helpers change
    (``tests/test_planner_search.py`` checks a search's numbers against no memo)."""
    if memo is None:
        return compute(*args)
    try:
        return memo[key]
    except KeyError:
        value = memo[key] = compute(*args)
        return value


@dataclass(frozen=True)
class StateMemory:
    """The bytes of a layout that no recompute mode changes (:func:`memory_breakdown` has the mechanisms): weights,
    gradients and optimizer states, the buffers (gathered weights, unsharded gradients, DDP's buckets), ``fixed``
    (buffers + autocast's weight copies, held through forward and backward), the optimizer step's temporary
    ``optimizer_peak`` and the runtime's ``overhead``."""

    weights: float
    grads: float
    optimizer: float
    gathered: float
    fixed: float
    optimizer_peak: float
    overhead: float


def state_memory(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, framework: Framework,
                 memo: dict | None = None) -> StateMemory:
    """:class:`StateMemory` of ``layout`` (DiLoCo: one worker's, the outer weights and momentum counted with the
    optimizer's states). ``memo``: a dict shared by the calls for one model, hardware, precision and
    framework (a search's), keyed by the layout fields read here: tp, pp, dp*sp, ep, zero_stage and whether
    gradient_accumulation_steps is 1 (``tests/test_planner_search.py`` checks a search's memory against no memo)."""
    if layout.diloco_group:  # one worker's layout, plus DiLoCo's fp32 outer weights and momentum of what a rank holds
        inner = replace(layout, dp=layout.dp // layout.diloco_workers, diloco_group=0)
        states = state_memory(model, inner, hw, precision, framework, memo)
        held = stage_params(model, inner, framework) / (inner.dp * inner.sp if inner.zero_stage >= 2 else 1)
        return replace(states, optimizer=states.optimizer + 8 * held)
    if framework.pp_bubble == "dualpipe" and layout.pp > 1:  # two stages a rank (two copies of the parameters,
        # V3 report Table 2), the first and the last together: as many blocks and ends as a pipeline of pp/2 (no memo:
        # its key would be that pipeline's)
        return _state_memory(model, replace(layout, pp=layout.pp // 2), hw, precision, framework)
    split = _split_key(layout, framework) if layout.pp > 1 else ()
    if split and split[4]:  # a split weighing the costs at this many tokens: what matters is the ranks' parameters
        # (and, for Muon's count and temporaries, the blocks of the rank that holds the most)
        split = (_busiest_rank(model, layout.tp, layout.ep, *split), _busiest_rank(model, layout.tp, 1, *split))
    key = ("states", layout.tp, layout.pp, layout.dp * layout.sp, layout.ep, layout.zero_stage,  # one framework a memo
           layout.gradient_accumulation_steps == 1, split)
    return memoized(memo, key, _state_memory, model, layout, hw, precision, framework)


def _state_memory(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision,
                  framework: Framework) -> StateMemory:
    p, shard, z = stage_params(model, layout, framework), layout.dp * layout.sp, layout.zero_stage
    # ZeRO shards: expert parallelism holds E/ep experts on a rank, FSDP2 shards them over the dp*sp/ep ranks that
    # hold the same ones, the rest over dp*sp: either way 1/(dp*sp) of the whole stage (meshtrain.parallel.expert).
    # Folded into tp too (Framework.expert_folding), the experts' shards spread over tp*dp*sp ranks.
    sharded = _rank_params(model, layout.tp, 1, *_split_key(layout, framework)) / shard
    sharded -= stage_layers(model, layout) * model.expert_params() * (1 - 1 / framework.expert_fold(layout.tp)) / shard
    # LoRA: the adapters (t, split over tp with their base) are trained, the rest frozen; QLoRA stores q of the
    # frozen weights as NF4. Without adapters t = p and q = 0.
    t, q = trained_params(model, layout, framework), nf4_params(model, layout)
    nf4_saving = precision.weight_bytes - NF4_BYTES  # per quantized weight
    adapters = t - saved_params(model, layout) if model.adapter_layer_params else 0.0  # weights beside the base's
    shard_weight, optimizer_bytes = shard_bytes(precision, framework, z)
    if z >= 3:
        weights = sharded * shard_weight + (adapters * precision.weight_bytes - q * nf4_saving) / shard
    else:
        weights = p * precision.weight_bytes + adapters * precision.weight_bytes - q * nf4_saving
    if model.reference_copy:  # DPO's frozen reference: the weights again, sharded as the policy's at rest (ZeRO 2, 3)
        weights += (sharded if z >= 2 else p) * precision.weight_bytes
    # torch.distributed.pipelining's stages keep FSDP2's weights and gradients unsharded from the first backward
    # to the step's end (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``)
    pipelined = layout.pp > 1
    grads_sharded = z >= 2 and not pipelined and (layout.gradient_accumulation_steps == 1
                                                  or framework.grad_sync_every_microstep)
    trained = t / shard if model.adapter_layer_params else sharded  # what a ZeRO shard holds of the trained ones
    grads = (trained if grads_sharded else t) * precision.grad_bytes
    taken = muon_params(model, layout, framework)[1 if z >= 1 else 0]  # Muon's of them (0 for another optimizer)
    updated = trained if z >= 1 else t
    optimizer = framework.optimizer.state_bytes(updated, taken, optimizer_bytes)
    block = _param_parts(model, layout.tp, layout.ep, layout.pp)[0]  # one block on this device (E/ep experts)
    gathered = 0.0
    if z >= 2:
        units, per_unit = fsdp_unit_shape(model, layout, framework)
        unit = per_unit * block
        root = p - units * unit  # the root unit: embedding, head and the blocks left out of the units
        held = p if z == 2 or pipelined else root + min(units, 2) * unit  # unsharded weights
        live = root + min(units, 1) * unit if grads_sharded else 0.0  # unsharded gradients not yet reduced
        # the reduce-scatter's flat input: a copy of the largest unit's gradients (FSDP2 foreach_reduce);
        # unsharded gradients have the gathered weights' dtype, the reduce-scatter's input the gradients'
        share = t / p  # of the gradients: the trained parameters' (LoRA: the adapters')
        gathered = (held * precision.weight_bytes - held / p * q * nf4_saving + live * share * precision.weight_bytes
                    + max(unit, root) * share * precision.grad_bytes)
    if z <= 1 and shard > 1 and framework.torch_buffers:  # DDP's gradient buckets (zero_stage 1 is DDP too)
        gathered += t * precision.grad_bytes
    return StateMemory(weights=weights, grads=grads, optimizer=optimizer, gathered=gathered,
                       fixed=gathered + (p - q) * precision.weight_cast_bytes,  # NF4 is dequantized a layer at a time
                       optimizer_peak=_optimizer_peak(model, layout, hw, framework, updated, taken),
                       overhead=hw.device.framework_overhead_bytes)


def _optimizer_peak(model: ModelSpec, layout: Layout, hw: Hardware, framework: Framework, updated: float,
                    taken: float) -> float:
    """Bytes the optimizer step holds for a moment on top of the states: PyTorch's foreach AdamW (and SGD's weight
    decay) one fp32 temporary per parameter it updates (``framework.torch_buffers``); with Muon, AdamW's on the rest
    first, then Muon's (:class:`meshtrain.optim.muon.Muon` steps AdamW's groups before its own), the larger of the
    two: :func:`meshtrain.planner.optimizer.muon_work`'s temporaries of the rank's blocks."""
    adamw = (updated - taken) * 4 if framework.torch_buffers else 0.0
    if not framework.optimizer.muon:
        return adamw
    blocks = _busiest_rank(model, layout.tp, layout.ep, *_split_key(layout, framework))[1]
    work = muon_work(muon_groups_of(model, layout, blocks, framework), framework.optimizer, hw.device)
    return max(adamw, work.temporaries)


def shard_bytes(precision: Precision, framework: Framework | None, zero_stage: int) -> tuple[int, int]:
    """(weight, optimizer) bytes per parameter at rest, the optimizer's including any fp32 master copy.

    The precision's own (``precision.weight_bytes``, ``precision.optimizer_bytes``: a 16-bit weight beside a 4-byte
    master in the optimizer, Rajbhandari et al. 2020, Sec. 3.1), except under ZeRO-3 with a framework whose shards
    *are* the fp32 masters (``Framework.master_shards``: PyTorch FSDP with a 16-bit ``param_dtype``, which casts at
    the all-gather): 4 bytes of shard and the optimizer's bytes less its master's 4. For bf16 AdamW that is 4 + 8 = 12
    bytes instead of 2 + 12 = 14 (the 16-bit copy exists only gathered, counted with the buffers). Takeaway: a
    pure-FSDP run holds 2 bytes per sharded parameter less than ZeRO's mixed-precision count says."""
    master = precision.optimizer_bytes - 8  # Adam's m and v are 4 bytes each; what is left is the master copy
    if zero_stage >= 3 and framework is not None and framework.master_shards and precision.weight_bytes == 2 \
            and master == 4:
        return 4, precision.optimizer_bytes - 4
    return precision.weight_bytes, precision.optimizer_bytes


def trained_params(model: ModelSpec, layout: Layout, framework: Framework | None = None) -> float:
    """Parameters with gradients and optimizer states on one device of the busiest pipeline rank, before ZeRO: all
    of :func:`stage_params`, or with LoRA adapters (``model.adapter_layer_params``) its blocks' adapters, split over
    tp with their base linear maps (the replicated half of each pair, ``A`` of a column-parallel map or ``B`` of a
    row-parallel one, is counted split too: r/h of a block's weights, left out)."""
    if not model.adapter_layer_params:
        return stage_params(model, layout, framework)
    return stage_layers(model, layout) * model.adapter_layer_params / layout.tp + saved_params(model, layout)


def saved_params(model: ModelSpec, layout: Layout) -> float:
    """LoRA's ``modules_to_save`` (``model.saved_params``, the embedding and/or head trained in full) on one device,
    split over tp (vocab-parallel); under a pipeline counted whole on the busiest rank, which holds one of them at most
    (an upper bound: the embedding sits on the first rank, the head on the last)."""
    return model.saved_params / layout.tp


def nf4_params(model: ModelSpec, layout: Layout) -> float:
    """QLoRA: frozen weights stored as NF4 on one device of the busiest pipeline rank, before ZeRO (tp is refused
    with NF4, so ``/ tp`` only keeps the formula general)."""
    return stage_layers(model, layout) * model.nf4_layer_params / layout.tp


class RecomputeMemory:
    """``memory(mode)`` = ``memory_breakdown(model, layout with recompute = mode, ...)`` and ``memory.total(mode)`` its
    total alone. The model states, buffers, the layer being back-propagated and the loss are the same in every mode
    and computed once (the search tries up to three modes per candidate); a mode adds its stored bytes per layer.
    ``activations``: an :class:`ActivationMemory` of a layout that differs from ``layout`` at most in ``zero_stage``
    and ``hierarchical_allreduce`` (shared by a search's candidate group; by default, ``layout``'s own); ``memo``:
    as :func:`state_memory`'s."""

    def __init__(self, model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision,
                 framework: Framework, activations: ActivationMemory | None = None, memo: dict | None = None) -> None:
        self.model, self.layout, self.hw, self.precision, self.framework = model, layout, hw, precision, framework
        if layout.ps_servers:
            return
        self.states = state_memory(model, layout, hw, precision, framework, memo)
        self.activations = activations or ActivationMemory(model, layout, precision, framework, composite_norms(hw))

    def __call__(self, mode: str) -> MemoryBreakdown:
        if self.layout.ps_servers:
            return _parameter_server_memory(self.model, replace(self.layout, recompute=mode), self.hw, self.precision,
                                            self.framework)
        s = self.states
        # activations + buffers: the forward/backward peak or the optimizer step's, the larger
        peak = max(s.fixed + self.activations(mode), s.optimizer_peak)
        return MemoryBreakdown(weights=s.weights, gradients=s.grads, optimizer=s.optimizer,
                               activations=peak - s.gathered, buffers=s.gathered, overhead=s.overhead)

    def total(self, mode: str) -> float:
        """``self(mode).total`` without building the breakdown: its sum, term by term in its order (the same float)."""
        if self.layout.ps_servers:
            return self(mode).total
        s = self.states
        peak = max(s.fixed + self.activations(mode), s.optimizer_peak)
        return s.weights + s.grads + s.optimizer + (peak - s.gathered) + s.gathered + s.overhead

    def cheapest_fitting(self, modes: list[str], budget: float) -> str | None:
        """The first of ``modes`` whose total is at most ``budget`` bytes, or None. (Their memory is not monotone:
        per-operator "selective" keeps whole row-parallel outputs and the collectives' buffers, more than "none"
        keeps at large tp or under ring attention.)"""
        for mode in modes:
            if self.total(mode) <= budget:
                return mode
        return None


def composite_norms(hw: Hardware) -> bool:
    """Whether torch's RMSNorm runs as composite operators on ``hw`` and keeps its normalised input
    (:func:`layer_activation_bytes`): on a CPU, where ``aten._fused_rms_norm`` has no kernel."""
    return hw.device.name.startswith("cpu")


def _parameter_server_memory(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision,
                             framework: Framework) -> MemoryBreakdown:
    """The larger of a worker and a server of an async run (:mod:`meshtrain.parallel.async_ps`).

    A worker: weights, gradients and activations as one process, no optimizer states, plus the fp32
    parameters it receives and the flat fp32 gradient it sends. A server: the whole model's weights (it
    evaluates and checkpoints it), the gradient and optimizer states of its 1/S shard, the received gradient
    shard and one parameter reply in flight per worker."""
    single = replace(layout, dp=1, ps_servers=0)
    one = memory_breakdown(model, single, hw, precision, framework)
    p, S = stage_params(model, single), layout.ps_servers
    worker = replace(one, optimizer=0.0, buffers=one.buffers + 2 * 4 * p)
    taken = muon_params(model, single, framework)[0]
    server = MemoryBreakdown(weights=one.weights, gradients=p * precision.grad_bytes / S,
                             optimizer=framework.optimizer.state_bytes(p / S, taken / S, precision.optimizer_bytes),
                             activations=0.0,
                             buffers=(1 + layout.dp) * 4 * p / S, overhead=one.overhead)
    return max(worker, server, key=lambda m: m.total)


@lru_cache(maxsize=1)
def memory_error_range() -> tuple[float, float]:
    """The lowest and highest signed error ``(predicted - measured) / measured`` of the predicted peak memory on the
    published runs that report one: the ``[memory]`` table of ``planner/data/stacks.toml``, which
    ``python -m meshtrain.planner.refit`` writes from them (:func:`meshtrain.planner.validate.fit_stacks`; a test
    checks the shipped table is that fit; docs/planner.md "Memory", the memory table). Nothing in the memory model is
    fitted to them, so it is the model's spread as it stands, not a fit's residual. (0, 0) without the table."""
    m = load_stacks().get("memory", {})
    return float(m.get("low", 0.0)), float(m.get("high", 0.0))


VERDICTS = ("fits", "tight", "does not fit")
"""The fit verdicts of a predicted peak against a device's memory (:func:`memory_verdict`)."""


def memory_range(total: float, device: Device) -> tuple[float, float]:
    """(low, high) bytes the measured peak of a layout predicted at ``total`` bytes should lie in on ``device`` (a
    :class:`~meshtrain.planner.hardware.Device`): a measured peak ``M`` with a predicted ``P`` has
    ``P / M - 1`` in :func:`memory_error_range` = ``[lo, hi]`` on the published runs, so ``M`` in
    ``[P / (1 + hi), P / (1 + lo)]``. A device never validated on a published run (``device.validated`` False:
    B200, MI300X, ...) widens it by its ``framework_overhead_bytes`` on each side: that runtime term (context,
    communication buffers, allocator) is the device's own, assumed there and never measured, so it may be anywhere
    from none to twice the catalog's."""
    lo, hi = memory_error_range()
    low, high = total / (1 + hi), total / (1 + lo)
    if not device.validated:
        low, high = max(0.0, low - device.framework_overhead_bytes), high + device.framework_overhead_bytes
    return low, high


def memory_verdict(total: float, device: Device) -> str:
    """"fits" (the whole :func:`memory_range` is within ``device.memory_bytes``), "does not fit" (all of it above) or
    "tight" (the capacity inside the range: it may train or run out of memory; the range says by how much).
    Takeaway: on an 80 GiB device a predicted peak above ~68 GiB may not fit, and one above ~88 GiB will not."""
    low, high = memory_range(total, device)
    if high <= device.memory_bytes:
        return "fits"
    return "does not fit" if low > device.memory_bytes else "tight"


def fits_budget(device: Device) -> float:
    """The largest predicted peak whose :func:`memory_verdict` is "fits" on ``device`` (bytes): the inverse of
    :func:`memory_range`'s high end, ``(capacity - widening) * (1 + lo)``."""
    widen = 0.0 if device.validated else device.framework_overhead_bytes
    return max(0.0, device.memory_bytes - widen) * (1 + memory_error_range()[0])


def tight_budget(device: Device) -> float:
    """The largest predicted peak whose :func:`memory_verdict` is not "does not fit" on ``device`` (bytes): the
    inverse of :func:`memory_range`'s low end, ``(capacity + widening) * (1 + hi)``."""
    widen = 0.0 if device.validated else device.framework_overhead_bytes
    return (device.memory_bytes + widen) * (1 + memory_error_range()[1])
