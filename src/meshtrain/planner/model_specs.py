"""Model shapes the planner understands: presets, a TOML ``[model]`` table, or a training config.

A :class:`ModelSpec` describes a decoder-only transformer by the numbers the cost model needs:
``layers`` (L), ``hidden`` (h), ``heads`` (a), ``kv_heads`` (grouped-query attention), ``ffn_hidden``
(f), ``vocab`` (V), ``seq_len`` (s) and the MLP ``activation`` ("gelu": two matrices, "swiglu": three).

Parameter count (weights only, biases and norms included)::

    per layer = h*(q + 2*kv) + q*h              attention (q = a*d, kv = kv_heads*d, d = h/a)
              + m*h*f                           MLP, m = 2 (GELU) or 3 (SwiGLU)
              + norms (2h, or 4h with biases) + biases (q + 2kv + h + f + h)
    total     = L*per layer + V*h (+ V*h if the head is untied) + s*h (learned positions) + final norm

A mixture of experts (``experts`` = E, ``experts_per_token`` = k) has E MLPs of width f and a router (E*h) per
layer; a token runs k of them, so FLOPs and activations follow the active width k*f (:attr:`ModelSpec.active_ffn`).

For the GPT configs of Narayanan et al. 2021 (biases, tied head, learned positions, no final norm)
this is their Eq. 2 exactly: ``12*L*h**2 * (1 + 13/(12h) + (V+s)/(12*L*h))``.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from meshtrain.config.load import read_toml
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.models.registry import families_with

ACTIVATIONS = ("gelu", "swiglu")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Sizes are counts (not bytes).

    Raises (in ``__post_init__``):
        ConfigError: a size < 1, heads not dividing hidden, kv_heads not dividing heads, or an
            unknown activation.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int = 0
    """MLP width f; 0 means 4*hidden."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``heads`` (multi-head attention)."""
    activation: str = "gelu"
    tied_embeddings: bool = True
    learned_positions: bool = True
    biases: bool = False
    dropout: bool = False
    """Whether dropout layers run (their masks cost activation memory: Korthikanti et al. 2022, Sec. 4.1)."""
    final_norm: bool = True
    head_dim: int = 0
    """Features per attention head; 0 means ``hidden / heads`` (Qwen3 decouples it: q is ``heads * head_dim`` wide)."""
    qkv_bias: bool = False
    """Biases on q, k and v only (Qwen2), without ``biases`` elsewhere."""
    qk_norm: bool = False
    """An RMSNorm of ``head_dim`` scales on each of q and k (Qwen3)."""
    experts: int = 0
    """Routed experts per MLP, each an MLP of width ``ffn_hidden`` (a mixture of experts: Mixtral, Qwen3-MoE); 0 =
    one dense MLP. Parameters count every expert and the router (E*h); a token runs ``experts_per_token`` of them,
    so its FLOPs, GEMM widths and activations are a dense MLP's of width :attr:`active_ffn`."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k); with ``experts``."""
    shared_ffn: int = 0
    """Width of a shared expert every token runs besides its routed ones, with a (1, h) sigmoid gate (Qwen2-MoE);
    0 = none. Replicated over ep like the router; over tp too with its gate, split by tp without one (DeepSeek:
    :attr:`shared_tp_split`)."""
    adapter_layer_params: int = 0
    """LoRA (:mod:`meshtrain.adapters`): one block's adapter parameters, ``r * (in + out)`` per adapted linear map
    (:func:`meshtrain.adapters.spec.adapter_parameters` over the layers); 0 = full training. With adapters they
    alone have gradients, optimizer states and gradient traffic; every other parameter is frozen, and a frozen
    GEMM's backward computes its input's gradient only."""
    saved_params: int = 0
    """LoRA with ``adapter.modules_to_save`` (:mod:`meshtrain.adapters.saved`): the embedding and/or head parameters
    trained in full beside the adapters (V*h each, a tied pair once), with gradients and optimizer states; part of the
    base's weights, so not counted twice."""
    nf4_layer_params: int = 0
    """QLoRA: one block's base weights stored as NF4 (:data:`NF4_BYTES` each instead of the weight dtype's bytes),
    dequantized once per forward and once per backward (and per recomputation)."""
    sequences_per_sample: int = 1
    """Sequences of one sample of the batch: 2 for DPO (``train.objective = "dpo"``: a preference pair, chosen and
    rejected), else 1. Layouts count sequences (``micro_batch_size``, the global batch); a search takes micro-batches
    of whole samples only, since a pair never splits across micro-batches or ranks."""
    reference_copy: bool = False
    """DPO with a frozen reference copy (``train.dpo_reference = "copy"``, :mod:`meshtrain.train.reference`): a second
    set of the weights, sharded as the policy's (ZeRO 2 and 3: 1/(dp*sp); no gradients, no optimizer states), held
    through the step, and one more forward per micro-batch (no backward) before the policy's."""
    expert_imbalance: float = 0.0
    """The busiest expert rank's routed rows over the mean (>= 1; 1 = every expert rank gets ``tokens*k/ep``), as a
    run states it (a published or measured imbalance); 0 (the default) = predicted: the expected maximum of the
    ranks' loads under balanced routing (:func:`meshtrain.planner.cost.predicted_expert_imbalance`). Every rank waits
    for the busiest at each MoE layer's combine, so the routed experts' GEMM time and the dispatch all-to-alls are
    multiplied by it. A capacity factor c (GShard, Lepikhin et al. 2020, Sec. 2.2) bounds it at c by dropping; for a
    dropless router it is whatever the routing does, which no published run below states (docs/planner.md,
    "Mixtures of experts as the frameworks dispatch them")."""

    shared_gate: bool = True
    """Whether the shared expert has Qwen2-MoE's (1, h) sigmoid gate (h weights); DeepSeek's shared experts have none."""
    expert_groups: int = 0
    """Groups the routed experts are split into for group-limited routing (DeepSeek-V3's ``n_group``: 8, one per node
    of its ep 64); 0 or 1 = no limit. A token's experts come from its ``expert_topk_groups`` best groups (V3 report,
    arXiv:2412.19437, Sec. 2.1.2, "node-limited routing"), which caps the nodes a node-limited dispatch sends it to
    (:func:`meshtrain.planner.cost.dispatch_nodes`)."""
    expert_topk_groups: int = 0
    """Groups a token's experts may come from (V3's ``topk_group``: 4); with ``expert_groups``."""
    q_lora_rank: int = 0
    """Multi-head latent attention (MLA, DeepSeek-V2 report, arXiv:2405.04434, Sec. 2.1): rank of q's low-rank path
    ``W_UQ(RMSNorm(W_DQ x))`` (V3: 1,536); 0 = q projected from h directly. Only with ``kv_lora_rank``."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent c_KV (V2 report, Eq. 9; V3: 512); 0 = not MLA. With it
    ``head_dim`` is q's and k's width per head, ``qk_nope + qk_rope_head_dim`` (V3: 128 + 64)."""
    qk_rope_head_dim: int = 0
    """MLA: the decoupled RoPE part of ``head_dim`` (V3: 64), its key ``W_KR x`` shared by all heads (V2 report,
    Eq. 14-19)."""
    v_head_dim: int = 0
    """MLA: v's width per head (V3: 128); 0 = ``head_dim``."""
    dense_layers: int = 0
    """The first layers whose MLP is one dense SwiGLU of width ``dense_ffn`` instead of experts (DeepSeek-V3's
    ``first_k_dense_replace``: 3). Per-layer sizes (:meth:`layer_params`, FLOPs) are then the mean over ``layers``
    (the pipeline split sees every block alike)."""
    dense_ffn: int = 0
    """Width of the ``dense_layers``' SwiGLU (V3: 18,432)."""
    mtp_layers: int = 0
    """Multi-token prediction depths D (V3 report, Sec. 2.2): each a projection ``M_k`` of ``2h -> h``, norms and one
    block, counted among ``layers`` (so ``layers`` = the main blocks + D), and one more pass through the shared head
    per token (:func:`head_flops_per_token`)."""

    @property
    def norm(self) -> str:
        """"rmsnorm" for the Llama family (the SwiGLU models: RMSNorm and SwiGLU come together, Touvron et al.
        2023, Sec. 2.2), "layernorm" otherwise (GPT)."""
        return "rmsnorm" if self.activation == "swiglu" else "layernorm"

    def __post_init__(self) -> None:
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_lora_rank and not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.head_dim == 0 and self.heads >= 1:
            if self.hidden % self.heads:
                raise ConfigError(f"model hidden = {self.hidden} must be divisible by heads = {self.heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        for key in ("layers", "hidden", "heads", "vocab", "seq_len", "ffn_hidden", "kv_heads", "head_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model {key} = {getattr(self, key)} must be >= 1")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model heads = {self.heads} must be divisible by kv_heads = {self.kv_heads}")
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ConfigError(f"model experts_per_token = {self.experts_per_token} must be in [1, experts = "
                              f"{self.experts}]")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"model activation = {self.activation!r} is not valid: use one of {', '.join(ACTIVATIONS)}")
        if self.kv_lora_rank and (not self.head_dim or self.kv_heads != self.heads
                                  or not 0 <= self.qk_rope_head_dim < self.head_dim):
            raise ConfigError(f"model kv_lora_rank = {self.kv_lora_rank} (MLA) needs head_dim > qk_rope_head_dim = "
                              f"{self.qk_rope_head_dim} >= 0 and kv_heads = heads")
        if not 0 <= self.dense_layers < self.layers - self.mtp_layers or (self.dense_layers and self.dense_ffn < 1):
            raise ConfigError(f"model dense_layers = {self.dense_layers} must be in [0, layers - mtp_layers) and come "
                              f"with dense_ffn >= 1")
        if self.expert_groups > 1 and not (self.experts % self.expert_groups == 0
                                           and 1 <= self.expert_topk_groups <= self.expert_groups):
            raise ConfigError(f"model expert_groups = {self.expert_groups} must divide experts = {self.experts}, with "
                              f"expert_topk_groups in [1, expert_groups]")
        if isinstance(self.expert_imbalance, bool) or not isinstance(self.expert_imbalance, int | float) or not (
                1.0 <= self.expert_imbalance < float("inf") or self.expert_imbalance == 0):
            raise ConfigError(f"model expert_imbalance = {self.expert_imbalance!r} must be a number >= 1 (the busiest "
                              f"expert rank's rows over the mean; 1 = balanced), or 0 to predict it")

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """The sizes' hash (equal specs have equal sizes; ints hash alike in every process, so a pickled copy keeps a
        true one), computed once: the planner's caches hash a spec ~10^5 times per search."""
        return hash((self.layers, self.hidden, self.heads, self.vocab, self.seq_len, self.ffn_hidden, self.kv_heads,
                     self.head_dim, self.experts, self.experts_per_token, self.expert_imbalance, self.kv_lora_rank,
                     self.dense_layers, self.mtp_layers))

    # Derived sizes are cached_property (kept in the instance's __dict__, beside the fields; a frozen spec never
    # changes them): the planner's search asks each ~10^5 times.
    @cached_property
    def q_dim(self) -> int:
        """Width of Q (and of the attention's output): heads * head_dim (= hidden unless head_dim is decoupled)."""
        return self.heads * self.head_dim

    @cached_property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads * head_dim; with MLA the mean of K's ``heads*head_dim`` and V's
        ``heads*v_head_dim`` (the full K and V the attention kernel takes, up-projected from the latent)."""
        if self.kv_lora_rank:
            return self.heads * (self.head_dim + self.v_head_dim) // 2
        return self.kv_heads * self.head_dim

    @cached_property
    def v_dim(self) -> int:
        """Width of the attention's output (A V): heads * v_head_dim with MLA, else :attr:`q_dim`."""
        return self.heads * self.v_head_dim if self.kv_lora_rank else self.q_dim

    @cached_property
    def moe_fraction(self) -> float:
        """Share of the layers whose MLP has experts: ``(layers - dense_layers) / layers`` (1 without dense layers;
        0 without experts)."""
        return (self.layers - self.dense_layers) / self.layers if self.experts else 0.0

    @cached_property
    def attention_params(self) -> int:
        """One layer's attention weights (no norms): ``h*(q + 2kv) + q*h``; with MLA (V2 report, Sec. 2.1, Eq. 9-18)
        ``rq*(h + a*dqk)`` (or ``h*a*dqk`` without rq) ``+ h*(rkv + dr) + rkv*a*(dn + dv) + a*dv*h`` plus the two
        latent norms' ``rq + rkv`` scales (dqk = ``head_dim`` = dn + dr)."""
        h, q = self.hidden, self.q_dim
        if not self.kv_lora_rank:
            return h * (q + 2 * self.kv_dim) + q * h
        rq, rkv, dr, a = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim, self.heads
        dn = self.head_dim - dr
        qp = rq * (h + 1 + q) if rq else h * q
        return qp + h * (rkv + dr) + rkv + rkv * a * (dn + self.v_head_dim) + self.v_dim * h

    @cached_property
    def attention_gemm_params(self) -> int:
        """:attr:`attention_params` less the latent norms' scales: the weights the GEMMs multiply."""
        return self.attention_params - (self.q_lora_rank + self.kv_lora_rank if self.kv_lora_rank else 0)

    @cached_property
    def dense_mlp_params(self) -> float:
        """The dense layers' SwiGLU weights ``m*h*dense_ffn``, as a mean over the layers (0 without dense layers)."""
        return self.dense_layers * self.mlp_matrices * self.hidden * self.dense_ffn / self.layers

    @cached_property
    def active_ffn(self) -> int:
        """The MLP width one token runs through: ``ffn_hidden``, or with experts ``experts_per_token * ffn_hidden``
        (k experts of width f cost a token what one MLP of width k*f does: the same GEMM FLOPs and activations; the
        expert GEMMs' smaller row counts and the imbalance between experts are not modelled)."""
        return self.ffn_hidden * (self.experts_per_token if self.experts else 1)

    @cached_property
    def router_params(self) -> float:
        """The router's E*h weights per layer (0 without experts; a mean over the layers with ``dense_layers``)."""
        return self.experts * self.hidden * (self.moe_fraction if self.dense_layers else 1)

    @cached_property
    def shared_params(self) -> float:
        """The shared expert's ``mlp_matrices*h*S`` weights and its gate's h per layer (0 without one; no gate without
        ``shared_gate``; a mean over the layers with ``dense_layers``)."""
        if not self.shared_ffn:
            return 0
        n = self.mlp_matrices * self.hidden * self.shared_ffn + (self.hidden if self.shared_gate else 0)
        return n * (self.moe_fraction if self.dense_layers else 1)

    @cached_property
    def shared_tp_split(self) -> bool:
        """Whether tp splits the shared experts as a dense MLP (gate and up column-, down row-parallel): DeepSeek's and
        GLM-4.5's ungated ones (``shared_gate`` False: the trainer's plan, :data:`meshtrain.models.deepseek_v3.spec.TP`,
        and Megatron-Core's ``SharedExpertMLP``); a gated one (Qwen2-MoE) is replicated like the router (meshtrain's
        plan, :func:`meshtrain.models.moe.spec.tp_names`)."""
        return bool(self.shared_ffn) and not self.shared_gate

    @cached_property
    def mla_down_params(self) -> int:
        """MLA's down-projection weights per layer, ``rq*h + h*(rkv + dr)`` (q's, kv's and the shared RoPE key's): every
        tp rank computes the latents whole (0 without MLA)."""
        if not self.kv_lora_rank:
            return 0
        return self.q_lora_rank * self.hidden + self.hidden * (self.kv_lora_rank + self.qk_rope_head_dim)

    @cached_property
    def tp_replicated_params(self) -> float:
        """One layer's parameters that tp leaves whole on every rank (a mean over the layers with ``dense_layers``):
        the router, a replicated shared expert (:attr:`shared_tp_split`), the norms' scales (and shifts with
        ``biases``), the q/k norms, MLA's down-projections and latent norms (:attr:`mla_down_params`; Megatron's layout
        and the trainer's, Shoeybi et al. 2019, Sec. 3: only the column- and row-parallel matrices are split). The
        row-parallel biases (GPT) are left split, a few h per layer."""
        norms = (4 if self.biases else 2) * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        latents = self.mla_down_params + (self.q_lora_rank + self.kv_lora_rank if self.kv_lora_rank else 0)
        shared = 0 if self.shared_tp_split else self.shared_params
        return self.router_params + shared + norms + latents

    @cached_property
    def mlp_matrices(self) -> int:
        """2 for GELU (up, down), 3 for SwiGLU (gate, up, down; Shazeer 2020)."""
        return 3 if self.activation == "swiglu" else 2

    def layer_params(self) -> int:
        """Parameters of one transformer block (weights, biases, norm scales)."""
        return self._layer_params

    @cached_property
    def _layer_params(self) -> int:
        h, f, kv, q = self.hidden, self.ffn_hidden, self.kv_dim, self.q_dim
        routed = max(self.experts, 1) * self.mlp_matrices * h * f * (self.moe_fraction if self.dense_layers else 1)
        n = self.attention_params + routed + self.router_params + self.shared_params + self.dense_mlp_params
        n += 4 * h if self.biases else 2 * h  # two norms: scale (+ shift)
        if self.biases:
            n += (q + 2 * kv) + h + (f * (self.mlp_matrices - 1)) + h
        elif self.qkv_bias:
            n += q + 2 * kv
        return n + (2 * self.head_dim if self.qk_norm else 0)

    def expert_params(self) -> int:
        """Parameters of one block's routed experts, ``E * mlp_matrices * h * f`` (0 without experts): what expert
        parallelism splits over ``ep``."""
        n = self.experts * self.mlp_matrices * self.hidden * self.ffn_hidden
        return n * self.moe_fraction if self.dense_layers else n

    def param_tensors(self) -> int:
        """Number of parameter tensors (fused qkv counted as one), which sets per-tensor optimizer work."""
        return self._param_tensors

    @cached_property
    def _param_tensors(self) -> int:
        mla = (3 + 2 * bool(self.q_lora_rank)) if self.kv_lora_rank else 0  # q_a, q_a_norm, kv_a, kv_a_norm, kv_b
        per_layer = (2 + mla + self.mlp_matrices + 2 + 2 * self.qk_norm + bool(self.experts)  # + the router
                     + (self.mlp_matrices + 1 if self.shared_ffn else 0))  # + the shared expert and its gate
        if self.biases:
            per_layer += 2 + self.mlp_matrices + 2
        elif self.qkv_bias:
            per_layer += 1
        ends = 1 + int(self.learned_positions) + int(not self.tied_embeddings)
        ends += (2 if self.biases else 1) if self.final_norm else 0
        return self.layers * per_layer + ends

    def embedding_params(self) -> int:
        """Token embedding (+ learned position embedding) parameters: V*h (+ s*h)."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)

    def head_params(self) -> int:
        """Output layer: final norm plus the V*h head if it is not tied to the embedding."""
        norm = (2 if self.biases else 1) * self.hidden if self.final_norm else 0
        mtp = self.mtp_layers * (2 * self.hidden * self.hidden + 3 * self.hidden)  # M_k, enorm, hnorm, head norm
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden) + mtp

    def num_params(self) -> int:
        """Total parameters N (the tied head counted once)."""
        return round(self.layers * self.layer_params() + self.embedding_params() + self.head_params())

    def active_params(self) -> int:
        """Parameters one token runs through: :meth:`num_params` less each block's ``E - k`` unchosen routed experts
        (= ``num_params`` for a dense model). Mixtral 8x7B: 46.7 B in all, 12.9 B active (Jiang et al. 2024, Sec. 2)."""
        idle = max(self.experts - self.experts_per_token, 0) * self.mlp_matrices * self.hidden * self.ffn_hidden
        moe_layers = self.layers - self.dense_layers
        return self.num_params() - moe_layers * idle if self.experts else self.num_params()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT-2 (Radford et al. 2019, Table 2): biases, tied head, learned positions, V=50257, s=1024."""
    return ModelSpec(name, layers, hidden, heads, vocab=50257, seq_len=1024, biases=True, dropout=True)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    """Llama 3 (Dubey et al. 2024, Table 3): GQA with 8 kv heads, SwiGLU, RoPE, V=128256, s=8192."""
    return ModelSpec(name, layers, hidden, heads, vocab=128256, seq_len=8192, ffn_hidden=ffn, kv_heads=8,
                     activation="swiglu", tied_embeddings=False, learned_positions=False)


