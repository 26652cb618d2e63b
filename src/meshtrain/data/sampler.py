"""Deterministic, dp-sharded, resumable sampling of training windows, and a fixed validation set.

The stream. A sample is a window of ``block_size + 1`` consecutive tokens ``w``; the model reads
``x = w[:-1]`` and predicts ``y = w[1:]``. The training data is one infinite stream of samples made of
epochs. With ``N`` tokens and ``bs = block_size``, every epoch holds the same number of windows::

    num_samples = max(1, (N - bs) // bs)

and epoch ``e`` uses the window starts ``offset_e + k * bs`` for ``k`` in ``[0, num_samples)``, in the
order ``torch.randperm(num_samples)`` -- or, for data read from disk (a :class:`TokenSource`, possibly billions
of windows), :func:`feistel_permutation`, which orders any window without holding the permutation. ``offset_e`` is drawn uniformly from
``[0, min(bs, N - num_samples * bs))`` -- the whole ``[0, bs)`` whenever ``N >= 2 * bs`` -- so every
offset fits the same count and epochs differ in where windows are cut as well as in their order
(the tail of the text past the last window of an epoch is unused in that epoch). Offset and
permutation come from one ``torch.Generator`` seeded by ``(seed, e)``.

The state. The only state is the global stream position ``g`` = samples consumed by all ranks.
Optimizer step ``s`` consumes positions ``[g, g + G)`` with ``G = micro_batch_size * GA * dp``
(docs/architecture.md, ``global_batch_size``); position ``g + j`` goes to dp rank ``j // (mbs * GA)``, micro-step
``(j % (mbs * GA)) // mbs``, row ``j % mbs``. Steps cross epoch boundaries seamlessly. The state holds
no layout, so a run saved with one ``(dp, mbs, GA)`` resumes under another with the same ``G`` and
continues the same stream (same samples per step, split differently across ranks).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from meshtrain.data.conversations import Conversations, Pairs

STATE_VERSION = 1
_MIX_A, _MIX_B = 6364136223846793005, 1442695040888963407  # Knuth's MMIX LCG constants
_EVAL_STREAM = -1  # the "epoch" index whose generator draws the validation windows

Batch = tuple[torch.Tensor, ...]
"""A micro-batch ``(x, y)``, each (B, T) int64; prepared conversations packed with document masks add their
conversation ids ``(x, y, doc_ids)`` (:meth:`meshtrain.data.conversations.Conversations.samples`)."""


@runtime_checkable
class TokenSource(Protocol):
    """Token ids too large to hold in memory (a prepared dataset's memory-mapped shards,
    :mod:`meshtrain.data.shards`): their count and windows read on demand. A sampler over a TokenSource
    reads ``n * (block_size + 1)`` tokens per call, never the whole corpus."""

    def __len__(self) -> int:
        """N, the number of tokens."""

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """The windows ``[s, s + length)`` for each of ``starts`` (n,) int64: (n, length) int64."""


Tokens = torch.Tensor | TokenSource
"""A split's token ids: a 1-D int64 tensor in memory, or a :class:`TokenSource`."""


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator seeded by mixing ``(seed, stream)`` into one 63-bit integer."""
    return torch.Generator().manual_seed((seed * _MIX_A + (stream + 2) * _MIX_B) % 2**63)


def _check_layout(block_size: int, micro_batch_size: int, dp: int, dp_rank: int) -> None:
    for name, value in (("block_size", block_size), ("micro_batch_size", micro_batch_size), ("dp", dp)):
        if value < 1:
            raise ValueError(f"{name} = {value} must be >= 1")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp = {dp})")


def _check_data(data: Tokens, block_size: int, what: str) -> None:
    if isinstance(data, Conversations):
        return  # its windows are whole conversations: at least one
    if (isinstance(data, torch.Tensor) and data.dim() != 1) or len(data) < block_size + 1:
        shape = tuple(data.shape) if isinstance(data, torch.Tensor) else (len(data),)
        raise ValueError(f"{what} data must be 1-D with >= block_size + 1 = {block_size + 1} tokens, "
                         f"got shape {shape}")


def _windows(data: Tokens, starts: torch.Tensor, block_size: int, rows: int) -> list[Batch]:
    """Cut windows at ``starts`` (n,) and group them into micro-batches of ``rows``: [(x, y)], each (rows, T).
    Prepared conversations: ``starts`` are sample indices, and packed ones add the conversation ids."""
    if isinstance(data, Pairs):  # two rows a pair: (x, y, None, reference), each (2 * rows, T) or (2 * rows,)
        x, y, _, reference = data.samples(starts)
        return [(a, b, None, r) for a, b, r in zip(x.split(2 * rows), y.split(2 * rows), reference.split(2 * rows))]
    if isinstance(data, Conversations):
        x, y, doc_ids = data.samples(starts)  # (n, T) each
        parts = (x, y) if data.packing == "pad" else (x, y, doc_ids)  # padding alone needs no document mask
        return list(zip(*(t.split(rows) for t in parts)))
    if isinstance(data, torch.Tensor):
        w = data[starts[:, None] + torch.arange(block_size + 1)]  # (n, T + 1)
    else:
        w = data.gather(starts, block_size + 1)  # (n, T + 1), read from the shards
    x, y = w[:, :-1], w[:, 1:]  # (n, T) each
    return list(zip(x.split(rows), y.split(rows)))


_FEISTEL_ROUNDS = 4
_FEISTEL_MUL = 0x2545F491  # an odd 30-bit multiplier: R * it stays below 2**62 for R < 2**32


def feistel_permutation(index: torch.Tensor, n: int, key: int) -> torch.Tensor:
    """The images of ``index`` (m,) int64 in ``[0, n)`` under a pseudo-random permutation of ``[0, n)`` keyed by
    ``key``: (m,) int64, computed per element in O(m) memory, however large ``n``.

    A balanced Feistel network (Luby & Rackoff 1988: any round function gives a bijection) on the smallest
    ``2**(2h) >= n``, with ``_FEISTEL_ROUNDS`` rounds of a multiply-xorshift round function of ``h`` bits keyed
    by ``key``; values landing in ``[n, 2**(2h))`` are encrypted again until they fall inside (cycle walking,
    Black & Rogaway 2002, Sec. 2), which keeps it a bijection of ``[0, n)``. Expected walks < 4 (the domain is
    < 4n)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [(key >> (15 * r)) & 0x7FFF_FFFF for r in range(_FEISTEL_ROUNDS)]

    def encrypt(v: torch.Tensor) -> torch.Tensor:
        left, right = v >> half, v & mask
        for k in keys:
            f = ((right ^ k) * _FEISTEL_MUL) & 0xFFFF_FFFF_FFFF
            f = (f ^ (f >> 17)) & mask
            left, right = right, left ^ f
        return (left << half) | right

    out = encrypt(index)
    outside = out >= n
    while bool(outside.any()):
        out[outside] = encrypt(out[outside])
        outside = out >= n
    return out


