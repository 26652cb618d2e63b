"""DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437): multi-head latent attention and DeepSeekMoE in the Llama's
pre-norm decoder (:class:`meshtrain.models.llama.model.Llama`: its forward, RoPE tables, head and auxiliary loss).

Shape legend: B batch, T tokens (this rank's under sp), N = B*T, C = n_embd, nh = n_head, dn = qk_nope_head_dim,
dr = qk_rope_head_dim, dv = v_head_dim, rq = q_lora_rank, rkv = kv_lora_rank, E = num_experts, k = num_experts_per_tok,
G = n_group. Module names follow the Llama's (``blocks.3.attn.proj``, ``blocks.3.mlp.router``), so pipeline splits,
checkpoints and expert parallelism (``mlp.experts``) work the same way; the Hugging Face names are in ``hf_names.py``.
The multi-token prediction modules (V3 report, Sec. 2.2) are ``mtp.{k}`` (``mtp.0.eh_proj``, ``mtp.0.block.attn.proj``),
beside the blocks, not among them: a pipeline puts them on its last stage, with the head (``mtp.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, RowwiseParallel

from meshtrain.models.attention import SDPAttention, init_decoder_weights
from meshtrain.models.base import LayeredLM
from meshtrain.models.deepseek_v3 import keys
from meshtrain.models.deepseek_v3.mtp import MultiTokenPrediction
from meshtrain.models.llama.model import Llama, SwiGLU, rotate
from meshtrain.models.moe import layer as moe
from meshtrain.models.moe.layer import MoE, SharedExpert
from meshtrain.models.registry import ModelConfig

LATENT_NORM_EPS = 1e-6
"""Epsilon of the RMSNorms of the q and kv latents: DeepSeek's reference ``RMSNorm`` default and ``transformers``'
``DeepseekV3RMSNorm(q_lora_rank)`` (not ``rms_norm_eps``, which the block norms use)."""


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dr/2,) fp32 of the RoPE part, the factor on cos and sin).

    Without ``yarn_factor``: ``theta ** (-2i / dr)`` and 1 (Su et al. 2021, Eq. 15). With it, YaRN (Peng et al.
    2023, arXiv:2309.00071, Sec. 3.2, "NTK-by-parts", Eq. 17-20) as ``transformers``' ``_compute_yarn_parameters``
    computes it: frequencies that turn fewer than ``beta_slow`` times over the original context are divided by the
    factor, more than ``beta_fast`` times kept, linearly between (in whole dimensions); and the cos/sin factor
    ``yarn_mscale(f, mscale) / yarn_mscale(f, mscale_all_dim)`` with DeepSeek's two mscales, else ``yarn_mscale(f, 1)``
    (Eq. 22)."""
    dim, base, factor = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.yarn_factor
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # (dr/2,)
    if not factor:
        return 1.0 / pos_freqs, 1.0
    original = cfg.rope_original_max_positions

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
    keep = 1 - ramp  # (dr/2,) 1: extrapolate (the frequency kept), 0: interpolate (divided by the factor)
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        scale = keys.yarn_mscale(factor, cfg.yarn_mscale) / keys.yarn_mscale(factor, cfg.yarn_mscale_all_dim)
    else:
        scale = keys.yarn_mscale(factor, 1.0)
    return inv, float(scale)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` (B, h, T, dr) over adjacent pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout), returned with
    the rotated even features first and the odd ones after (``transformers``' ``apply_rotary_pos_emb_interleave``;
    the order is the same for q and k, so their products are those of the pairs); ``cos, sin`` (T, dr) or
    (B, 1, T, dr), each angle twice (``[a, a]``)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]  # (T, dr/2)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, h, T, dr/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def shared_by_heads(x: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape), a replicated input every head uses (MLA's shared RoPE key k_R), unchanged; under tensor
    parallelism (``head_weight``, a column-parallel weight split by head, is a ``DTensor``) its gradient, which this
    rank's heads only add to, is all-reduced over the tp ranks in backward: Megatron-LM's ``f`` operator (Shoeybi et
    al. 2019, arXiv:1909.08053, Sec. 3), here as a ``DTensor`` whose gradient is a partial sum."""
    if not isinstance(head_weight, DTensor):
        return x
    return DTensor.from_local(x, head_weight.device_mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 report, arXiv:2405.04434, Sec. 2.1, Eq. 9-19).

    q = ``q_b(RMSNorm(q_a(x)))`` with ``q_lora_rank`` (Eq. 12-13), else ``q(x)``: (B, T, nh*(dn+dr)), each head's
    non-rotated part then its RoPE part. ``kv_a(x)`` gives the latent ``c_KV`` (rkv; Eq. 9) and one RoPE key k_R (dr)
    shared by every head (Eq. 17); ``kv_b(RMSNorm(c_KV))`` gives each head's k_nope (dn) and v (dv) (Eq. 10-11).
    Heads attend with ``q = [q_nope, RoPE(q_R)]`` and ``k = [k_nope, RoPE(k_R)]`` at the softmax scale
    ``1/sqrt(dn+dr)`` times YaRN's ``mscale^2`` (``keys.softmax_mscale``), which multiplies q here so that
    ``inner_attention`` keeps its plain ``1/sqrt(head size)`` (sequence parallelism swaps it unchanged). The cache of
    the latent for inference is not built: training attends with k and v expanded per head.

    Tensor parallelism (``spec.TP``): ``q_b`` (or ``q``) and ``kv_b`` column-parallel by head, ``proj`` row-parallel;
    ``q_a``, ``kv_a`` and the latent norms replicated, on the whole input; k_R through :func:`shared_by_heads`.
    Sequence parallelism swaps ``inner_attention``: k_R, expanded to every head first, travels with the heads through
    Ulysses' all-to-all and around the ring. v narrower than q and k (dv < dn+dr) is zero-padded to their width before
    ``inner_attention`` and its output sliced back to dv (CPU flash attention needs equal widths; the result is the
    same, see :meth:`forward`), so Ulysses' all-to-all carries v at dn+dr features and the ring needs no padding of its
    own.
    """

    pad_v = True
    """Zero-pad v to q's width when narrower (:meth:`forward`); False attends with v as it is (the benchmark's
    unpadded contender: same result, the math path of ``scaled_dot_product_attention``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        C, nh = cfg.n_embd, cfg.n_head
        self.dn, self.dr, self.dv, self.rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_width = nh * (self.dn + self.dr)
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.q_a = nn.Linear(C, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:
            self.q = nn.Linear(C, q_width, bias=False)
        self.kv_a = nn.Linear(C, self.rkv + self.dr, bias=False)
        self.kv_norm = nn.RMSNorm(self.rkv, eps=LATENT_NORM_EPS)
        self.kv_b = nn.Linear(self.rkv, nh * (self.dn + self.dv), bias=False)
        self.inner_attention: nn.Module = SDPAttention(cfg.dropout)
        self.proj = nn.Linear(nh * self.dv, C, bias=False)
        self.q_scale = keys.softmax_mscale(cfg)
        self.rope = rotate_pairs if cfg.rope_interleave else rotate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C), ``cos, sin`` (T, dr) or (B, 1, T, dr) -> (B, T, C); ``mask`` as the Llama's."""
        B, T, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if self.q_lora else self.q(x)  # (B, T, nh*(dn+dr))
        q = q.view(B, T, -1, self.dn + self.dr).transpose(1, 2)  # (B, nh, T, dn+dr)
        q_nope, q_rot = q.split([self.dn, self.dr], dim=-1)  # (B, nh, T, dn), (B, nh, T, dr)
        latent, k_rot = self.kv_a(x).split([self.rkv, self.dr], dim=-1)  # (B, T, rkv), (B, T, dr)
        kv = self.kv_b(self.kv_norm(latent)).view(B, T, -1, self.dn + self.dv).transpose(1, 2)  # (B, nh, T, dn+dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)  # (B, nh, T, dn), (B, nh, T, dv)
        k_rot = shared_by_heads(k_rot, self.kv_b.weight)  # (B, T, dr): one key for every head
        k_rot = self.rope(k_rot.unsqueeze(1), cos, sin)  # (B, 1, T, dr)
        q = torch.cat([q_nope, self.rope(q_rot, cos, sin)], dim=-1)  # (B, nh, T, dn+dr)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)  # (B, nh, T, dn+dr)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        # v zero-padded to q's width dn+dr when narrower: torch's CPU flash kernel needs equal widths (unequal ones run
        # the math path, bmm + softmax with the T x T weights kept; bench/bench_deepseek_v3.py's "v unpadded" rows
        # measure the step without the padding: the gain grows with T). The scale stays
        # 1/sqrt(q.size(-1)) = 1/sqrt(dn+dr) (times q_scale above): padding v changes no score. Each output feature is
        # sum_j p_ij v_jd, so the zero features give zero outputs, sliced off, and the slice's backward gives the real
        # features exactly their gradients: equal up to the kernel's rounding (fp32 sums in another order).
        pad = self.dn + self.dr - self.dv if self.pad_v else 0
        v = F.pad(v, (0, pad)) if pad > 0 else v.contiguous()  # (B, nh, T, max(dv, dn+dr))
        y = self.inner_attention(q, k, v, mask=mask)[..., :self.dv]  # (B, nh, T, dv)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def sequence_balance_loss(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """The complementary sequence-wise balance loss of the DeepSeek-V3 report (arXiv:2412.19437, Sec. 2.1.2, Eq. 17-20)
    of one MoE layer, before its factor alpha, averaged over the B sequences (as Megatron-Core's
    ``sequence_load_balancing_loss_func``): ``sum_i f_i P_i`` per sequence of T tokens, with

    - ``f_i = E / (k T) * sum_t 1(s_{i,t} in TopK({s_{j,t}}, k))`` (Eq. 18): the top-k of the plain affinities ``s``
      (neither the selection bias nor the group limit, as Eq. 18 writes it and Megatron-Core's
      ``compute_routing_scores_for_aux_loss`` computes it), without gradient;
    - ``s'_{i,t} = s_{i,t} / sum_j s_{j,t}`` (Eq. 19) and ``P_i = (1/T) sum_t s'_{i,t}`` (Eq. 20), with gradient.

    ``probs`` (B, T, E) fp32: ``s'`` (:meth:`DeepseekMoE.route`'s probs; their top-k is that of ``s``, each token's
    scores divided by one positive sum). Returns a scalar: 1 for a balanced sequence (every ``f_i = 1``, ``P_i = 1/E``),
    up to ``E/k`` where every token of a sequence picks the same k experts with all its affinity on them."""
    B, T, E = probs.shape
    chosen = probs.detach().topk(top_k, dim=-1).indices.reshape(B, -1)  # (B, T*k)
    counts = torch.zeros(B, E, dtype=probs.dtype, device=probs.device).scatter_add_(
        1, chosen, torch.ones_like(chosen, dtype=probs.dtype))  # (B, E): tokens of each sequence on each expert
    f = counts * (E / (top_k * T))  # (B, E), Eq. 18
    P = probs.mean(dim=1)  # (B, E), Eq. 20
    return (f * P).sum(dim=-1).mean()  # Eq. 17 per sequence, then the mean over the B sequences


class DeepseekMoE(MoE):
    """DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066, Sec. 3; DeepSeek-V3 report, Sec. 2.1.2, Eq. 12-16):
    :class:`meshtrain.models.moe.layer.MoE`'s dispatch and experts with V3's routing (:meth:`route`) and
    ``n_shared_experts`` always-on experts as one SwiGLU of width ``n_shared_experts * ffn_hidden``
    (``shared_experts``, ungated): ``y = sum_j w_j SwiGLU_{e_j}(x) + SwiGLU_shared(x)``.

    The selection bias ``expert_bias`` (E,) (``e_score_correction_bias``) is always there: read from a checkpoint,
    and moved after each step by ``router_bias_update_rate`` when that is > 0 (:meth:`MoE.update_bias`).

    With ``seq_aux_loss_alpha`` > 0 each forward also sets :attr:`seq_aux_loss`, the sequence-wise balance loss
    (:func:`sequence_balance_loss`) of its (B, T) tokens, which :meth:`DeepseekV3.aux_loss` adds."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if not self.bias_rate:  # the base registers it only for its update rule
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        self.n_group, self.topk_group, self.scale = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        width = cfg.n_shared_experts * cfg.ffn_hidden_size()
        self.shared_experts = SharedExpert(cfg.n_embd, width) if width else None
        self.seq_balance = cfg.seq_aux_loss_alpha > 0
        self.seq_aux_loss: torch.Tensor | None = None
        """The last forward's :func:`sequence_balance_loss` (a scalar with gradient, before alpha); None when off."""
        self._probs: torch.Tensor | None = None  # route's s' (N, E), kept for forward's sequence-wise loss only

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (N, C) -> (probs (N, E), weights (N, k), experts (N, k)), in fp32.

        ``s = sigmoid(x W_r^T)`` (Eq. 15); the choice scores ``s + b`` rank the G groups of E/G experts by the sum of
        each group's two best, keep the ``topk_group`` best groups, and pick the k best experts in them (the
        node-limited routing of Sec. 2.1.2, as DeepSeek's reference code and ``transformers`` do); the weights are
        those experts' ``s`` (never ``b``), divided by their sum (+1e-20) with ``norm_topk_prob`` (Eq. 13), times
        ``routed_scaling_factor``. ``probs``, for the load-balancing loss, are ``s`` normalised to sum to 1 per token
        (the ``s'`` of the sequence-wise balance loss, Eq. 19)."""
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))  # (N, E)
        choice = scores + self.expert_bias.to(scores.device)  # (N, E)
        N, E = choice.shape
        if self.n_group > 1:
            group_best = choice.view(N, self.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
            groups = group_best.topk(self.topk_group, dim=-1).indices  # (N, topk_group)
            keep = torch.zeros_like(group_best, dtype=torch.bool).scatter_(1, groups, True)  # (N, G)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.n_group, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True)  # (N, E): s', Eq. 19
        if self.seq_balance:
            self._probs = probs
        return probs, weights * self.scale, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C): the routed experts' weighted outputs plus the shared experts'."""
        y = super().forward(x)
        if self.seq_balance:
            self.seq_aux_loss = sequence_balance_loss(self._probs.view(*x.shape[:2], -1), self.top_k)  # (B, T, E)
            self._probs = None
        if self.shared_experts is None:
            return y
        return y + self.shared_experts(x.reshape(-1, x.shape[-1])).reshape(x.shape)


class DeepseekBlock(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``: MLA, and a dense SwiGLU of width ``dense_ffn_hidden`` in the
    first ``first_k_dense_replace`` layers, :class:`DeepseekMoE` after."""

    ATTENTION: Callable[[ModelConfig], nn.Module] = MLAttention
    """The attention's class, built from the config: MLA here, a subclass's own (GLM-4.5's partial-RoPE attention)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = self.ATTENTION(cfg)
        self.ln_2 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        dense = layer < cfg.first_k_dense_replace
        self.mlp = SwiGLU(replace(cfg, ffn_hidden=keys.dense_ffn_hidden(cfg))) if dense else DeepseekMoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x), cos, sin, mask=mask)
        return x + self.mlp(self.ln_2(x))


class DeepseekV3(MultiTokenPrediction, Llama):
    """DeepSeek-V3 decoder returning logits (B, T, V); the Llama's forward over :class:`DeepseekBlock`\\ s, its RoPE
    tables over the ``qk_rope_head_dim`` features (YaRN-scaled, their cos and sin times YaRN's factor); multi-token
    prediction's head, loss and pipeline placement from :class:`meshtrain.models.deepseek_v3.mtp.MultiTokenPrediction`."""

    MOE = True
    SHARED_ATTRS = Llama.SHARED_ATTRS + ("rope_scale",)

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        self.inv_freq, self.rope_scale = rope_frequencies(cfg)  # plain values: not parameters, not in checkpoints
        LayeredLM.__init__(self, cfg, vocab_size, lambda i: DeepseekBlock(cfg, i),
                           head={"norm": lambda: nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)})
        self.add_mtp(cfg, lambda i: DeepseekBlock(cfg, i))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The Llama's ``cos, sin`` (T, dr) or (B, 1, T, dr), times YaRN's factor in fp32 before the cast (as
        ``transformers``' ``attention_scaling``)."""
        cos, sin = super().rope(positions, torch.float32)
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        return cos.to(dtype), sin.to(dtype)

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """The family's plan (:data:`meshtrain.models.deepseek_v3.spec.TP`, :func:`meshtrain.models.tp_plan.tp_plan`);
        with ``sequence_parallel`` (Korthikanti et al. 2022, Sec. 4.2.2), each MoE layer, replicated over tp, takes the
        whole sequence (B, T, C), all-gathered, and returns this rank's (B, T/tp, C) of its output (a slice: every
        rank computes it whole), its shared experts' row-parallel output all-reduced to whole instead of
        reduce-scattered. Backward: the slice's gradient all-gathered, the input's, whole on every rank (the routed
        experts' computed whole, the shared experts' all-reduced), sliced."""
        plan = {**super().tp_plan(sequence_parallel), **self.mtp_tp_plan()}
        if not sequence_parallel:
            return plan
        for i, block in self.blocks.items():
            if isinstance(block.mlp, MoE):
                plan[f"blocks.{i}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
                plan[f"blocks.{i}.mlp.shared_experts.down"] = RowwiseParallel(output_layouts=Replicate())
        return {name: style for name, style in plan.items() if self.get_submodule_or_none(name) is not None}

    def aux_loss(self) -> torch.Tensor | None:
        """``router_aux_loss_coef`` x the MoE layers' load-balancing losses summed / their number (the dense first
        layers have none; :func:`meshtrain.models.moe.layer.aux_loss`), plus with ``seq_aux_loss_alpha`` = alpha > 0
        alpha x the sum of the layers' sequence-wise balance losses (V3 report, Eq. 17: each MoE layer's own loss,
        weighted alpha, as Megatron-Core adds one per layer): a pipeline stage adds those of its layers."""
        layers = [block.mlp for block in self.blocks.values() if isinstance(block.mlp, MoE)]
        loss = moe.aux_loss(layers, self.cfg.router_aux_loss_coef, self.cfg.n_layer - self.cfg.first_k_dense_replace)
        seq = [m.seq_aux_loss for m in layers if getattr(m, "seq_aux_loss", None) is not None]
        if not seq:
            return loss
        seq_loss = self.cfg.seq_aux_loss_alpha * torch.stack(seq).sum()
        return seq_loss if loss is None else loss + seq_loss

    @torch.no_grad()
    def init_weights(self) -> None:
        """The Llama's init (:func:`meshtrain.models.attention.init_decoder_weights`), the shared experts' down
        projection scaled as the other residual outputs; routing biases stay 0."""
        init_decoder_weights(self, nn.RMSNorm, ("attn.proj", "mlp.down", "shared_experts.down"))