def _megatron(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """GPT configs of Narayanan et al. 2021, Table 1: V=51200, s=2048, f=4h, biases, dropout, tied head."""
    return ModelSpec(name, layers, hidden, heads, vocab=51200, seq_len=2048, biases=True, dropout=True,
                     final_norm=False)


def _moe(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, experts: int, k: int,
         head_dim: int = 0, qk_norm: bool = False) -> ModelSpec:
    """A Llama-style mixture of experts at 4,096 tokens: Mixtral 8x7B and 8x22B (Jiang et al. 2024, arXiv:2401.04088,
    Table 1; 8x22B's ``config.json`` on the Hugging Face hub), Qwen3-30B-A3B (Qwen Team 2025, arXiv:2505.09388,
    Table 2: 128 experts, 8 per token, expert width 768, head_dim 128)."""
    return ModelSpec(name, layers, hidden, heads, vocab=vocab, seq_len=4096, ffn_hidden=ffn, kv_heads=kv_heads,
                     activation="swiglu", tied_embeddings=False, learned_positions=False, head_dim=head_dim,
                     qk_norm=qk_norm, experts=experts, experts_per_token=k)


def _deepseek_v3(name: str, experts: int, vocab: int, dense_layers: int, mtp: int, groups: int, topk_groups: int,
                 heads: int) -> ModelSpec:
    """The DeepSeek-V3 architecture (``DeepseekV3ForCausalLM``) at 4,096 tokens: 61 main layers of h = 7,168, MLA with
    q_lora_rank 1,536, kv_lora_rank 512, 128 + 64 q/k features per head (decoupled RoPE part 64) and 128 v features,
    experts of width 2,048 (8 per token) beside one shared expert of 2,048, dense first layers of width 18,432.
    DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 4.2 and its ``config.json``): 256 experts, 8 groups of which
    4 per token, 3 dense layers, one MTP depth, V = 129,280, 128 heads; 671B parameters without the MTP module's 14B
    (Sec. 4.2; 685B on the hub). Kimi K2 (Moonshot AI 2025, arXiv:2507.20534, Table 2, and its ``config.json``):
    384 experts, no group limit, 1 dense layer, no MTP, V = 163,840, 64 heads; 1.04T parameters."""
    return ModelSpec(name, 61 + mtp, 7168, heads, vocab=vocab, seq_len=4096, ffn_hidden=2048, kv_heads=heads,
                     activation="swiglu", tied_embeddings=False, learned_positions=False, head_dim=192,
                     experts=experts, experts_per_token=8, shared_ffn=2048, shared_gate=False, expert_groups=groups,
                     expert_topk_groups=topk_groups, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                     v_head_dim=128, dense_layers=dense_layers, dense_ffn=18432, mtp_layers=mtp)


def _glm45(name: str, layers: int, hidden: int, ffn: int, dense_ffn: int, experts: int, dense_layers: int,
           qk_norm: bool) -> ModelSpec:
    """GLM-4.5 (``Glm4MoeForCausalLM``) at 4,096 tokens, as meshtrain builds it with ``num_nextn_predict_layers = 0``
    (without the released checkpoints' MTP block, which 1 trains; ``from_config`` counts it then): 96 heads of 128 features (q 12,288 wide against h), 8 kv heads, q/k/v biases, 8 routed
    experts per token beside one shared expert, V = 151,552, untied head. GLM-4.5 Team 2025 (arXiv:2508.06471, Table 1)
    and the released ``config.json`` of zai-org/GLM-4.5 (92 layers, h = 5,120, 160 experts of width 1,536, 3 dense
    layers of 12,288, q/k norms; 355B parameters, 32B active) and zai-org/GLM-4.5-Air (46 layers, h = 4,096, 128
    experts of width 1,408, 1 dense layer of 10,944, no q/k norms; 106B, 12B active)."""
    return ModelSpec(name, layers, hidden, 96, vocab=151552, seq_len=4096, ffn_hidden=ffn, kv_heads=8,
                     activation="swiglu", tied_embeddings=False, learned_positions=False, head_dim=128, qkv_bias=True,
                     qk_norm=qk_norm, experts=experts, experts_per_token=8, shared_ffn=ffn, shared_gate=False,
                     dense_layers=dense_layers, dense_ffn=dense_ffn)


def _deepseek_v2(name: str, layers: int, hidden: int, heads: int, q_lora_rank: int, ffn: int, dense_ffn: int,
                 experts: int, groups: int, topk_groups: int) -> ModelSpec:
    """DeepSeek-V2 (``DeepseekV2ForCausalLM``) at 4,096 tokens: MLA with kv_lora_rank 512, 128 + 64 q/k features per
    head and 128 v features, 6 routed experts per token beside 2 shared ones, one dense first layer, V = 102,400,
    untied head. DeepSeek-AI 2024 (arXiv:2405.04434, Sec. 3.1.2 and Appendix B.1) and the released ``config.json`` of
    deepseek-ai/DeepSeek-V2 (60 layers, h = 5,120, 128 heads, q_lora_rank 1,536, 160 experts of width 1,536, 8 groups
    of which 3 per token, dense width 12,288; 236B parameters, 21B active) and DeepSeek-V2-Lite (27 layers, h = 2,048,
    16 heads, q projected directly, 64 experts of width 1,408, greedy routing, dense width 10,944; 15.7B, 2.4B)."""
    return ModelSpec(name, layers, hidden, heads, vocab=102400, seq_len=4096, ffn_hidden=ffn, kv_heads=heads,
                     activation="swiglu", tied_embeddings=False, learned_positions=False, head_dim=192,
                     experts=experts, experts_per_token=6, shared_ffn=2 * ffn, shared_gate=False, expert_groups=groups,
                     expert_topk_groups=topk_groups, q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_rope_head_dim=64,
                     v_head_dim=128, dense_layers=1, dense_ffn=dense_ffn)


PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt2("gpt2-small", 12, 768, 12), _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20), _gpt2("gpt2-xl", 48, 1600, 25),
    _llama3("llama3-8b", 32, 4096, 32, 14336), _llama3("llama3-70b", 80, 8192, 64, 28672),
    _llama3("llama3-405b", 126, 16384, 128, 53248),
    _megatron("megatron-1.7b", 24, 2304, 24), _megatron("megatron-3.6b", 30, 3072, 32),
    _megatron("megatron-7.5b", 36, 4096, 32), _megatron("megatron-18.4b", 40, 6144, 48),
    _megatron("megatron-39.1b", 48, 8192, 64), _megatron("megatron-76.1b", 60, 10240, 80),
    _megatron("megatron-145.6b", 80, 12288, 96), _megatron("megatron-310.1b", 96, 16384, 128),
    _megatron("megatron-529.6b", 105, 20480, 128), _megatron("megatron-1t", 128, 25600, 160),
    _moe("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 8, 2), _moe("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 8, 2),
    _moe("qwen3-30b-a3b", 48, 2048, 32, 4, 768, 151936, 128, 8, head_dim=128, qk_norm=True),
    _deepseek_v3("deepseek-v3", 256, 129280, 3, 1, 8, 4, 128), _deepseek_v3("kimi-k2", 384, 163840, 1, 0, 0, 0, 64),
    _glm45("glm-4.5", 92, 5120, 1536, 12288, 160, 3, True), _glm45("glm-4.5-air", 46, 4096, 1408, 10944, 128, 1, False),
    _deepseek_v2("deepseek-v2", 60, 5120, 128, 1536, 1536, 12288, 160, 8, 3),
    _deepseek_v2("deepseek-v2-lite", 27, 2048, 16, 0, 1408, 10944, 64, 0, 0),
)}


def preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ConfigError: unknown name, with the closest preset and the full list.
    """
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.4)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(f"unknown model preset '{name}': {hint}valid presets are {', '.join(PRESETS)}")


PLANNER_KEYS = {"name", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "activation",
                "tied_embeddings", "learned_positions", "biases", "dropout", "final_norm", "experts",
                "experts_per_token", "shared_ffn", "expert_imbalance", "head_dim", "qk_norm", "qkv_bias",
                "shared_gate", "expert_groups", "expert_topk_groups", "q_lora_rank", "kv_lora_rank",
                "qk_rope_head_dim", "v_head_dim", "dense_layers", "dense_ffn", "mtp_layers"}


def from_table(table: dict[str, Any], name: str = "custom") -> ModelSpec:
    """A spec from a planner-style table (``layers, hidden, heads, vocab, seq_len`` [+ optional keys]).

    Raises:
        ConfigError: a missing or unknown key, or an invalid value.
    """
    unknown = set(table) - PLANNER_KEYS
    if unknown:
        key = sorted(unknown)[0]
        close = difflib.get_close_matches(key, sorted(PLANNER_KEYS), n=1, cutoff=0.5)
        raise ConfigError(f"unknown model key '{key}': {'did you mean ' + repr(close[0]) + '? ' if close else ''}"
                          f"valid keys are {', '.join(sorted(PLANNER_KEYS))}")
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq_len") if k not in table]
    if missing:
        raise ConfigError(f"model table lacks {', '.join(missing)}: give layers, hidden, heads, vocab and seq_len")
    fields = {"name": name, **table}
    if isinstance(fields.get("activation"), str):
        fields["activation"] = fields["activation"].lower()
    return ModelSpec(**fields)


def corpus_vocab_size(cfg: Config) -> int:
    """The V the trainer builds with ``model.vocab_size = 0`` (:func:`meshtrain.data.tokenizers.model_vocab_size`):
    with ``data.tokenizer = "char"`` the distinct characters of the corpus at ``cfg.data.resolved_path()``, else
    (a tokenizer file, or a prepared folder naming its own) the tokenizer's size padded up to a multiple of 128 * ``parallel.tp`` (the config's tp, also for layouts the
    planner tries with another tp: at most 128 * tp rows apart)."""
    from meshtrain.data.tokenizers import load_tokenizer, model_vocab_size

    path = cfg.data.resolved_path()
    if path.is_dir():  # a prepared dataset: its meta.json names the tokenizer
        from meshtrain.data.shards import read_prepared_meta

        meta = read_prepared_meta(path)
        return model_vocab_size(meta["tokenizer"]["kind"], int(meta["vocab_size"]), 0, cfg.parallel.tp)
    if cfg.data.tokenizer != "char":
        tok = load_tokenizer(cfg.data.tokenizer)
        return model_vocab_size(tok.kind, tok.vocab_size, 0, cfg.parallel.tp)
    from meshtrain.data.corpus import read_text_corpus

    return len(set(read_text_corpus(path)))


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per NF4 weight: 4 bits, an 8-bit scale per 64 weights, a fp32 scale per 256 scales (QLoRA, Dettmers et al.
2023, Sec. 3; :data:`meshtrain.adapters.nf4.BYTES_PER_WEIGHT`)."""