class ShardedSampler:
    """This dp rank's share of the global sample stream, one optimizer step at a time (see module doc).

    Args:
        data: (N,) int64 token ids of the train split, N >= block_size + 1, in memory or a
            :class:`TokenSource` (read a window at a time).
        block_size: T, tokens per sample input.
        micro_batch_size, gradient_accumulation_steps, dp, dp_rank: the batch layout (docs/architecture.md terms).
        seed: the data-order seed (``train.seed``).

    Raises:
        ValueError: a non-positive size, ``dp_rank`` outside ``[0, dp)``, or data shorter than a window.
    """

    def __init__(self, data: Tokens, block_size: int, micro_batch_size: int,
                 gradient_accumulation_steps: int, dp: int, dp_rank: int, seed: int) -> None:
        _check_layout(block_size, micro_batch_size, dp, dp_rank)
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps = {gradient_accumulation_steps} must be >= 1")
        _check_data(data, block_size, "train")
        self.data = data
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.samples_seen = 0
        if isinstance(data, Conversations):  # a sample is a window of whole conversations: index them, no offset
            self._num_samples, self._offsets, self._stride = len(data), 1, 1
        else:
            self._num_samples = max(1, (len(data) - block_size) // block_size)
            self._offsets = min(block_size, len(data) - self._num_samples * block_size)
            self._stride = block_size
        self._starts: dict[int, torch.Tensor] = {}

    @property
    def num_samples(self) -> int:
        """Windows per epoch, ``max(1, (N - block_size) // block_size)``, the same for every epoch."""
        return self._num_samples

    @property
    def global_batch_size(self) -> int:
        """G = micro_batch_size * gradient_accumulation_steps * dp, samples per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp

    @property
    def epoch(self) -> float:
        """Epochs consumed so far, ``samples_seen / num_samples`` (fractional)."""
        return self.samples_seen / self._num_samples

    def epoch_starts(self, epoch: int) -> torch.Tensor:
        """Window start indices of ``epoch`` in stream order, (num_samples,) int64; cached (2 epochs).
        In-memory data only: a :class:`TokenSource` permutes on the fly (:meth:`window_starts`)."""
        if epoch not in self._starts:
            gen = _generator(self.seed, epoch)
            offset = int(torch.randint(self._offsets, (), generator=gen))
            perm = torch.randperm(self._num_samples, generator=gen)  # (num_samples,)
            self._starts = {e: s for e, s in self._starts.items() if e == epoch - 1}
            self._starts[epoch] = offset + perm * self.block_size
        return self._starts[epoch]

    def window_starts(self, epoch: int, k: int, take: int) -> torch.Tensor:
        """Starts of windows ``k .. k + take`` of ``epoch`` in stream order: (take,) int64.

        In-memory data: a slice of :meth:`epoch_starts` (``torch.randperm``). A :class:`TokenSource`, whose
        ``num_samples`` may be billions, draws its order from :func:`feistel_permutation` instead, so memory
        stays O(take) whatever the corpus size; the offset comes from the same generator."""
        if isinstance(self.data, torch.Tensor):
            return self.epoch_starts(epoch)[k:k + take]
        gen = _generator(self.seed, epoch)
        offset = int(torch.randint(self._offsets, (), generator=gen))
        key = int(torch.randint(0, 2**62, (), generator=gen))
        order = feistel_permutation(torch.arange(k, k + take), self._num_samples, key)  # (take,)
        return offset + order * self._stride

    def stream_starts(self, begin: int, end: int) -> torch.Tensor:
        """Window starts of global stream positions ``[begin, end)``, crossing epochs: (end - begin,)."""
        parts = []
        while begin < end:
            epoch, k = divmod(begin, self._num_samples)
            take = min(end - begin, self._num_samples - k)
            parts.append(self.window_starts(epoch, k, take))
            begin += take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def next_step(self) -> list[Batch]:
        """This rank's ``GA`` micro-batches ``[(x, y)]`` of the next step, each (micro_batch_size, T) int64.

        Advances ``samples_seen`` by the global batch size (every rank advances the same).
        """
        per_rank = self.micro_batch_size * self.gradient_accumulation_steps
        begin = self.samples_seen + self.dp_rank * per_rank
        starts = self.stream_starts(begin, begin + per_rank)  # (mbs * GA,)
        self.samples_seen += self.global_batch_size
        return _windows(self.data, starts, self.block_size, self.micro_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able, layout-free state: ``{"version", "samples_seen", "seed", "num_samples"}``."""
        return {"version": STATE_VERSION, "samples_seen": self.samples_seen, "seed": self.seed,
                "num_samples": self._num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream at ``state["samples_seen"]``; any ``(dp, mbs, GA)`` layout may load it.

        Raises:
            ValueError: unknown version, a different seed, or a train split of another size.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not supported: "
                             f"expected {STATE_VERSION}")
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state was saved with seed {state['seed']} but this run has seed "
                             f"{self.seed}: resume with train.seed = {state['seed']}")
        if state.get("num_samples", self._num_samples) != self._num_samples:
            raise ValueError(f"sampler state was saved for {state['num_samples']} windows per epoch but this "
                             f"train split has {self._num_samples}: resume with the same data.path, "
                             f"data.val_fraction and model.block_size")
        self.samples_seen = int(state["samples_seen"])


