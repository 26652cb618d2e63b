"""Where a model is cut into pipeline stages: a cost per layer, and the contiguous split that balances it.

No torch here: the trainer (:mod:`meshtrain.parallel.pipeline`) and the planner use the same split,
so the planner's busiest stage is the one the trainer runs.

The model is the sequence ``[embedding, block 0, ..., block L-1, head]`` (the head is the final norm,
the output matrix and the loss). It is cut into ``K = pp * virtual_stages`` contiguous chunks, each
with at least one block; the embedding goes with chunk 0 and the head with chunk K-1. Cost of an
item, in FLOPs per optimizer step for ``tokens`` tokens per pipeline rank and step:

- compute: forward FLOPs per token x 3 (forward + backward, Kaplan et al. 2020, arXiv:2001.08361,
  Sec. 2.1). A block's forward is ``24*C**2`` (q, k, v, proj: ``4 * 2*C**2``; MLP ``2 * 8*C**2``)
  plus ``4*T*C`` of attention (``Q K^T`` and ``A V``); the head's is ``2*C*V``; an embedding lookup
  has none. This is Narayanan et al. 2021 (arXiv:2104.04473), Eq. 3, per layer, without recomputation.
- parameters: ``OPTIMIZER_FLOPS_PER_PARAM`` per parameter per step (gradient accumulation and the
  AdamW update), which is what the embedding costs: its ``V*C`` gradient is dense.

The split minimises the costliest chunk (the pipeline's step is set by its slowest stage), by
dynamic programming over the cut points (the linear-partition problem, O(K * L**2)).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

OPTIMIZER_FLOPS_PER_PARAM = 16
"""FLOPs per parameter per step outside the matmuls: AdamW's update (~12 elementwise operations on
m, v and the weight, PyTorch's ``_single_tensor_adamw``) plus accumulating and zeroing the gradient."""


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


RECURRENT_GATES = {"lstm": 4, "gru": 3}
"""Gates of a recurrent layer: each has a C x C input and a C x C recurrent matrix and two C biases."""


def item_costs(n_layer: int, n_embd: int, block_size: int, vocab_size: int, tokens: int,
               model_type: str = "gpt", kv_dim: int | None = None, ffn_hidden: int | None = None,
               tied: bool = True, biases: bool = False) -> tuple[float, float, float]:
    """(embedding, one block, head) cost in FLOPs per step for ``tokens`` tokens of length-``block_size`` samples.

    "gpt": a block holds ``12*C**2`` matrix and ``2*C`` LayerNorm-scale parameters, plus ``11*C`` with
    ``biases`` (``model.bias``: q, k, v, proj 4C, MLP 4C + C, LayerNorm shifts 2C), and the final norm
    ``C`` (``2*C``); biases add parameters to update, not matmul FLOPs (their adds are negligible).

    "llama": a block's matrices are q and the output projection (``C*C`` each), k and v (``C*kv_dim``
    each, grouped-query attention) and SwiGLU's three ``C*ffn_hidden``; forward ``2 * params`` per token
    plus the attention's ``4*T*C``; no position embedding; an untied head's ``V*C`` update is the head's.
    For "lstm" / "gru" a block is one recurrent layer: ``g`` gates (4 / 3) of two C x C matmuls per
    token, ``2 * 2*g*C**2`` forward FLOPs, and ``g * (2*C**2 + 2*C)`` parameters; there are no position
    embeddings and no final norm.
    """
    C, T, V = n_embd, block_size, vocab_size
    opt = OPTIMIZER_FLOPS_PER_PARAM
    head = 3 * 2 * C * V * tokens  # a tied output matrix is the embedding: its update counted there
    if model_type in RECURRENT_GATES:
        g = RECURRENT_GATES[model_type]
        return opt * V * C, 3 * 4 * g * C * C * tokens + opt * g * (2 * C * C + 2 * C), head
    if model_type == "llama":
        matrices = 2 * C * C + 2 * C * (kv_dim or C) + 3 * C * (ffn_hidden or 4 * C)
        block = 3 * (2 * matrices + 4 * T * C) * tokens + opt * (matrices + 2 * C)
        return opt * V * C, block, head + opt * C + (0 if tied else opt * V * C)
    embedding = opt * (V + T) * C
    b = int(biases)
    block = 3 * (24 * C * C + 4 * T * C) * tokens + opt * (12 * C * C + 2 * C + b * 11 * C)
    return embedding, block, head + opt * (1 + b) * C


def model_item_costs(model, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """:func:`item_costs` of a ``[model]`` config (a :class:`meshtrain.config.ModelConfig`)."""
    m = model
    head_dim = m.n_embd // m.n_head
    return item_costs(m.n_layer, m.n_embd, m.block_size, vocab_size, tokens, m.type,
                      kv_dim=m.kv_heads() * head_dim, ffn_hidden=m.ffn_hidden_size() if m.type == "llama" else None,
                      tied=m.tie_embeddings if m.type == "llama" else True, biases=m.type == "gpt" and m.bias)


def split_layers(n_layer: int, n_chunks: int, costs: tuple[float, float, float]) -> list[Chunk]:
    """Cut ``n_layer`` blocks into ``n_chunks`` contiguous chunks minimising the costliest one.

    ``costs`` = (embedding, block, head) from :func:`item_costs`. Among equally good splits the one
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
