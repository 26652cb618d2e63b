"""Where a model is cut into pipeline stages: a cost per layer, and the contiguous split that balances it.

No torch here: the trainer (:mod:`meshtrain.parallel.pipeline`) and the planner use the same split,
so the planner's busiest stage is the one the trainer runs.

The model is the sequence ``[embedding, block 0, ..., block L-1, head]`` (the head is the final norm,
the output matrix and the loss). It is cut into ``K = pp * virtual_stages`` contiguous chunks, each
with at least one block; the embedding goes with chunk 0 and the head with chunk K-1. Cost of an
item, in FLOPs per optimizer step for ``tokens`` tokens per pipeline rank and step:

- compute: forward FLOPs per token x 3 (forward + backward, Kaplan et al. 2020, arXiv:2001.08361,
  Sec. 2.1), each family's own (``models/<family>/spec.py``, ``layer_costs``). A GPT block's forward is
  ``24*C**2`` (q, k, v, proj: ``4 * 2*C**2``; MLP ``2 * 8*C**2``) plus ``4*T*C`` of attention (``Q K^T`` and
  ``A V``); the head's is ``2*C*V``; an embedding lookup has none. This is Narayanan et al. 2021
  (arXiv:2104.04473), Eq. 3, per layer, without recomputation.
- parameters: ``OPTIMIZER_FLOPS_PER_PARAM`` per parameter per step (gradient accumulation and the
  AdamW update), which is what the embedding costs: its ``V*C`` gradient is dense.

The split minimises the costliest chunk (the pipeline's step is set by its slowest stage): the linear-partition
problem, solved for equal block costs by bisection (:func:`split_layers`), the same cuts as dynamic programming over
every cut point in a fraction of its time, which the planner needs for every layout it ranks
(:func:`meshtrain.planner.memory.stage_loads`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM

__all__ = ["OPTIMIZER_FLOPS_PER_PARAM", "Chunk", "model_item_costs", "split_layers", "chunk_ranks", "describe_split"]


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk (a stage of the schedule): blocks ``[first_layer, end_layer)``, and whether it
    holds the embedding (chunk 0) and the head (the last chunk)."""

    index: int
    first_layer: int
    end_layer: int
    has_embedding: bool
    has_head: bool
    cost: float
    """FLOPs per optimizer step (see the module docstring)."""

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    def describe(self) -> str:
        parts = (["embedding"] if self.has_embedding else []) + [
            f"blocks {self.first_layer}-{self.end_layer - 1}" if len(self.layers) > 1 else f"block {self.first_layer}"]
        return " + ".join(parts + (["head"] if self.has_head else []))


