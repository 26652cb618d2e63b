"""Decoder-only GPT: the GPT-2 architecture as laid out in karpathy/nanoGPT, biases optional.

Sources: the transformer decoder of Vaswani et al. 2017 ("Attention Is All You Need",
arXiv:1706.03762, Sec. 3.2 scaled dot-product attention), with GPT-2's pre-norm residual blocks and
scaled residual init (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
Sec. 2.3). Shape legend: B batch, T sequence length, C = n_embd, nh = n_head, hs = C // nh head size,
V vocabulary size.

With ``model.bias = true`` and ``model.activation = "gelu_tanh"`` it is Hugging Face's ``GPT2LMHeadModel``
(biases in every Linear but the head and in every LayerNorm, ``gelu_new``, LayerNorm epsilon
``model.norm_eps``); the defaults (no biases, exact GELU) are nanoGPT's ``bias=False``.

Parameter count (tied head; b = 1 with ``model.bias``, else 0), used by the planner::

    N = V*C + block_size*C + n_layer*(12*C**2 + 2*C + b*11*C) + C + b*C

A block's biases are q, k, v and attn.proj (4C), mlp.fc (4C) and mlp.proj (C); its LayerNorms add
2C of shifts with biases; the final LayerNorm adds C.

The embedding, the blocks, the final norm and the head are separate submodules so a pipeline stage
can drop ``tok_emb``/``pos_emb`` (it then receives hidden states) or ``norm``/``lm_head`` (it then
returns hidden states). Blocks live in a ``ModuleDict`` keyed by layer index, so parameter names
(``blocks.3.attn.q.weight``) are the same whichever stage holds the layer, and a TP plan
(:mod:`meshtrain.models.tp_plan`) names them directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.config import ModelConfig
from meshtrain.models.base import LayeredLM, sample_token

INIT_STD = 0.02
"""Standard deviation of the normal init of every Linear and Embedding weight (GPT-2)."""
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_tanh": "tanh"}
"""``model.activation`` (:data:`meshtrain.config.GPT_ACTIVATIONS`) -> ``nn.GELU(approximate=...)``."""


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


@torch.no_grad()
def init_decoder_weights(model: LayeredLM, norm: type[nn.Module], residual: tuple[str, ...]) -> None:
    """Fill a decoder's parameters from ``model.init_seed`` (GPT-2's scheme, Radford et al. 2019, Sec. 2.3):
    normal(0, 0.02) for Linear and Embedding weights in module order, the modules named ``*residual`` (the
    projections into the residual stream, two per block) at ``0.02 / sqrt(2 * n_layer)``, ``norm`` weights 1,
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
        """``mask``: None (causal), or the (B, 1, T, T) document mask (:func:`document_causal_mask`)."""
        return causal_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, mask=mask)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, Sec. 3.2.2).

    ``q``, ``k`` and ``v`` are separate projections, so splitting each one's output features across
    tensor-parallel ranks gives every rank whole heads of q, k and v (a fused qkv weight split by
    columns would hand one rank all of q and part of k). Heads are viewed as ``(B, T, -1, hs)``: the
    block never assumes how many heads this rank holds.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_size = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.inner_attention: nn.Module = SDPAttention(cfg.dropout)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C). Under tp, q/k/v hold C/tp features: nh/tp heads. ``mask``: None
        (causal), or the (B, 1, T', T') document mask over the whole sequence T' (T' = T but under Ulysses)."""
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs)
        y = self.inner_attention(q, k, v, mask=mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, width 4C with GELU (Vaswani et al. 2017, Sec. 3.3; GPT-2).

    ``model.activation`` "gelu" is the exact ``x * Phi(x)``; "gelu_tanh" is Hendrycks & Gimpel's
    approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x**3)))`` (arXiv:1606.08415, Sec. 2), GPT-2's
    ``gelu_new``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.act = nn.GELU(approximate=GELU_APPROXIMATIONS[cfg.activation])
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C); the hidden activation is (B, T, 4C)."""
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2): ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, T, C) -> (B, T, C); ``mask`` goes to the attention (a keyword, which tensor parallelism's
        input hooks pass through unchanged)."""
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT(LayeredLM):
    """Decoder-only language model returning logits; the loss is computed by the caller.

    Args:
        cfg: model shape (``n_layer``, ``n_head``, ``n_embd``, ``block_size``, ``dropout``) and GPT-2's
            options (``bias``, ``activation``, ``norm_eps``).
        vocab_size: V, number of token ids.

    Weights are drawn from a seed taken from the global torch RNG at construction, so
    ``torch.manual_seed(s); GPT(cfg, V)`` is deterministic, and a model built on the meta device then
    ``to_empty(device=...)`` + :meth:`init_weights` gets the same weights as a normal build after the
    same ``torch.manual_seed(s)``.
    """

    EMBEDDING_MODULES = ("tok_emb", "pos_emb")
    HEAD_MODULES = ("norm", "lm_head")

    pos_emb: nn.Embedding | None
    norm: nn.LayerNorm | None

    def __init__(self, cfg: ModelConfig, vocab_size: int) -> None:
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"model.n_embd = {cfg.n_embd} must be divisible by model.n_head = {cfg.n_head}")
        if cfg.activation not in GELU_APPROXIMATIONS:
            raise ValueError(f"model.activation = {cfg.activation!r} is not valid: use one of "
                             f"{', '.join(GELU_APPROXIMATIONS)}")
        super().__init__(cfg, vocab_size, lambda i: Block(cfg),
                         embedding={"pos_emb": lambda: nn.Embedding(cfg.block_size, cfg.n_embd)},
                         head={"norm": lambda: nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)})

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from ``self.init_seed``; idempotent and device independent.

        normal(0, 0.02) for Linear and Embedding weights, with the residual output projections
        (``attn.proj``, ``mlp.proj``) scaled by ``1/sqrt(2*n_layer)`` (GPT-2, Sec. 2.3: two residual
        additions per block); LayerNorm weights 1; with ``model.bias`` every bias 0. Values are drawn on
        the CPU from a private generator in module order, then copied, so CPU, GPU and meta->``to_empty``
        builds agree bit for bit.
        Re-ties ``lm_head.weight`` to ``tok_emb.weight`` (``to_empty`` may have untied them); does
        nothing else while parameters are on the meta device. Build the optimizer after this call.
        """
        init_decoder_weights(self, nn.LayerNorm, ("attn.proj", "mlp.proj"))

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """The tensor-parallel plan of this model (:func:`meshtrain.models.tp_plan.tp_plan`)."""
        from meshtrain.models.tp_plan import tp_plan

        return {name: style for name, style in tp_plan(self.blocks.keys(), sequence_parallel,
                                                                self.tok_emb is not None).items()
                if self.get_submodule_or_none(name) is not None}

    def tp_split_dropout_modules(self, sequence_parallel: bool) -> list[nn.Module]:
        """Modules whose dropout acts on activations split across tp: attention weights (heads are
        split), and with ``sequence_parallel`` the residual-stream dropouts (the sequence is split)."""
        out: list[nn.Module] = []
        for block in self.blocks.values():
            out.append(block.attn.inner_attention)
            if sequence_parallel:
                out += [block.attn.resid_drop, block.mlp.drop]
        return out

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``idx`` (B, T) int64 -> logits (B, T, V).

        ``positions`` (T,) int64 are the global positions of the T tokens (default ``0..T-1``); a
        sequence-parallel rank holding a shard of each sample passes the positions of its shard.
        With document packing (``data.packing = "document"``) they are per sample, (B, T), restarting at
        each document, and ``doc_ids`` (B, T') int64 give the document of every token of the *whole*
        sequence (T' = T, or T * sp under Ulysses sequence parallelism, whose attention sees every token):
        attention is then masked to each document (:func:`document_causal_mask`); None: one causal sequence.
        A pipeline stage without ``tok_emb`` takes hidden states (B, T, C) instead; one without
        ``lm_head`` returns hidden states (B, T, C).

        Raises:
            ValueError: a position >= block_size.
        """
        positions = self.checked_positions(idx, positions)  # (T,) or (B, T)
        if self.tok_emb is not None:
            x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))  # (B, T, C)
        else:
            x = idx  # (B, T, C) hidden states from the previous stage
        mask = None if doc_ids is None else document_causal_mask(doc_ids)  # (B, 1, T', T')
        for block in self.blocks.values():
            x = block(x, mask=mask)  # (B, T, C)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))  # (B, T, V)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 on_token: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Autoregressively sample ``max_new_tokens`` tokens after ``idx`` (B, T0); return (B, T0 + N).

        The context fed to the model is cropped to the last ``block_size`` tokens; each token is drawn
        by :func:`meshtrain.models.base.sample_token` (``temperature`` >= 0, 0 greedy; optional ``top_k``,
        ``generator`` on the device of ``idx``). ``on_token`` gets each new token (B, 1) as it is drawn.
        """
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.block_size:]  # (B, <= block_size)
            nxt = sample_token(self(ctx)[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)  # (B, T + 1)
            if on_token is not None:
                on_token(nxt)
        return idx
