"""Llama: a pre-norm decoder with RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query attention.

Sources: Touvron et al. 2023 ("LLaMA", arXiv:2302.13971, Sec. 2.2: pre-normalisation with RMSNorm, SwiGLU,
rotary embeddings); RMSNorm, Zhang & Sennrich 2019 (arXiv:1910.07467, Eq. 4); RoPE, Su et al. 2021
(arXiv:2104.09864, Eq. 34); SwiGLU, Shazeer 2020 (arXiv:2002.05202, Eq. 6); grouped-query attention,
Ainslie et al. 2023 (arXiv:2305.13245, Sec. 2.2); Llama 3 (Dubey et al. 2024, arXiv:2407.21783, Table 3)
and the Llama 3.1 RoPE frequency scaling of its reference code. Rotary embeddings rotate the two halves
of each head (Hugging Face ``transformers``' convention), so Hugging Face checkpoints load without
permuting q and k.

Shape legend: B batch, T sequence length (this rank's tokens under sp), C = n_embd, nh = n_head,
nkv = n_kv_head, hd = head size (``model.head_dim``, by default C // nh), F = ffn hidden size, V vocabulary size.

Parameter count (no biases; ``tie_embeddings`` drops the head's V*C)::

    N = V*C (+ V*C untied) + n_layer*(C*nh*hd + 2*C*nkv*hd + nh*hd*C + 3*C*F + 2*C) + C

Module names follow the GPT's (``blocks.3.attn.q``, ``blocks.3.mlp.gate``), so the pipeline split, the
tensor-parallel plan (``spec.py``, :mod:`meshtrain.models.tp_plan`) and checkpoints work the same way.

Two class attributes make the Llama's close relatives (their folders subclass it): ``QKV_BIAS``, biases on
the q, k and v projections (Qwen2), and ``QK_NORM``, an RMSNorm over each head's features of q and k before
RoPE (Qwen3, Yang et al. 2025, arXiv:2505.09388, Sec. 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.attention import DocumentMask, SDPAttention, init_decoder_weights
from meshtrain.models.base import LayeredLM
from meshtrain.models.moe import layer as moe
from meshtrain.models.moe.layer import MoE
from meshtrain.models.registry import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (hd/2,) fp32 of RoPE: ``theta ** (-2i / hd)`` (Su et al. 2021, Eq. 15).

    With ``rope_scaling_factor`` > 0, Llama 3.1's scaling: wavelengths longer than ``original / low`` (of
    ``rope_original_max_positions``) are divided by the factor, shorter than ``original / high`` are kept,
    and those between interpolate smoothly between the two."""
    hd = cfg.head_size()
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))  # (hd/2,) fp32, as Hugging Face computes it
    factor = cfg.rope_scaling_factor
    if factor:
        old = cfg.rope_original_max_positions
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2 * math.pi / inv
        smooth = ((old / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
        inv = (1 - smooth) * inv / factor + smooth * inv
    return inv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` (B, h, T, hd) with ``cos, sin`` (T, hd), or per sample (B, 1, T, hd): each head's halves
    ``(x1, x2)`` become ``(x1 cos - x2 sin, x2 cos + x1 sin)`` at each position's angles."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, hd/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal self-attention with grouped-query heads: ``nh`` query heads share ``nkv`` key/value heads
    (``nh / nkv`` queries per group), RoPE on q and k; with ``bias`` q, k and v have biases (Qwen2), with
    ``qk_norm`` each head of q and k is RMS-normalised before RoPE (``q_norm``, ``k_norm``: weights (hd,), Qwen3).

    q, k and v are separate column-parallel projections under tp (every rank gets whole query and kv
    heads, ``nkv % tp == 0``); ``inner_attention`` receives k and v with their own head count, so that
    sequence parallelism moves the smaller kv tensors (Ulysses needs ``nkv % (tp*sp) == 0``).
    """

    def __init__(self, cfg: ModelConfig, bias: bool = False, qk_norm: bool = False) -> None:
        super().__init__()
        self.head_size = cfg.head_size()
        width, kv = cfg.n_head * self.head_size, cfg.kv_heads() * self.head_size
        self.q = nn.Linear(cfg.n_embd, width, bias=bias)
        self.k = nn.Linear(cfg.n_embd, kv, bias=bias)
        self.v = nn.Linear(cfg.n_embd, kv, bias=bias)
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_size, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_size, eps=cfg.norm_eps)
        self.qk_norm = qk_norm
        self.inner_attention: nn.Module = SDPAttention(cfg.dropout)
        self.proj = nn.Linear(width, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C), ``cos, sin`` (T, hd) or (B, 1, T, hd) -> (B, T, C); ``mask``: None (causal) or the
        document mask (:func:`meshtrain.models.attention.document_causal_mask`)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_size)  # (B, T, nh, hd)
        k = self.k(x).view(B, T, -1, self.head_size)  # (B, T, nkv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # over hd, per head
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = self.v(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nkv, T, hd)
        y = self.inner_attention(self.rope(q, cos, sin), self.rope(k, cos, sin), v, mask=mask)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))

    def rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of q or k ``t`` (B, h, T, hd) over every feature: :func:`rotate` (a family that rotates fewer, GLM-4.5,
        overrides it)."""
        return rotate(t, cos, sin)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer 2020, Eq. 6), hidden width F."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.ffn_hidden_size()
        self.gate = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C); the hidden activation is (B, T, F) (F/tp under tp)."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, RMSNorm before each; ``mlp`` a SwiGLU or, in the
    mixture-of-experts relatives, routed experts (:class:`meshtrain.models.moe.layer.MoE`)."""

    def __init__(self, cfg: ModelConfig, bias: bool = False, qk_norm: bool = False,
                 mlp: Callable[[ModelConfig], nn.Module] = SwiGLU) -> None:
        super().__init__()
        self.ln_1 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = LlamaAttention(cfg, bias, qk_norm)
        self.ln_2 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = mlp(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C); ``mask`` goes to the attention as a keyword (tp's input hooks pass it on)."""
        x = x + self.attn(self.ln_1(x), cos, sin, mask=mask)
        return x + self.mlp(self.ln_2(x))


class Llama(LayeredLM):
    """Llama-family decoder returning logits; the loss is computed by the caller.

    Args:
        cfg: ``n_layer``, ``n_head``, ``n_kv_head``, ``n_embd``, ``block_size``, the MLP width
            (``ModelConfig.ffn_hidden_size``), ``rope_*``, ``norm_eps``, ``tie_embeddings``, ``dropout``.
        vocab_size: V.

    As the GPT, weights come from a seed drawn from the global torch RNG at construction and are filled
    by :meth:`init_weights` from a private CPU generator (device independent, meta-device friendly).
    """

    HEAD_MODULES = ("norm", "lm_head")
    SHARED_ATTRS = LayeredLM.SHARED_ATTRS + ("inv_freq",)
    QKV_BIAS = False
    """Biases on the q, k and v projections (Qwen2's)."""
    QK_NORM = False
    """RMSNorm over each head's features of q and k before RoPE (Qwen3's)."""
    MOE = False
    """Routed experts instead of the SwiGLU MLP in every block (Mixtral's, Qwen3-MoE's): :mod:`meshtrain.models.moe`."""

    norm: nn.RMSNorm | None

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        self.inv_freq = rope_frequencies(cfg)  # a plain tensor: not a parameter, not in checkpoints
        mlp = MoE if self.MOE else SwiGLU
        super().__init__(cfg, vocab_size, lambda i: LlamaBlock(cfg, self.QKV_BIAS, self.QK_NORM, mlp),
                         head={"norm": lambda: nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)})

    def aux_loss(self) -> torch.Tensor | None:
        """The routers' load-balancing loss of the last forward over this model's (or pipeline stage's) blocks,
        ``router_aux_loss_coef`` x their sum / ``n_layer`` (:func:`meshtrain.models.moe.layer.aux_loss`); None
        without experts."""
        if not self.MOE:
            return None
        return moe.aux_loss([block.mlp for block in self.blocks.values()], self.cfg.router_aux_loss_coef,
                            self.cfg.n_layer)

    def ties_embeddings(self) -> bool:
        """``model.tie_embeddings``: untied by default, as Llama 2/3 (7B and up) are."""
        return self.cfg.tie_embeddings

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from ``self.init_seed``: normal(0, 0.02) for Linear and Embedding
        weights, the residual output projections (``attn.proj``, ``mlp.down``) scaled by
        ``1/sqrt(2*n_layer)`` as in GPT-2 (Radford et al. 2019, Sec. 2.3), RMSNorm weights 1; an untied
        head gets its own draw."""
        init_decoder_weights(self, nn.RMSNorm, ("attn.proj", "mlp.down"))

    def tp_split_dropout_modules(self, sequence_parallel: bool) -> list[nn.Module]:
        """Modules whose dropout acts on tp-split activations: the attention weights (heads are split)."""
        return [block.attn.inner_attention for block in self.blocks.values()]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` (T, hd) of the global ``positions`` (T,), computed in fp32 and cast to ``dtype``; of
        per-sample positions (B, T) (document packing): (B, 1, T, hd), broadcast over the heads."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)  # (T, hd/2) or (B, T, hd/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, hd) or (B, T, hd)
        if angles.dim() == 3:
            angles = angles.unsqueeze(1)  # (B, 1, T, hd)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``idx`` (B, T) int64 -> logits (B, T, V).

        ``positions`` (T,) int64 are the global positions of the T tokens (default ``0..T-1``; a
        sequence-parallel rank passes its shard's, ring attention's zigzag chunks included); every block
        rotates q and k by them. With document packing they are per sample, (B, T), restarting at each
        document, and ``doc_ids`` (B, T') mask attention to each document, as in
        :meth:`meshtrain.models.gpt.model.GPT.forward`. A pipeline stage without ``tok_emb`` takes hidden states
        (B, T, C) and its positions as well; one without ``lm_head`` returns hidden states (B, T, C).

        Raises:
            ValueError: a position >= block_size.
        """
        positions = self.checked_positions(idx, positions)  # (T,) or (B, T)
        x = self.drop(self.tok_emb(idx)) if self.tok_emb is not None else idx  # (B, T, C)
        cos, sin = self.rope(positions, torch.get_autocast_dtype(x.device.type)
                             if torch.is_autocast_enabled(x.device.type) else x.dtype)
        mask = None if doc_ids is None else DocumentMask(doc_ids)  # (B, 1, T', T') as ids
        for block in self.blocks.values():
            x = block(x, cos, sin, mask=mask)  # (B, T, C)
        aux = self.aux_loss()
        if aux is not None and self.aux_history is not None and self.training:
            self.aux_history.append(aux.detach())  # a pipeline stage's share, for the metrics
        x = moe.attach_aux_loss(x, aux, self.aux_grad_scale)  # the routers' loss, through backward
        if self.lm_head is None:
            return x
        return self.output(x, idx, cos, sin, mask)

    def output(self, x: torch.Tensor, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: DocumentMask | None) -> torch.Tensor:
        """The head: the last block's ``x`` (B, T, C) -> logits (B, T, V); ``idx`` (B, T) and the forward's RoPE tables
        and mask are for a family with more heads (DeepSeek-V3's multi-token prediction)."""
        return self.lm_head(self.norm(x))  # (B, T, V)
