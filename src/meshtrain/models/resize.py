"""The new rows of a grown vocabulary (:mod:`meshtrain.data.growth`), as ``transformers``' ``resize_token_embeddings``
makes them by default (``mean_resizing=True``; ``PreTrainedModel._init_added_embeddings_weights_with_mean``, and
``_init_added_lm_head_weights_with_mean`` for an untied head, which is the same on the head's own rows; Hewitt 2021,
"Initializing new word embeddings for pretrained language models"): with ``W`` the checkpoint's ``V`` rows (V, C),
``mu = mean(W)`` and ``S = (W - mu)^T (W - mu) / V``, the ``n`` new rows are ``n`` draws of N(mu, 1e-9 S) -- where
``1e-9 S`` is positive definite (its Cholesky factorisation succeeds), else ``mu`` each.

What is matched, and how. ``transformers`` draws with ``MultivariateNormal(mu, covariance_matrix=1e-9 S).sample``
from the global RNG: ``eps`` (n, C) standard normals, then ``mu + L eps`` with ``L = cholesky(1e-9 S)``. Here the
same ``eps`` comes from a ``torch.Generator`` seeded with ``train.seed`` (``torch.randn`` with a generator draws what
``normal_`` draws from the global one after ``torch.manual_seed``), and ``mu + L eps`` is computed by the same
operations, so after ``torch.manual_seed(seed)``, ``model.resize_token_embeddings(new)`` gives these rows. An untied
head's draw follows the embedding's in the same stream, as ``transformers`` resizes the embedding first; a tied head
is the embedding. ``mu`` and ``S`` are summed over the file's rows in float64, a block of rows at a time (memory
``C^2``, never the whole matrix), and rounded to float32, the dtype ``transformers`` computes them in: every rank of
every layout reads the same rows in the same order, so every rank computes the same statistics, and they differ from
``transformers``' float32 ones by float32 rounding only. Each rank computes the ``n`` new rows whole (``n`` is at most
``128 * tp`` rows) and copies the part it holds.
"""

from __future__ import annotations

from typing import Callable

import torch

EPSILON = 1e-9
"""``transformers``' scale of the old rows' covariance."""
GROWN = ("tok_emb.weight", "lm_head.weight")
"""The parameters whose rows are token ids: the input embedding and the output head."""
BLOCK_ROWS = 8192
"""Rows read from the file at a time while summing the statistics."""


def row_statistics(read: Callable[[int, int], torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean (C,), covariance (C, C)) of the ``rows`` rows ``read(r0, r1)`` returns (rows ``r0:r1``, (r1 - r0, C)),
    summed in float64 one block of :data:`BLOCK_ROWS` at a time, returned in float32."""
    total = square = None
    for r0 in range(0, rows, BLOCK_ROWS):
        block = read(r0, min(rows, r0 + BLOCK_ROWS)).to(torch.float64)  # (b, C)
        total = block.sum(0) if total is None else total + block.sum(0)
        square = block.T @ block if square is None else square + block.T @ block
    mean = total / rows  # (C,)
    covariance = (square - rows * torch.outer(mean, mean)) / rows  # (C, C): sum (x - mu)(x - mu)^T / V
    return mean.to(torch.float32), covariance.to(torch.float32)


def drawable(covariance: torch.Tensor) -> bool:
    """Whether ``transformers`` draws the new rows from this covariance: ``1e-9 cov`` positive definite
    (``torch.distributions.constraints.positive_definite``, the check it makes); else they are the mean."""
    from torch.distributions import constraints

    return bool(constraints.positive_definite.check(EPSILON * covariance).all())


def added_rows(mean: torch.Tensor, covariance: torch.Tensor, n: int, seed: int, skip: int = 0) -> torch.Tensor:
    """The ``n`` new rows (n, C) float32: ``transformers``' draw from N(mean, 1e-9 cov) with a generator seeded
    ``seed`` after ``skip`` earlier draws of (n, C) from it (an untied head: 1 where the embedding's rows were drawn),
    or ``mean`` in every row where that covariance is not :func:`drawable`."""
    if not drawable(covariance):
        return mean[None, :].repeat(n, 1)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(skip + 1):
        eps = torch.randn((n, mean.numel()), generator=generator)  # (n, C)
    scale_tril = torch.linalg.cholesky(EPSILON * covariance)  # (C, C), as MultivariateNormal(covariance_matrix=) does
    return mean + torch.matmul(scale_tril, eps.unsqueeze(-1)).squeeze(-1)  # (n, C)


class GrownRows:
    """The rows of a grown embedding and head for :func:`meshtrain.models.hf.load_hf_weights`: the checkpoint's where
    it has them, the new ones (:func:`added_rows`) past them. ``read(name, r0, r1)``: rows ``r0:r1`` of the checkpoint
    tensor ``name``, set by the loader while its files are open."""

    def __init__(self, old: int, new: int, seed: int) -> None:
        self.old, self.new, self.seed = old, new, seed
        self.read: Callable[[str, int, int], torch.Tensor] | None = None
        self._stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[str, torch.Tensor] = {}
        self.embedding = ""
        """The checkpoint's name of the input embedding, whose draw an untied head's follows."""

    def stats(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self._stats:
            self._stats[name] = row_statistics(lambda r0, r1: self.read(name, r0, r1), self.old)
        return self._stats[name]

    @property
    def sampled(self) -> bool | None:
        """Whether the embedding's new rows were drawn (else: the mean); None where this rank read no part of it."""
        return drawable(self._stats[self.embedding][1]) if self.embedding in self._stats else None

    def rows(self, name: str) -> torch.Tensor:
        """The new rows (new - old, C) of checkpoint tensor ``name``: an untied head's drawn after the embedding's."""
        if name not in self._rows:
            skip = 0 if name == self.embedding else int(drawable(self.stats(self.embedding)[1]))
            self._rows[name] = added_rows(*self.stats(name), self.new - self.old, self.seed, skip)
        return self._rows[name]

    def fill(self, local: torch.Tensor, offset: tuple[int, ...], name: str,
             read_block: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]) -> int:
        """Fill ``local`` (this rank's block (rows, cols) at ``offset`` of the grown tensor): rows below ``old`` by
        ``read_block(offset, shape)``, the rest from :meth:`rows`. Returns the elements read from the checkpoint."""
        r0, c0 = offset
        rows, cols = local.shape
        keep = max(0, min(rows, self.old - r0))
        if keep:
            local[:keep].copy_(read_block(offset, (keep, cols)))
        self.stats(name)  # every rank holding part of it knows how its rows were made
        if keep < rows:
            start = r0 + keep - self.old
            local[keep:].copy_(self.rows(name)[start:start + rows - keep, c0:c0 + cols])
        return keep * cols