def model_item_costs(m, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """(embedding, one block, head) cost in FLOPs per step of the ``[model]`` ``m`` (a ModelConfig) for ``tokens``
    tokens per pipeline rank: its family's :attr:`meshtrain.models.family.Family.layer_costs`."""
    return m.family().layer_costs(m, vocab_size, tokens)


def split_layers(n_layer: int, n_chunks: int, costs: tuple[float, float, float]) -> list[Chunk]:
    """Cut ``n_layer`` blocks into ``n_chunks`` contiguous chunks minimising the costliest one.

    ``costs`` = (embedding, block, head) from :func:`model_item_costs`. Among equally good splits the one
    with the most blocks in the earliest chunks is taken (deterministic on every rank): cut from the last chunk
    back, each chunk starting as late as the best cost of the chunks before it allows.

    The blocks cost the same, so the best cost of the first ``j + 1`` chunks over ``end`` blocks (the last chunk
    not among them) is the least, over chunk 0's share ``k``, of the larger of chunk 0's cost and that of the even
    spread of the other ``end - k`` blocks over ``j`` chunks (``ceil((end - k) / j)`` blocks), found next to where
    the two cross. The last chunk's start is bisected (the others' best cost grows as it starts later, its own
    falls), and each earlier cut is the most blocks the chunks before it hold within the best cost. The same split
    as the dynamic programme over every cut (``tests/test_pipeline_rules.py`` checks it against one), in about
    ``O(chunks + log(layers)**2)`` steps instead of ``O(chunks * layers**2)``: the planner splits for every layout
    it ranks.

    Raises:
        ValueError: ``n_chunks`` < 1 or > ``n_layer`` (every chunk needs a block), or a block cost <= 0.
    """
    if not 1 <= n_chunks <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_chunks} pipeline chunks: need 1 <= chunks <= layers")
    emb, block, head = costs
    if not block > 0:
        raise ValueError(f"a block's cost must be > 0, not {block}")
    last = n_chunks - 1

    def cost(chunk: int, start: int, end: int) -> float:
        return (end - start) * block + (emb if chunk == 0 else 0.0) + (head if chunk == last else 0.0)

    @cache
    def best(j: int, end: int) -> float:
        """The best costliest chunk of blocks [0, end) in chunks 0..j, none of them the last one (j < last)."""
        if j == 0:
            return cost(0, 0, end)

        # chunk 0 holding k blocks, chunks 1..j the other end - k as evenly as they can: the costlier of the two
        # parts is least at the first k where chunk 0's is the larger or just before it; with c = (end - j * emb /
        # block) / (j + 1), where they cross in real numbers, that first k is ceil(c) or ceil(c) + 1 (the spread's
        # ceil adds less than a block), so k in floor(c) - 1 .. floor(c) + 2 holds the best one, rounding included
        centre = min(max(int((end - j * emb / block) / (j + 1)), 1), end - j)  # outside [1, end - j]: its end
        return min(max(cost(0, 0, k), cost(1, 0, -(-(end - k) // j)))
                   for k in range(max(1, centre - 1), min(end - j, centre + 2) + 1))

    if last == 0:
        return [Chunk(0, 0, n_layer, True, True, cost(0, 0, n_layer))]
    end = n_layer  # the whole split's best: the last chunk's start where its cost and the others' best cross
    crossing = _smallest(last, end - 1, lambda s: best(last - 1, s) >= cost(last, s, end))
    target = min(max(best(last - 1, x), cost(last, x, end)) for x in _around(crossing, last, end - 1))
    cuts = [n_layer]
    for j in range(last, 0, -1):  # chunk j starts at the latest block chunks 0..j-1 can end on within the best cost
        if j < last:
            target = best(j, cuts[-1])
        fits = _most_blocks(target, emb, block) + (j - 1) * _most_blocks(target, 0.0, block)
        cuts.append(min(cuts[-1] - 1, fits))
    cuts.append(0)
    cuts.reverse()
    return [Chunk(i, cuts[i], cuts[i + 1], i == 0, i == last, cost(i, cuts[i], cuts[i + 1]))
            for i in range(n_chunks)]


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest x in [lo, hi] with ok(x) (ok monotone: False then True), or hi + 1 (bisection)."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid - 1
        else:
            lo = mid + 1
    return lo


def _most_blocks(limit: float, extra: float, block: float) -> int:
    """The most blocks of cost ``block`` a chunk with ``extra`` besides them holds at cost <= ``limit`` (its cost as
    :func:`split_layers` counts it)."""
    k = max(int((limit - extra) / block), 0)
    while (k + 1) * block + extra <= limit:
        k += 1
    while k > 0 and k * block + extra > limit:
        k -= 1
    return k


def _around(x: int, lo: int, hi: int) -> tuple[int, ...]:
    """``x - 1`` and ``x``, those within [lo, hi]: the two sides of a crossing."""
    return tuple(y for y in (x - 1, x) if lo <= y <= hi)


def chunk_ranks(pp: int, n_chunks: int, style: str) -> list[int]:
    """Pipeline rank of each chunk: ``"loop"`` puts chunk c on rank ``c % pp`` (interleaved 1F1B,
    Narayanan et al. 2021, Sec. 2.2.2); ``"v"`` puts chunks r and 2*pp-1-r on rank r (the V shape of
    zero-bubble ZB-V, Qi et al. 2024, arXiv:2401.10241, Sec. 6)."""
    if style == "v":
        return [c if c < pp else n_chunks - 1 - c for c in range(n_chunks)]
    return [c % pp for c in range(n_chunks)]


def describe_split(chunks: list[Chunk], ranks: list[int]) -> str:
    """One line per chunk: ``chunk 0 on pp rank 0: embedding + blocks 0-3 (12.1 GFLOP/step, 28%)``."""
    total = sum(c.cost for c in chunks)
    return "\n".join(f"  chunk {c.index} on pp rank {ranks[c.index]}: {c.describe()} "
                     f"({c.cost / 1e9:.3g} GFLOP/step, {c.cost / total:.0%})" for c in chunks)
