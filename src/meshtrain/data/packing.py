"""Document packing (``data.packing``): which document each token of a window belongs to, and its position in it.

The sampler cuts windows of ``block_size`` tokens out of one stream in which documents follow each other,
an EOS token after each (nanoGPT, Megatron-LM). With ``data.packing = "concat"`` (the default) a window is
one sequence: positions 0..T-1 and a causal mask across document boundaries. With ``"document"`` each
document in a window is a sequence of its own: its positions restart at 0 and its tokens attend only to
earlier tokens of the same document, a block-diagonal causal mask (Krell et al. 2021, "Efficient Sequence
Packing without Cross-contamination", arXiv:2107.02027, Sec. 3; Llama 3, Dubey et al. 2024,
arXiv:2407.21783, Sec. 3.2: "an attention mask that prevents self-attention between different documents
within the same sequence"). The mask itself is built by the model
(:func:`meshtrain.models.attention.document_causal_mask`); this module computes, from the token ids alone, what it
is built from.

A document ends *after* each EOS token: the EOS is the last token of its document (its target, the next
document's first token, is still trained on, so the loss is the same mean over every token of the window
as with "concat"). A window starting inside a document sees that document's rest as a document of its own,
from position 0.
"""

from __future__ import annotations

import torch


def document_ids(idx: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document index of every token of ``idx`` (B, T) int64 token ids: (B, T) int64, the number of EOS
    tokens (``eos_id``) strictly before each position of its row; 0 for the first document of each window,
    non-decreasing along T."""
    is_eos = (idx == eos_id).long()  # (B, T)
    return is_eos.cumsum(dim=1) - is_eos  # (B, T): EOS tokens before each position


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """The position of every token inside its document: ``doc_ids`` (B, T) from :func:`document_ids` ->
    (B, T) int64, 0 at the first token of each document (where the document index changes, and at t = 0)."""
    T = doc_ids.size(1)
    t = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)  # (B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T): a document starts here
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values  # (B, T): start of each token's document
    return t - first


def pack_documents(idx: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_ids, positions)`` of the windows ``idx`` (B, T), each (B, T) int64 (:func:`document_ids`,
    :func:`document_positions`). Call it on whole windows, before a sequence-parallel rank cuts out its
    tokens: a document may start on another rank's shard."""
    doc_ids = document_ids(idx, eos_id)
    return doc_ids, document_positions(doc_ids)
