"""Deterministic, dp-sharded, resumable sampling of training windows, and a fixed validation set.

The stream. A sample is a window of ``block_size + 1`` consecutive tokens ``w``; the model reads
``x = w[:-1]`` and predicts ``y = w[1:]``. The training data is one infinite stream of samples made of
epochs. With ``N`` tokens and ``bs = block_size``, every epoch holds the same number of windows::

    num_samples = max(1, (N - bs) // bs)

and epoch ``e`` uses the window starts ``offset_e + k * bs`` for ``k`` in ``[0, num_samples)``, in the
order ``torch.randperm(num_samples)``. ``offset_e`` is drawn uniformly from
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

from typing import Any

import torch

STATE_VERSION = 1
_MIX_A, _MIX_B = 6364136223846793005, 1442695040888963407  # Knuth's MMIX LCG constants
_EVAL_STREAM = -1  # the "epoch" index whose generator draws the validation windows

Batch = tuple[torch.Tensor, torch.Tensor]


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator seeded by mixing ``(seed, stream)`` into one 63-bit integer."""
    return torch.Generator().manual_seed((seed * _MIX_A + (stream + 2) * _MIX_B) % 2**63)


def _check_layout(block_size: int, micro_batch_size: int, dp: int, dp_rank: int) -> None:
    for name, value in (("block_size", block_size), ("micro_batch_size", micro_batch_size), ("dp", dp)):
        if value < 1:
            raise ValueError(f"{name} = {value} must be >= 1")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank = {dp_rank} must be in [0, dp = {dp})")


def _check_data(data: torch.Tensor, block_size: int, what: str) -> None:
    if data.dim() != 1 or len(data) < block_size + 1:
        raise ValueError(f"{what} data must be 1-D with >= block_size + 1 = {block_size + 1} tokens, "
                         f"got shape {tuple(data.shape)}")


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int, rows: int) -> list[Batch]:
    """Cut windows at ``starts`` (n,) and group them into micro-batches of ``rows``: [(x, y)], each (rows, T)."""
    idx = starts[:, None] + torch.arange(block_size + 1)  # (n, T + 1)
    w = data[idx]  # (n, T + 1)
    x, y = w[:, :-1], w[:, 1:]  # (n, T) each
    return list(zip(x.split(rows), y.split(rows)))


class ShardedSampler:
    """This dp rank's share of the global sample stream, one optimizer step at a time (see module doc).

    Args:
        data: (N,) int64 token ids of the train split, N >= block_size + 1.
        block_size: T, tokens per sample input.
        micro_batch_size, gradient_accumulation_steps, dp, dp_rank: the batch layout (docs/architecture.md terms).
        seed: the data-order seed (``train.seed``).

    Raises:
        ValueError: a non-positive size, ``dp_rank`` outside ``[0, dp)``, or data shorter than a window.
    """

    def __init__(self, data: torch.Tensor, block_size: int, micro_batch_size: int,
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
        self._num_samples = max(1, (len(data) - block_size) // block_size)
        self._offsets = min(block_size, len(data) - self._num_samples * block_size)
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
        """Window start indices of ``epoch`` in stream order, (num_samples,) int64; cached (2 epochs)."""
        if epoch not in self._starts:
            gen = _generator(self.seed, epoch)
            offset = int(torch.randint(self._offsets, (), generator=gen))
            perm = torch.randperm(self._num_samples, generator=gen)  # (num_samples,)
            self._starts = {e: s for e, s in self._starts.items() if e == epoch - 1}
            self._starts[epoch] = offset + perm * self.block_size
        return self._starts[epoch]

    def stream_starts(self, begin: int, end: int) -> torch.Tensor:
        """Window starts of global stream positions ``[begin, end)``, crossing epochs: (end - begin,)."""
        parts = []
        while begin < end:
            epoch, k = divmod(begin, self._num_samples)
            take = min(end - begin, self._num_samples - k)
            parts.append(self.epoch_starts(epoch)[k:k + take])
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


def eval_batches(data: torch.Tensor, block_size: int, micro_batch_size: int, eval_steps: int,
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
    starts = torch.randint(len(data) - block_size, (per_rank * dp,), generator=gen)  # (G_eval,)
    mine = starts[dp_rank * per_rank:(dp_rank + 1) * per_rank]  # (eval_steps * mbs,)
    return _windows(data, mine, block_size, micro_batch_size)
