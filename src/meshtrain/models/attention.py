"""The decoders' shared attention pieces: causal scaled dot-product attention with grouped-query heads, the
document mask of packed sequences, the swappable ``inner_attention`` module, and GPT-2's weight init.

Sequence parallelism (:mod:`meshtrain.parallel.sequence`) replaces :class:`SDPAttention` and calls
:func:`causal_attention`; every decoder family (``gpt``, ``llama``, ``qwen2``, ``qwen3``) builds on these.
Shape legend: B batch, nh query heads, nkv key/value heads, T sequence length, hs head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.base import LayeredLM

INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight (GPT-2)."""


def repeat_kv(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention (Ainslie et al. 2023, Sec. 2.2): ``kv`` (B, nkv, T, hs) repeated to q's
    (B, nh, T, hs) heads, each kv head serving ``nh / nkv`` consecutive query heads; as is when equal."""
    groups = q.size(1) // kv.size(1)
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` of ``q`` (B, nh, T, hs) and ``k, v`` (B, nkv, T, hs; nkv
    divides nh, :func:`repeat_kv`) -> (B, nh, T, hs), in the inputs' dtype.

    ``mask``: None for the causal mask over the whole sequence (``is_causal``); or a (B, 1, T, T) bool mask,
    True where a query may attend to a key (:func:`document_causal_mask`), the same for every head.

    bf16 inputs on the CPU (what bf16 autocast hands over from the q/k/v projections) run the kernel
    in fp32 and cast the result back: torch's CPU flash-attention kernel is slower in bf16 than in fp32
    (its backward took 13.3 ms of a 39.5 ms bf16 step of the main job's model against 3.2 ms in fp32,
    AVX512-BF16 EPYC, docs/benchmarks.md), while the matmuls around it gain from bf16. On CUDA the bf16
    kernel is the fast one and runs as it is."""
    k, v = repeat_kv(q, k), repeat_kv(q, v)  # (B, nh, T, hs)
    if isinstance(mask, DocumentMask):
        mask = mask.dense
    masking = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        with torch.autocast("cpu", enabled=False):  # CPU autocast would cast the fp32 copies back to bf16
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, **masking)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **masking)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of packed documents (``data.packing = "document"``, Krell et al. 2021,
    arXiv:2107.02027, Sec. 3): ``doc_ids`` (B, T) int64, the document index of every token of the whole
    sequence (:func:`meshtrain.data.packing.document_ids`) -> (B, 1, T, T) bool, True where query i may attend
    to key j: ``j <= i`` and both in the same document. It broadcasts over heads, so every tensor-parallel
    or Ulysses head shard uses the same mask. Every row keeps its diagonal: no softmax row is empty."""
    T = doc_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    return (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & causal  # (B, 1, T, T)


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """The document mask of packed sequences (:func:`document_causal_mask`) kept as its document ids ``doc_ids``
    (B, T) int64 of the whole sequence: what a model hands its attention when ``data.packing = "document"``. Whole
    attention (SDPA, Ulysses after its all-to-all) takes :attr:`dense`, (B, 1, T, T) bool, built once and shared by
    every layer; ring attention takes :meth:`block` slices, (B, 1, rows, cols), and never holds the T x T mask."""

    doc_ids: torch.Tensor

    @cached_property
    def dense(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True where query i may attend to key j (:func:`document_causal_mask`)."""
        return document_causal_mask(self.doc_ids)

    def block(self, rows: slice, cols: slice) -> torch.Tensor:
        """The (B, 1, len(rows), len(cols)) bool part of :attr:`dense` at global query positions ``rows`` and key
        positions ``cols`` (slices with a start and a stop), computed from the ids alone: same document and
        ``key <= query``."""
        q, k = self.doc_ids[:, rows], self.doc_ids[:, cols]  # (B, r), (B, c)
        i = torch.arange(rows.start, rows.stop, device=q.device)
        j = torch.arange(cols.start, cols.stop, device=q.device)
        return (q[:, None, :, None] == k[:, None, None, :]) & (j[None, :] <= i[:, None])  # (B, 1, r, c)


@torch.no_grad()
def init_decoder_weights(model: LayeredLM, norm: type[nn.Module], residual: tuple[str, ...]) -> None:
    """Fill a decoder's parameters from ``model.init_seed`` (GPT-2's scheme, Radford et al. 2019, Sec. 2.3):
    normal(0, 0.02) for Linear and Embedding weights in module order, the modules named ``*residual`` (the
    projections into the residual stream, two per block) at ``0.02 / sqrt(2 * n_layer)`` (so are the experts'
    down projections of a module with ``expert_weights()``, :class:`meshtrain.models.moe.layer.GroupedExperts`), ``norm`` weights 1,
    every Linear and ``norm`` bias 0 (GPT-2's, Hugging Face ``GPT2PreTrainedModel._init_weights``; biases draw
    nothing, so a model without them gets the same weights). Draws come from a private CPU generator and are
    copied, so CPU, GPU and meta -> ``to_empty`` builds agree bit for bit. Re-ties the head first
    (``to_empty`` may have untied it); nothing else while on meta."""
    tied = model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        return  # nothing to fill yet: call again after ``to_empty``
    gen = torch.Generator(device="cpu").manual_seed(model.init_seed)
    resid_std = INIT_STD / math.sqrt(2 * model.cfg.n_layer)
    for name, module in model.named_modules():
        if isinstance(module, norm):
            module.weight.fill_(1.0)
        elif hasattr(module, "expert_weights"):  # a mixture of experts' stacks (E, out, in), one Linear each
            for w, residual_out in module.expert_weights():
                std = resid_std if residual_out else INIT_STD
                w.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(0.0, std, generator=gen))
        elif isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and not (tied and module is model.lm_head)):
            std = resid_std if name.endswith(residual) else INIT_STD
            w = module.weight
            w.copy_(torch.empty(w.shape, dtype=w.dtype).normal_(0.0, std, generator=gen))
        if isinstance(module, (norm, nn.Linear)) and getattr(module, "bias", None) is not None:
            module.bias.zero_()


class SDPAttention(nn.Module):
    """Causal scaled dot-product attention on whole sequences: the default ``inner_attention``.

    ``q, k, v`` (B, nh, T, hs) -> (B, nh, T, hs), ``softmax(q k^T / sqrt(hs)) v`` with a causal mask
    (Vaswani et al. 2017, Eq. 1), dropout on the attention weights while training. Sequence
    parallelism swaps this module for one that sees only a shard of the sequence
    (:mod:`meshtrain.parallel.sequence`); nothing else in the block changes.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None (causal), the (B, 1, T, T) document mask (:func:`document_causal_mask`) or a
        :class:`DocumentMask`."""
        return causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, mask=mask)