def adapter_numbers(cfg: Config, vocab: int) -> dict[str, int]:
    """:class:`ModelSpec`'s ``adapter_layer_params`` (DoRA's magnitudes included), ``saved_params`` (of a ``vocab``-row
    embedding and head) and ``nf4_layer_params`` of a config's ``[adapter]`` (none without adapters): per block, from
    the family's Hugging Face shapes (:mod:`meshtrain.adapters.spec`)."""
    a, m = cfg.adapter, cfg.model
    if not a.lora_rank:
        return {}
    from meshtrain.adapters.saved import saved_modules, tied_embeddings
    from meshtrain.adapters.spec import ALL_LINEAR, adapter_parameters

    saved = saved_modules(m, list(a.modules_to_save))
    numbers = {"adapter_layer_params": adapter_parameters(m, list(a.lora_targets), a.lora_rank, a.use_dora) // m.n_layer,
               "saved_params": vocab * m.n_embd * (1 if saved and tied_embeddings(m) else len(saved))}
    if a.quantize_base == "nf4":  # every linear map of a block, A and B of rank 1 being in + out of each
        numbers["nf4_layer_params"] = _linear_weights_per_block(m, [ALL_LINEAR])
    return numbers


def _linear_weights_per_block(m: Any, targets: list[str]) -> int:
    """The weights of one block's linear maps that ``targets`` name (in x out each)."""
    from meshtrain.adapters.spec import targeted_paths
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    sources, shapes = fmt.sources(m, ()), fmt.shapes(m, 1, ())
    total = 0
    for path in targeted_paths(m, targets):
        out_features, in_features = shapes[sources[f"blocks.0.{path}.weight"].name]
        total += out_features * in_features
    return total


