"""Cross-entropy over chunks of tokens: the loss never holds the whole (tokens x vocabulary) logits in fp32.

``F.cross_entropy(logits.float())`` keeps the fp32 log-softmax of every token for its backward and writes two more
fp32 (N, V) tensors in it (the gradients of the log-softmax and of the logits): 12 bytes per logit beside the logits
themselves, which for a long sequence or a large vocabulary is the largest tensor of the step. :func:`token_nll`
computes each chunk of ``chunk_tokens`` rows in fp32, keeps only the logits (in their own dtype) and one fp32
log-sum-exp per token, and recomputes each chunk's softmax in backward (the recompute-per-chunk scheme of
chunked/"cut" cross-entropy losses; Wijmans et al. 2025, "Cut Your Losses in Large-Vocabulary Language Models",
Sec. 3, applied after the head). Per token the arithmetic is the textbook one:

    nll_i = lse_i - z_{i, y_i},   lse_i = log sum_v exp(z_{i, v}),
    d nll_i / d z_{i, v} = softmax(z_i)_v - [v = y_i]

(Goodfellow et al. 2016, "Deep Learning", Sec. 6.2.2.3), so the result equals ``F.cross_entropy(...,
reduction="none")`` up to fp32 rounding of the same terms (``tests/test_chunked_loss.py`` derives the bound).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""A target outside the loss (not supervised: a prompt's token, padding); ``F.cross_entropy``'s default, and the
``-100`` of transformers' labels (:data:`meshtrain.data.conversations.IGNORE_INDEX`). :mod:`meshtrain.parallel.reduce`
exports it."""

DEFAULT_CHUNK_MB = 64
"""``train.loss_chunk_mb``'s default: fp32 MiB of logits one chunk computes at once."""


def chunk_rows(vocab: int, chunk_mb: float) -> int:
    """Tokens per chunk: as many rows of ``vocab`` fp32 logits as fit in ``chunk_mb`` MiB, at least 1; 0 when
    ``chunk_mb`` is 0 (no chunking)."""
    if chunk_mb <= 0:
        return 0
    return max(1, int(chunk_mb * 2**20) // (4 * max(vocab, 1)))


class _ChunkedNLL(torch.autograd.Function):
    """``(N, V)`` logits, ``(N,)`` targets -> ``(N,)`` fp32 negative log-likelihoods (0 where the target is
    :data:`IGNORE_INDEX`), chunk by chunk; saves the logits, the targets and ``(N,)`` fp32 log-sum-exps."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        n = logits.size(0)
        nll = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):
            z = logits[start:start + rows].float()  # (c, V) fp32: the only full-width temporary
            t = targets[start:start + rows]
            lse[start:start + rows] = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)  # (c,)
            nll[start:start + rows] = torch.where(t != IGNORE_INDEX, lse[start:start + rows] - picked, 0.0)
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows = rows
        return nll

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        rows = ctx.rows
        out = torch.empty_like(logits)
        for start in range(0, logits.size(0), rows):
            t = targets[start:start + rows]
            g = torch.where(t != IGNORE_INDEX, grad[start:start + rows].float(), 0.0)  # (c,)
            p = (logits[start:start + rows].float() - lse[start:start + rows, None]).exp_()  # softmax, (c, V)
            p.mul_(g[:, None])
            p.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -g.unsqueeze(1))  # - [v = y] g
            out[start:start + rows] = p
            del p  # before the next chunk's is allocated: one chunk's temporaries at a time
        return out, None, None


def token_nll(logits: torch.Tensor, targets: torch.Tensor, chunk_mb: float = DEFAULT_CHUNK_MB) -> torch.Tensor:
    """Each token's cross-entropy: logits (..., V) (any float dtype) and targets (...) -> (N,) float32 nats for the
    N flattened tokens, 0 where the target is :data:`IGNORE_INDEX` (``F.cross_entropy(logits.float().flatten(0, -2),
    targets.flatten(), reduction="none")``), computed ``chunk_rows(V, chunk_mb)`` tokens at a time so that at most one
    chunk's logits exist in fp32, forward and backward. The gradient it sends back has the logits' dtype.
    ``chunk_mb = 0`` or a plain chunk holding every token: one chunk (still no fp32 copy kept for backward)."""
    flat = logits.reshape(-1, logits.size(-1))
    rows = chunk_rows(flat.size(1), chunk_mb) or flat.size(0)
    return _ChunkedNLL.apply(flat, targets.reshape(-1), max(rows, 1))
