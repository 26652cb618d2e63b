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

The split minimises the costliest chunk (the pipeline's step is set by its slowest stage), by
dynamic programming over the cut points (the linear-partition problem, O(K * L**2)).
"""

from __future__ import annotations

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
    with the most blocks in the earliest chunks is taken (deterministic on every rank).

    Raises:
        ValueError: ``n_chunks`` < 1 or > ``n_layer`` (every chunk needs a block).
    """
    if not 1 <= n_chunks <= n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_chunks} pipeline chunks: need 1 <= chunks <= layers")
    emb, block, head = costs

    def cost(chunk: int, start: int, end: int) -> float:
        return (end - start) * block + (emb if chunk == 0 else 0.0) + (head if chunk == n_chunks - 1 else 0.0)

    @cache
    def best(chunk: int, end: int) -> tuple[float, int]:
        """(max cost, start of this chunk) for blocks [0, end) in chunks 0..chunk, chunk ending at ``end``."""
        if chunk == 0:
            return cost(0, 0, end), 0
        options = [(max(best(chunk - 1, start)[0], cost(chunk, start, end)), -start)
                   for start in range(chunk, end)]
        value, neg_start = min(options)
        return value, -neg_start

    cuts = [n_layer]
    for chunk in range(n_chunks - 1, 0, -1):
        cuts.append(best(chunk, cuts[-1])[1])
    cuts.append(0)
    cuts.reverse()
    return [Chunk(i, cuts[i], cuts[i + 1], i == 0, i == n_chunks - 1, cost(i, cuts[i], cuts[i + 1]))
            for i in range(n_chunks)]


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