def from_config(cfg: Config, vocab_size: int | None = None) -> ModelSpec:
    """The spec of the trainer's model for a training config: its family's planner numbers
    (:attr:`meshtrain.models.family.Family.planner`, ``models/<family>/spec.py``) and its adapters'
    (:func:`adapter_numbers`), and DPO's pairs and frozen reference copy (:attr:`ModelSpec.sequences_per_sample`,
    :attr:`ModelSpec.reference_copy`). ``vocab_size`` overrides the
    config's; without it, the vocabulary is the trainer's (:func:`trained_vocab_size`: ``model.vocab_size``, the
    corpus's distinct characters or padded tokenizer size, or a checkpoint's grown for the tokens prepare added).

    Raises:
        ConfigError: a family the planner does not model (the recurrent ones).
    """
    m = cfg.model
    numbers = m.family().planner
    if numbers is None:
        modelled = ", ".join(repr(t) for t in families_with(lambda f: f.planner is not None))
        raise ConfigError(f"model.type = {m.type!r} is not modelled by the planner yet (it models transformers, "
                          f"model.type = {modelled}); train it without a plan")
    dpo = cfg.train.objective == "dpo"
    vocab = vocab_size or trained_vocab_size(cfg)
    return ModelSpec("config", **numbers(m, vocab), **adapter_numbers(cfg, vocab),
                     sequences_per_sample=2 if dpo else 1, reference_copy=dpo and cfg.train.dpo_reference == "copy")


