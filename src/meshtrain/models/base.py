"""What every language model here shares: embedding -> blocks -> head, cut at block boundaries.

A model is the sequence ``[embedding modules, blocks["0"], ..., blocks[str(L-1)], head modules]``.
Blocks live in an ``nn.ModuleDict`` keyed by layer index, so a parameter's name
(``blocks.3.rnn.weight_hh_l0``) is the same whichever pipeline stage holds the layer, and a
checkpoint saved under one layout loads under another. The head's output matrix may share the
token embedding's weight (Press & Wolf 2017, "Using the Output Embedding to Improve Language
Models", arXiv:1608.05859); a pipeline that puts the two on different stages gives the head a copy
and keeps them equal by summing their gradients (:mod:`meshtrain.parallel.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshtrain.models.registry import ModelConfig, family

ADAPTER_MARK = ".lora_"
"""In every adapter parameter's name (``blocks.0.attn.q.lora_A.weight``, :mod:`meshtrain.adapters.lora`), in no
model's own: what tells them apart in a state dict (Hugging Face weights in, adapters-only checkpoints)."""


TIED_NAMES = ("tok_emb.weight", "lm_head.weight")
"""The two names of a tied embedding's one weight (Press & Wolf 2017): the embedding's and the head's."""


def is_adapter(name: str) -> bool:
    """Whether the parameter named ``name`` is an adapter's (LoRA's ``A`` or ``B``, :mod:`meshtrain.adapters.lora`),
    not the model's own."""
    return ADAPTER_MARK in name


def sample_token(logits: torch.Tensor, temperature: float, top_k: int | None,
                 generator: torch.Generator | None) -> torch.Tensor:
    """One sampled token id per row: ``logits`` (B, V) of the last position -> (B, 1) int64.

    ``temperature`` 0 (or below the smallest normal of ``logits``' dtype, which would round it to 0) is greedy
    decoding: the most likely id (the first of equal ones, ``argmax``). Otherwise
    logits are divided by ``temperature`` (> 0), optionally restricted to the ``top_k`` largest, and
    sampled with ``torch.multinomial`` from ``generator`` (same device as ``logits``) if given.
    """
    if temperature < torch.finfo(logits.dtype).tiny:  # 0, or one the logits' dtype rounds to 0: the greedy limit
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    # shifted by the row's max first (softmax is shift-invariant): a tiny temperature (1e-38) then gives 0 for
    # the max and -inf below it, the greedy limit, instead of inf - inf = nan
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)


