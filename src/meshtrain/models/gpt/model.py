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
(``spec.py``, :mod:`meshtrain.models.tp_plan`) names them directly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtrain.models.attention import DocumentMask, SDPAttention, init_decoder_weights
from meshtrain.models.base import LayeredLM
from meshtrain.models.registry import ModelConfig

GELU_APPROXIMATIONS = {"gelu": "none", "gelu_tanh": "tanh"}
"""``model.activation`` (:data:`meshtrain.models.gpt.spec.ACTIVATIONS`) -> ``nn.GELU(approximate=...)``."""


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
        mask = None if doc_ids is None else DocumentMask(doc_ids)  # (B, 1, T', T') as ids
        for block in self.blocks.values():
            x = block(x, mask=mask)  # (B, T, C)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))  # (B, T, V)