def deepseek_v3_spec(m: Any, vocab: int, name: str = "config") -> ModelSpec:
    """The :class:`ModelSpec` of a ``[model]`` table of a family the planner models (``deepseek_v3``, ``deepseek_v2``,
    ``glm4_moe``, ...) with ``vocab`` rows: its family's planner numbers (e.g. :func:`meshtrain.models.deepseek_v3.spec.
    planner`), for the presets' tests.

    Raises:
        ConfigError: a family the planner does not model."""
    from meshtrain.models.registry import family

    numbers = family(m.type).planner
    if numbers is None:
        raise ConfigError(f"model.type = {m.type!r} is not modelled by the planner")
    return ModelSpec(name, **numbers(m, vocab))


def trained_vocab_size(cfg: Config) -> int:
    """The V the trainer builds (:func:`meshtrain.train.setup.set_up`): ``model.vocab_size``, the corpus's
    (:func:`corpus_vocab_size`) when it is 0, and with ``model.init_from`` a prepared folder's tokenizer padded for tp
    where it holds more ids than the checkpoint's rows (the tokens prepare added, ChatML's: the trainer grows the
    embedding and the head, :mod:`meshtrain.data.growth`)."""
    m = cfg.model
    if not m.vocab_size:
        return corpus_vocab_size(cfg)
    path = cfg.data.resolved_path()
    if m.init_from and path.is_dir():
        from meshtrain.data.shards import read_prepared_meta
        from meshtrain.data.tokenizers import padded_vocab_size

        tokens = int(read_prepared_meta(path)["vocab_size"])
        if tokens > m.vocab_size:
            return padded_vocab_size(tokens, cfg.parallel.tp)
    return m.vocab_size