class LayeredLM(nn.Module):
    """Base of every family's model (:class:`meshtrain.models.gpt.model.GPT`, ``llama``, ``rnn``, ...).

    :meth:`__init__` builds ``tok_emb`` (``nn.Embedding``), ``drop``, ``blocks`` (``nn.ModuleDict``) and
    ``lm_head`` (``nn.Linear``) around the subclass's blocks and extra modules; subclasses name their
    modules in the class attributes below and fill the weights in :meth:`init_weights`.
    """

    EMBEDDING_MODULES: ClassVar[tuple[str, ...]] = ("tok_emb",)
    """Modules of the first pipeline chunk (token ids in); None on other chunks."""
    HEAD_MODULES: ClassVar[tuple[str, ...]] = ("lm_head",)
    """Modules of the last pipeline chunk (logits out); None on other chunks."""
    SHARED_ATTRS: ClassVar[tuple[str, ...]] = ("init_seed", "cfg", "vocab_size", "block_size", "share_embedding",
                                               "drop")
    """Attributes (plain values or modules every chunk uses) a pipeline chunk shares with the whole model."""

    aux_grad_scale: float = 1.0
    """The weight the trainer's objective gives this forward's cross-entropy, which a family's auxiliary loss gets
    too (:func:`meshtrain.models.moe.layer.attach_aux_loss`): ``1 / micro-batches`` where each micro-batch's loss
    is divided before backward (:class:`meshtrain.parallel.model.ReplicatedModel` sets it), 1 under a pipeline
    schedule, which divides the gradients afterwards."""

    aux_history: list[torch.Tensor] | None = None
    """Where a list, each training forward appends its auxiliary loss (detached): a pipeline's stages run their
    micro-batches inside the schedule, and :class:`meshtrain.parallel.model.PipelineModel` reads them here for the
    metrics; None (the default) records nothing."""

    init_seed: int
    cfg: ModelConfig
    vocab_size: int
    block_size: int
    tok_emb: nn.Embedding | None
    drop: nn.Dropout
    lm_head: nn.Linear | None
    blocks: nn.ModuleDict
    share_embedding: bool

    def __init__(self, cfg: ModelConfig, vocab_size: int, make_block: Callable[[int], nn.Module],
                 embedding: Mapping[str, Callable[[], nn.Module]] | None = None,
                 head: Mapping[str, Callable[[], nn.Module]] | None = None) -> None:
        """Draw ``init_seed``, then build and register, in this order: ``tok_emb`` (V, C), each module of
        ``embedding`` (name -> factory), ``drop``, ``blocks`` (``make_block(i)`` keyed ``str(i)`` for
        ``i < cfg.n_layer``), each module of ``head``, ``lm_head`` (C -> V, no bias); tie ``lm_head`` to
        ``tok_emb`` if :meth:`ties_embeddings` and fill every weight with :meth:`init_weights`.

        ``init_seed`` is drawn from the global torch RNG first, on the CPU, so ``torch.manual_seed(s)``
        fixes the weights and a meta-device build consumes the same RNG as a normal one. The modules are
        built from factories so that they come after that draw, in registration order: the order fixes
        the parameter and state-dict order, which :meth:`init_weights` fills in, and the global RNG
        draws of the modules' default init -- changing it changes every weight of a seed.
        """
        super().__init__()
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.block_size = cfg.block_size
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        for name, build in (embedding or {}).items():
            setattr(self, name, build())
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): make_block(i) for i in range(cfg.n_layer)})  # keys survive a pipeline split
        for name, build in (head or {}).items():
            setattr(self, name, build())
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.share_embedding = self.ties_embeddings()
        """Whether ``lm_head`` uses ``tok_emb``'s weight; a pipeline gives its last stage a copy (:meth:`untie_weights`)."""
        self.tie_weights()  # Press & Wolf 2017; GPT-2
        self.init_weights()

    def aux_loss(self) -> torch.Tensor | None:
        """The family's auxiliary loss of the last forward over this model's blocks (a scalar; its gradient reaches
        the parameters through the forward's output, :mod:`meshtrain.models.family`), or None: no auxiliary loss."""
        return None

    def ties_embeddings(self) -> bool:
        """Whether a whole model of this class shares ``tok_emb``'s weight with ``lm_head`` (read once, in
        :meth:`__init__`, after ``cfg`` is set); True unless a subclass says otherwise."""
        return True

    def init_weights(self) -> None:
        """(Re)initialise every parameter from ``self.init_seed``, re-tying the head first (subclasses)."""
        raise NotImplementedError

    def checked_positions(self, idx: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """The global positions (T,) int64 of the T tokens of ``idx`` (B, T) (or hidden states (B, T, C)):
        ``positions``, or ``0..T-1`` when None; per-sample positions (B, T) (document packing,
        :mod:`meshtrain.data.packing`) are returned as they are.

        Raises:
            ValueError: a position >= block_size.
        """
        T = idx.size(1)
        if positions is None:
            positions = torch.arange(T, device=idx.device)  # (T,)
        if T and int(positions.max()) >= self.block_size:
            raise ValueError(f"sequence length {int(positions.max()) + 1} exceeds model.block_size = {self.block_size}")
        return positions

    def tie_weights(self) -> bool:
        """Share ``tok_emb.weight`` with ``lm_head`` when this model (or stage) holds both and tying is on;
        return whether it does."""
        tied = self.share_embedding and self.tok_emb is not None and self.lm_head is not None
        if tied:
            self.lm_head.weight = self.tok_emb.weight
        return tied

    def untie_weights(self) -> None:
        """Give ``lm_head`` its own copy of the shared weight, equal to it now. A pipeline whose
        embedding and head sit in different stages keeps the two equal by summing their gradients
        (Megatron-LM's embedding group, Shoeybi et al. 2019; :mod:`meshtrain.parallel.pipeline`).
        Nothing to do for an untied model."""
        if self.share_embedding:
            self.share_embedding = False
            self.lm_head.weight = nn.Parameter(self.tok_emb.weight.detach().clone())

    def keep_only(self, layers: set[int], embedding: bool, head: bool) -> None:
        """Drop every block not in ``layers``, and the embedding / head modules unless kept: what one
        pipeline rank holds. Block keys (parameter names) are unchanged."""
        for key in [k for k in self.blocks if int(k) not in layers]:
            del self.blocks[key]
        for keep, names in ((embedding, self.EMBEDDING_MODULES), (head, self.HEAD_MODULES)):
            if not keep:
                for name in names:
                    setattr(self, name, None)

    def pipeline_chunk(self, layers: range, embedding: bool, head: bool) -> LayeredLM:
        """A model of the same class over blocks ``layers`` (with the embedding and/or the head) that
        shares this model's modules: one pipeline stage's forward, ``(B, T)`` ids or ``(B, T, C)``
        hidden states in, ``(B, T, V)`` logits or ``(B, T, C)`` hidden states out."""
        chunk = type(self).__new__(type(self))
        nn.Module.__init__(chunk)
        for name in self.SHARED_ATTRS:
            setattr(chunk, name, getattr(self, name))
        for keep, names in ((embedding, self.EMBEDDING_MODULES), (head, self.HEAD_MODULES)):
            for name in names:
                setattr(chunk, name, getattr(self, name) if keep else None)
        chunk.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in layers})
        return chunk

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """The tensor-parallel plan of this model or pipeline chunk: :func:`meshtrain.models.tp_plan.tp_plan` with
        its family's module names (``spec.py``), entries for modules this chunk lacks dropped.

        Raises:
            ValueError: a family without a tensor-parallel plan (config validation refuses tp > 1 for it first).
        """
        from meshtrain.models.tp_plan import tp_plan

        names = family(self.cfg.type).tp
        if names is None:
            raise ValueError(f"model.type = {self.cfg.type!r} does not support tensor parallelism: use parallel.tp = 1")
        plan = tp_plan(self.blocks.keys(), sequence_parallel, self.tok_emb is not None, names)
        return {name: style for name, style in plan.items() if self.get_submodule_or_none(name) is not None}

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 on_token: Callable[[torch.Tensor], bool | None] | None = None) -> torch.Tensor:
        """Autoregressively sample ``max_new_tokens`` tokens after ``idx`` (B, T0); return (B, T0 + N).

        The context fed to the model is cropped to the last ``block_size`` tokens; each token is drawn
        by :func:`sample_token` (``temperature`` >= 0, 0 greedy; optional ``top_k``, ``generator`` on the device
        of ``idx``). ``on_token`` gets each new token (B, 1) as it is drawn; when it returns True, sampling
        stops there (``generate --chat`` stops at the end-of-turn token), that token included in the result.
        """
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.block_size:]  # (B, <= block_size)
            nxt = sample_token(self(ctx)[:, -1, :], temperature, top_k, generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)  # (B, T + 1)
            if on_token is not None and on_token(nxt):
                break
        return idx

    def get_submodule_or_none(self, name: str) -> nn.Module | None:
        try:
            return self.get_submodule(name)
        except AttributeError:
            return None

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, a tied ``tok_emb``/``lm_head`` weight counted once.

        ``exclude_embeddings=True`` leaves out the embedding tables (token, and position where there is
        one), the N of Kaplan et al. 2020 (arXiv:2001.08361, Sec. 2.1) used in ``6*N`` FLOP estimates.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if exclude_embeddings:
            n -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        return n
