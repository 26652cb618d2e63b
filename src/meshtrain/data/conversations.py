"""Prepared conversations as training samples: whole conversations packed into windows, or one per sample.

A split of ``meshtrain prepare --format chat|prompt-completion`` (docs/posttraining.md) is a token stream, a loss
mask beside it (1 where a token is supervised: an assistant turn, or a completion) and the start of every
conversation. The windows of plain text (:mod:`meshtrain.data.sampler`) cut the stream every ``block_size``
tokens, which would cut conversations in the middle of a turn and train an answer without its question. Here a
sample is made of whole conversations instead:

- ``data.packing = "document"``: consecutive conversations are packed greedily, in order, into windows of
  ``block_size + 1`` tokens (the next one starts a new window when it does not fit); each keeps its own positions
  from 0 and attends only to itself (the block-diagonal mask of :mod:`meshtrain.data.packing`, Krell et al. 2021,
  arXiv:2107.02027, Sec. 3). Nothing of a conversation is ever in two windows.
- ``data.packing = "pad"``: one conversation per sample, the rest of the window padding.

A conversation longer than the window (``block_size + 1`` tokens) keeps its first ``block_size + 1`` tokens, alone
in its window: the tail is cut, never the middle (:attr:`Conversations.truncated` counts them; the trainer says so
before the first step).

The targets. ``x = w[:-1]`` and ``y = w[1:]`` as for text, then ``y`` is set to :data:`IGNORE_INDEX` wherever the
target token is not supervised, wherever it belongs to another conversation than its input (the first token of the
next one), and over the padding, so the loss is the cross-entropy over supervised tokens only (PyTorch's
``ignore_index``, the ``-100`` of transformers' labels).
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
"""Target of a token that is not in the loss (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""
PACKINGS = ("document", "pad")
"""``data.packing`` values that prepared conversations take."""

Windows = np.ndarray
"""(W, 2) int64: the first conversation of each window and the one after its last."""


def pack_windows(lengths: np.ndarray, length: int, packing: str) -> Windows:
    """Which conversations each sample holds: ``lengths`` (D,) tokens of each conversation in order, ``length``
    tokens per window (``block_size + 1``) -> :data:`Windows` (W, 2).

    "pad": one conversation each, W = D. "document": greedy next-fit in order (a window takes conversations while
    their tokens fit; a conversation longer than ``length`` fills a window alone and is cut there).
    O(D) time in a Python loop over the conversations (~1 s per million)."""
    if packing == "pad":
        first = np.arange(len(lengths), dtype=np.int64)
        return np.stack([first, first + 1], axis=1)
    firsts, used = [], length  # "used = length": the first conversation opens a window
    for d, n in enumerate(lengths.tolist()):
        if used + n > length:
            firsts.append(d)
            used = 0
        used += n
    bounds = np.array(firsts + [len(lengths)], dtype=np.int64)
    return np.stack([bounds[:-1], bounds[1:]], axis=1)


class Conversations:
    """One split of prepared conversations read as samples of ``block_size`` inputs and targets.

    Args:
        tokens: the split's token ids: (N,) int64 tensor, or a :class:`meshtrain.data.sampler.TokenSource`.
        masks: the loss mask of each token, (N,) uint8/bool tensor or a source like ``tokens`` (1 = supervised).
        starts: (D,) int64 token offset of each conversation's first token, increasing, ``starts[0] == 0``.
        block_size: T, inputs per sample.
        packing: "document" or "pad" (module docstring).
        pad_id: the input token id of the padding (never a target; the model sees it after the real tokens only).

    Raises:
        ValueError: ``packing`` not one of :data:`PACKINGS`, or ``starts`` that do not index ``tokens``.
    """

    def __init__(self, tokens, masks, starts: np.ndarray, block_size: int, packing: str, pad_id: int = 0) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing = {packing!r}: prepared conversations take one of {', '.join(PACKINGS)}")
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= len(tokens):
            raise ValueError(f"conversation starts must increase from 0 and stay below the {len(tokens)} tokens")
        self.tokens, self.masks, self.block_size, self.packing, self.pad_id = tokens, masks, block_size, packing, pad_id
        self.starts = np.append(starts, len(tokens))  # (D + 1,): each conversation's start, then the end
        lengths = np.diff(self.starts)  # (D,)
        self.windows = pack_windows(lengths, block_size + 1, packing)
        self.truncated = int((lengths > block_size + 1).sum())
        """Conversations longer than a window, whose tail is cut."""

    def __len__(self) -> int:
        """W, the number of samples (windows)."""
        return len(self.windows)

    @property
    def conversations(self) -> int:
        return len(self.starts) - 1

    def samples(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples ``index`` (n,) int64 in ``[0, len(self))`` -> ``(x, y, doc_ids)``, each (n, T) int64: inputs, targets
        (:data:`IGNORE_INDEX` where not in the loss) and the conversation index of each input inside its window
        (0, 1, ...; the padding one more than the last), which document masking and positions are built from."""
        n, T = len(index), self.block_size
        w = torch.full((n, T + 1), self.pad_id, dtype=torch.long)  # (n, T + 1) tokens of each window
        keep = torch.zeros((n, T + 1), dtype=torch.bool)  # (n, T + 1) supervised
        doc = torch.zeros((n, T + 1), dtype=torch.long)  # (n, T + 1) conversation in the window
        for row, k in enumerate(index.tolist()):
            first, end = self.windows[k]
            lo, hi = int(self.starts[first]), min(int(self.starts[end]), int(self.starts[first]) + T + 1)
            starts = torch.from_numpy(self.starts[first:end] - lo)  # (docs,) offsets inside the window
            w[row, :hi - lo] = _read(self.tokens, lo, hi - lo)
            keep[row, :hi - lo] = _read(self.masks, lo, hi - lo).bool()
            used = torch.arange(T + 1)
            doc[row] = torch.searchsorted(starts, used, right=True) - 1  # padding: past the last start...
            doc[row, hi - lo:] = len(starts)  # ...gets an index of its own
        same = doc[:, 1:] == doc[:, :-1]  # (n, T): the target belongs to the input's conversation
        y = torch.where(keep[:, 1:] & same, w[:, 1:], torch.full_like(w[:, 1:], IGNORE_INDEX))
        return w[:, :-1], y, doc[:, :-1]


def _read(source, start: int, length: int) -> torch.Tensor:
    """(length,) of ``source`` from ``start``: a slice of a tensor, or one window of a token source."""
    if isinstance(source, torch.Tensor):
        return source[start:start + length].long()
    return source.gather(torch.tensor([start]), length)[0]


class Pairs(Conversations):
    """Preference pairs (``meshtrain prepare --format preference``): conversation ``2k`` is pair k's chosen sequence
    (prompt + chosen), ``2k + 1`` its rejected one, each masked to its completion. A sample is a pair: two padded
    rows, chosen then rejected, so a pair never splits across ranks or micro-batches.

    :attr:`reference` holds the reference model's log-probability of every sequence once the trainer computed it
    (:meth:`meshtrain.train.loop.Trainer`), and :meth:`samples` hands each row's with it.

    Raises:
        ValueError: an odd number of conversations (a pair cut in half), or what :class:`Conversations` raises.
    """

    rows_per_sample = 2

    def __init__(self, tokens, masks, starts: np.ndarray, block_size: int, pad_id: int = 0) -> None:
        super().__init__(tokens, masks, starts, block_size, "pad", pad_id)
        if self.conversations % 2:
            raise ValueError(f"{self.conversations} sequences do not make pairs: a pair is two (chosen, rejected)")
        self.reference: torch.Tensor | None = None
        """(2P,) float64: the reference's log-probability of each sequence (nats), or None before it is computed."""

    def __len__(self) -> int:
        """P, the number of pairs."""
        return self.conversations // 2

    def samples(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
        """Pairs ``index`` (n,) -> ``(x, y, None, reference)``: (2n, T) inputs and targets, rows chosen, rejected,
        chosen, ...; no document ids (one sequence per row); (2n,) float64 reference log-probabilities (zeros
        before :attr:`reference` is set)."""
        rows = torch.stack([2 * index, 2 * index + 1], dim=1).flatten()  # (2n,)
        x, y, _ = super().samples(rows)
        reference = self.reference[rows] if self.reference is not None else torch.zeros(len(rows), dtype=torch.float64)
        return x, y, None, reference