def load_model(spec: str, seq_len: int | None = None) -> ModelSpec:
    """Resolve ``--model``: a preset name, or a TOML file with a ``[model]`` table.

    The table is either planner style (``layers, hidden, heads, ...``) or a training config's
    (``n_layer, n_head, n_embd, block_size``). ``seq_len`` overrides the model's sequence length.

    Raises:
        ConfigError: unknown preset, unreadable file, or a bad table.
    """
    path = Path(spec)
    if spec.endswith(".toml") or path.is_file():
        model = model_from_toml(path)
    else:
        model = preset(spec)
    return replace(model, seq_len=seq_len) if seq_len else model


def model_from_toml(path: Path) -> ModelSpec:
    """Read the ``[model]`` table of ``path`` (planner style or training-config style). Raises ConfigError."""
    from meshtrain.fileio import check_readable

    check_readable(path, "model file", "give a TOML file with a [model] table, or a preset name")
    table = read_toml(path, "model file").get("model")
    if not isinstance(table, dict):
        raise ConfigError(f"'{path}' has no [model] table")
    if "n_layer" in table or "n_embd" in table:
        from meshtrain.config.load import load_config
        return from_config(load_config(path))
    return from_table(table, name=path.stem)


def dense_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of one layer's weight GEMMs per token: ``2*(h*(q+2kv) + q*h + m*h*f)``, f the active MLP width
    (k experts of width f: k*f) plus a router's ``E*h`` and a shared expert's (Fedus et al. 2021, Sec. 2: FLOPs per
    token follow the experts a token runs, not their number). With MLA the attention term is twice its GEMM weights
    (:attr:`ModelSpec.attention_gemm_params`: the q and kv down- and up-projections, the shared RoPE key's ``h*dr``
    and the output); with ``dense_layers`` the MLP term is the mean over the layers of the dense SwiGLU's ``m*h*D``
    and the MoE layers' (DeepSeek-V3: ``2 * active matrix parameters`` per layer, V3 report Table 1's 37B active)."""
    h, f = model.hidden, model.active_ffn
    routed = model.mlp_matrices * h * f * (model.moe_fraction if model.dense_layers else 1)
    return 2.0 * (model.attention_gemm_params + routed + model.router_params + model.shared_params
                  + model.dense_mlp_params)


def attention_flops_per_token(model: ModelSpec, causal: bool = False) -> float:
    """Forward FLOPs of one layer's QK^T and AV per token: ``2*s*q + 2*s*v`` = ``4*s*q`` (non-causal), half if causal;
    with MLA q's and k's ``heads*head_dim`` (dn + dr) and v's ``heads*v_head_dim`` differ (V3: 192 and 128)."""
    return 2.0 * model.seq_len * (model.q_dim + model.v_dim) * (0.5 if causal else 1.0)