def eval_batches(data: Tokens, block_size: int, micro_batch_size: int, eval_steps: int,
                 dp: int, dp_rank: int, seed: int) -> list[Batch]:
    """This rank's share of a fixed validation set: ``eval_steps`` micro-batches ``[(x, y)]``, each (mbs, T).

    The set is ``eval_steps * micro_batch_size * dp`` windows whose starts are drawn uniformly (with
    replacement, as nanoGPT's ``estimate_loss``) from ``[0, N - block_size)`` by a generator seeded from
    ``seed`` alone, so it never depends on training progress. Rank ``r`` takes the ``r``-th contiguous
    block of ``eval_steps * mbs`` windows: the union over ranks is the same set for any dp with the
    same global count.

    Raises:
        ValueError: a non-positive size, ``dp_rank`` outside ``[0, dp)``, or data shorter than a window.
    """
    _check_layout(block_size, micro_batch_size, dp, dp_rank)
    if eval_steps < 1:
        raise ValueError(f"eval_steps = {eval_steps} must be >= 1")
    _check_data(data, block_size, "val")
    per_rank = eval_steps * micro_batch_size
    gen = _generator(seed, _EVAL_STREAM)
    choices = len(data) if isinstance(data, Conversations) else len(data) - block_size  # samples, or window starts
    starts = torch.randint(choices, (per_rank * dp,), generator=gen)  # (G_eval,)
    mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # (eval_steps * mbs,)
    return _windows(data, mine, block_size, micro_batch_size)
