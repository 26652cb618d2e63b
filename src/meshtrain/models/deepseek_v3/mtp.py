"""DeepSeek-V3's multi-token prediction (DeepSeek-V3 report, arXiv:2412.19437, Sec. 2.2): the D sequential modules
``mtp.{k}`` beside the blocks, their forward after the main head, their loss, and where a pipeline puts them.

Shape legend: B batch, T tokens (this rank's under sp), C = n_embd, V vocabulary, D = ``num_nextn_predict_layers``.

Under pipeline parallelism the modules run on the last stage, after the main head whose weight they share (as
Megatron-Core's ``multi_token_prediction.py`` places them). Depth k embeds the tokens k ahead, so that stage needs the
embedding too: an untied model's last stage keeps its own copy of ``tok_emb`` (under the same name, so a checkpoint
reads the same under every layout), equal to stage 0's at the start and kept equal by summing the two gradients over
the embedding group, as the head's copy of a tied weight is (Megatron-LM's embedding group,
:mod:`meshtrain.parallel.pipeline`); a tied model's depths embed with that head copy. Under the V placement (zbv: the
first and the last chunk on rank 0) the last chunk gets a copy of its own, which the pipeline refreshes from
``tok_emb`` before each step and whose gradient it adds to ``tok_emb``'s: two chunks cannot share a parameter, as
each stage divides its own gradients by the micro-batches. The tokens a depth embeds and the targets it predicts,
made on the whole window, reach the last stage as one more step argument (:meth:`MultiTokenPrediction.forward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

from meshtrain.cross_entropy import IGNORE_INDEX
from meshtrain.models.attention import DocumentMask
from meshtrain.models.registry import ModelConfig


class MTPModule(nn.Module):
    """Depth ``k`` of multi-token prediction (V3 report, Sec. 2.2, Eq. 21-23):
    ``h'_k = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]`` (``eh_proj`` (C, 2C) of ``enorm``'s embedding then
    ``hnorm``'s hidden state: the published checkpoint's order, as vLLM and Megatron-Core read it; Eq. 21 writes the
    two halves the other way round, which only permutes M_k's columns), then one decoder block (Eq. 22; ``make_block``
    builds the family's block of layer index ``n_layer + k - 1``, which decides dense or MoE, as in the checkpoint),
    then its own RMSNorm ``norm`` (``shared_head.norm``) before the shared output head (Eq. 23). The modules are
    registered in that order (the init's draws follow it)."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[], nn.Module]) -> None:
        super().__init__()
        C = cfg.n_embd
        self.enorm = nn.RMSNorm(C, eps=cfg.norm_eps)
        self.hnorm = nn.RMSNorm(C, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        self.block = make_block()
        self.norm = nn.RMSNorm(C, eps=cfg.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: DocumentMask | None = None) -> torch.Tensor:
        """``h`` (B, T, C): the previous depth's representation (the main model's after its final norm for k = 1);
        ``emb`` (B, T, C): ``Emb(t_{i+k})`` at position i -> this depth's representation (B, T, C), after ``norm``."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # (B, T, 2C) -> (B, T, C)
        return self.norm(self.block(x, cos, sin, mask=mask))


def embedding_copy(embedding: nn.Embedding) -> nn.Embedding:
    """A trainable ``nn.Embedding`` holding a copy of ``embedding``'s weight (V, C), on its device."""
    return nn.Embedding.from_pretrained(embedding.weight.detach().clone(), freeze=False)


class MultiTokenPrediction:
    """Multi-token prediction for a Llama-style model (DeepSeek-V3's, mixed in before
    :class:`meshtrain.models.llama.model.Llama`) that holds its D modules as ``mtp`` (an ``nn.ModuleList`` of
    :class:`MTPModule`; absent with D = 0 and on a pipeline rank without the head). A pipeline's last chunk of an
    untied model also holds ``mtp_embedding`` (an ``nn.Embedding``), the embedding its depths use: the stage's copy of
    ``tok_emb`` (module docstring). Both are looked up with ``getattr``: a class attribute would hide a submodule."""

    mtp_shards: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Set before a training forward and cleared by :meth:`mtp_loss`: depth k's ``(ahead, targets)`` of
    :meth:`mtp_sequences`, cut to this rank's tokens as its ids and targets are (under sequence parallelism
    (:class:`meshtrain.parallel.model.ReplicatedModel`): the shift crosses sp shards, so it is made on the whole window
    first, as the main loss's targets are; under a pipeline: :meth:`forward`'s ``mtp``, as the last stage has hidden
    states, not ids); None: the forward holds the whole window and shifts its own ids and targets."""
    mtp_logits: list[torch.Tensor] | None = None
    """The last training forward's multi-token predictions, read (and cleared) by :meth:`mtp_loss`."""
    mtp_own_embedding: bool = False
    """Set by :meth:`keep_only`: this pipeline rank also holds the first chunk (V placement), so the last chunk gets an
    embedding copy of its own."""

    def add_mtp(self, cfg: ModelConfig, make_block: Callable[[int], nn.Module]) -> None:
        """Build the D modules (``make_block(i)``: the family's block of layer index i) after the main model, so its
        weights are those of a model without them, then draw the modules' (``init_weights`` again: the same draws
        for the main model, then theirs). Nothing with D = 0."""
        if cfg.num_nextn_predict_layers:
            self.mtp = nn.ModuleList(MTPModule(cfg, lambda k=k: make_block(cfg.n_layer + k - 1))
                                     for k in range(1, cfg.num_nextn_predict_layers + 1))
            self.init_weights()

    @property
    def mtp_depths(self) -> int:
        """D, the configured depths (also on a pipeline rank that holds none of the modules)."""
        return self.cfg.num_nextn_predict_layers

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                mtp: torch.Tensor | None = None) -> torch.Tensor:
        """The Llama's forward; ``mtp`` (B, 2D, T) int64: a pipeline step's :meth:`mtp_sequences` of these samples,
        stacked ``[ahead_1, ..., ahead_D, targets_1, ..., targets_D]`` (this rank's sp shard of each), which a chunk
        holding the modules keeps in :attr:`mtp_shards` for :meth:`output` and :meth:`mtp_loss` (the others ignore it)."""
        if mtp is not None and getattr(self, "mtp", None) is not None:
            D = mtp.size(1) // 2
            self.mtp_shards = [(mtp[:, k], mtp[:, D + k]) for k in range(D)]  # (B, T) each
        return super().forward(idx, positions, doc_ids)

    def mtp_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``Emb(ids)`` (B, T) -> (B, T, C) with the weight the depths share: ``tok_emb``, a pipeline's last-stage copy
        of it (``mtp_embedding``), or a tied model's head copy of it there."""
        if self.tok_emb is not None:
            return self.tok_emb(ids)
        if (copy := getattr(self, "mtp_embedding", None)) is not None:
            return copy(ids)
        return F.embedding(ids, self.lm_head.weight)  # tied: the head's copy of the one weight

    def output(self, x: torch.Tensor, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: DocumentMask | None) -> torch.Tensor:
        """The main head's logits (B, T, V) (all that eval, ``generate`` and export see); in training with D depths,
        also runs the D modules in sequence (V3 report, Eq. 21-23) and keeps their logits for :meth:`mtp_loss`: depth
        k's (B, T-k, V), position i predicting ``t_{i+k+1}``, or (B, T, V) from :attr:`mtp_shards`. The positions whose
        ``t_{i+k}`` lies past the window embed token 0 instead; causal attention keeps them out of every kept
        position."""
        h = self.norm(x)  # (B, T, C): h^0, the main model's representation
        logits = self.lm_head(h)  # (B, T, V)
        modules = getattr(self, "mtp", None)  # a pipeline chunk without the head has none
        self.mtp_logits = None
        if modules is None or not modules.training:  # the modules' flag: a pipeline's eval() reaches them, not its chunks
            return logits
        shards = self.mtp_shards
        assert shards is not None or idx.dim() == 2, "multi-token prediction needs the token ids"
        T, self.mtp_logits = h.size(1), []
        for k, module in enumerate(modules, start=1):
            ahead = F.pad(idx[:, k:], (0, min(k, T))) if shards is None else shards[k - 1][0]  # (B, T): t_{i+k}
            h = module(h, self.mtp_embed(ahead), cos, sin, mask=mask)  # (B, T, C)
            self.mtp_logits.append(self.lm_head(h[:, :max(T - k, 0)] if shards is None else h))  # (B, T-k or T, V)
        return logits

    @staticmethod
    def mtp_sequences(idx: torch.Tensor, targets: torch.Tensor, depths: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Depth k's ``(ahead, targets)`` for k = 1..``depths`` of a whole window ``idx``, ``targets`` (B, T), both
        (B, T): the token ``t_{i+k}`` each position i embeds (token 0 past the window, as :meth:`output` pads) and the
        one it predicts, ``t_{i+k+1}`` = ``targets[:, i+k]`` (the ignore index past the window, so those positions,
        which :meth:`output` otherwise cuts off, add nothing). Causal attention keeps the padded positions out of every
        kept one, so a sequence-parallel rank's share of these gives its share of the whole window's loss."""
        T = idx.size(1)
        return [(F.pad(idx[:, k:], (0, min(k, T))), F.pad(targets[:, k:], (0, min(k, T)), value=IGNORE_INDEX))
                for k in range(1, depths + 1)]

    def mtp_loss(self, targets: torch.Tensor,
                 cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """``(lambda / D) * sum_k CE_k`` of the last training forward (V3 report, Eq. 24-25), CE_k summed (not averaged)
        over the positions whose target k steps further on is supervised, so that the caller divides it by the
        main loss's token count as the main loss (Eq. 24's 1/T); None without multi-token predictions (eval, D = 0).

        ``targets`` (B, T): the main loss's, position i holding ``t_{i+1}``; depth k's are ``targets[:, k:]`` (or
        :attr:`mtp_shards`' when set). ``cross_entropy(logits (B, T', V), targets (B, T'))``: the summed cross-entropy
        the caller uses for the main loss (it skips ignored targets). lambda is ``model.mtp_loss_weight``."""
        logits, self.mtp_logits = self.mtp_logits, None
        shards, self.mtp_shards = self.mtp_shards, None
        if not logits:
            return None
        if shards is not None:  # this rank's share (:meth:`mtp_sequences`)
            total = sum(cross_entropy(lk, shards[k][1]) for k, lk in enumerate(logits))
        else:
            total = sum(cross_entropy(lk, targets[:, k:]) for k, lk in enumerate(logits, start=1) if lk.size(1))
        return total * (self.cfg.mtp_loss_weight / self.cfg.num_nextn_predict_layers)

    def keep_only(self, layers: set[int], embedding: bool, head: bool) -> None:
        """:meth:`meshtrain.models.base.LayeredLM.keep_only`; the modules stay with the head only, and so does, for an
        untied model with them, ``tok_emb``: the last stage's copy of it (module docstring)."""
        modules = getattr(self, "mtp", None)
        copy = head and modules is not None and not self.ties_embeddings()
        super().keep_only(layers, embedding or copy, head)
        if modules is not None and not head:
            self.mtp = None
        self.mtp_own_embedding = copy and embedding

    def pipeline_chunk(self, layers: range, embedding: bool, head: bool):
        """:meth:`meshtrain.models.base.LayeredLM.pipeline_chunk`; the chunk with the head also gets the modules and,
        without ``tok_emb`` and untied, the embedding its depths use (``mtp_embedding``)."""
        chunk = super().pipeline_chunk(layers, embedding, head)
        modules = getattr(self, "mtp", None)
        if head and modules is not None:
            chunk.mtp = modules
            if not embedding and not self.ties_embeddings():
                chunk.mtp_embedding = embedding_copy(self.tok_emb) if self.mtp_own_embedding else self.tok_emb
        return chunk

    def mtp_tp_plan(self) -> dict:
        """The tensor-parallel plan's entry for ``mtp_embedding``: sharded by vocabulary as ``tok_emb`` is
        (:func:`meshtrain.models.tp_plan.tp_plan`), so that its gradient adds shard to shard with stage 0's; the modules
        themselves stay replicated (on the whole, replicated hidden state)."""
        if getattr(self, "mtp_embedding", None) is None:
            return {}
        return {"mtp_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