def mla_saved_widths(model: ModelSpec, up_projections_recomputed: bool) -> tuple[float, float]:
    """(tp-replicated, tp-sharded) elements per token that one MLA layer's attention keeps for backward, in place of
    the "Q, K, V and out-projection input" of a Llama's (Korthikanti et al. 2022, Sec. 4.1); with sequence parallelism
    the replicated part is still whole (the down-projections run on the all-gathered input).

    Replicated: the latents the up-projections read, ``c_Q`` (rq) and ``c_KV`` (rkv) after their norms and before
    (for the norms' backward), and the RoPE key ``k_R`` (dr): ``2*(rq + rkv) + dr``. Sharded by head: the attention
    kernel's q and k (``a*dqk`` each), v and the output (``a*dv`` each; the output is also the out-projection's
    input). ``up_projections_recomputed`` (DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.2.3, "Recomputation of RMSNorm
    and MLA Up-Projection"; Megatron-Core's ``--recompute-modules mla_up_proj``): q, k and v are recomputed from the
    latents in backward and the norms too, so only the pre-norm latents, ``k_R`` and the output are kept:
    ``(rq + rkv + dr, a*dv)``. DeepSeek-V3 (a = 128, dqk = 192, dv = 128): 65,536 + 16,384 per token at full width,
    against 2,112 + 16,384 with the up-projections recomputed."""
    rq, rkv, dr = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    if up_projections_recomputed:
        return float(rq + rkv + dr), float(model.v_dim)
    return float(2 * (rq + rkv) + dr), float(2 * model.q_dim + 2 * model.v_dim)


def head_flops_per_token(model: ModelSpec) -> float:
    """Forward FLOPs of the output head per token: the logits' ``2*h*V``, and per multi-token prediction depth
    (:attr:`ModelSpec.mtp_layers`; its block is one of ``layers``) the projection ``M_k`` of the concatenated
    ``2h -> h`` and the shared head again (V3 report, Sec. 2.2, Eq. 21-23): ``2*h*V*(1 + D) + D*4*h^2``."""
    h, d = model.hidden, model.mtp_layers
    return 2.0 * h * model.vocab * (1 + d) + d * 4.0 * h * h
