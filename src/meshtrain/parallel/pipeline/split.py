"""Cutting the model into pipeline chunks, and the group that keeps a split tied weight equal.

:func:`split_model` cuts a whole model into ``pp * virtual_stages`` chunks balanced by cost
(:mod:`meshtrain.parallel.pipeline.balance`), placed on the pipeline ranks as the schedule wants
(:mod:`meshtrain.rules.pipeline`), and keeps this rank's. :func:`embedding_group` is the
process group over which the embedding and the head's copy of it sum their gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.rules.pipeline import RULES
from meshtrain.parallel.pipeline.balance import Chunk, chunk_ranks, model_item_costs, split_layers
from meshtrain.runtime.distributed import collective_timeout


def split_model(model: nn.Module, pp: int, pp_rank: int, virtual_stages: int, schedule: str,
                tokens: int) -> tuple[list[Chunk], list[Chunk], list[nn.Module]]:
    """Cut ``model`` (a whole :class:`meshtrain.models.base.LayeredLM`, the same on every rank) for pipeline rank ``pp_rank``.

    Returns (every chunk of the pipeline, this rank's chunks, their modules). ``model`` itself is pruned
    to this rank's layers and keeps every parameter this rank trains (its optimizer, checkpoint and
    norm see it); the chunk modules share its submodules. ``tokens``: tokens per step, for the costs.
    """
    cfg = model.cfg
    n_chunks = pp * virtual_stages
    chunks = split_layers(cfg.n_layer, n_chunks, model_item_costs(cfg, model.vocab_size, tokens))
    ranks = chunk_ranks(pp, n_chunks, RULES[schedule].placement)
    mine = [c for c in chunks if ranks[c.index] == pp_rank]
    if n_chunks > 1:
        model.untie_weights()
    model.keep_only({i for c in mine for i in c.layers}, any(c.has_embedding for c in mine),
                    any(c.has_head for c in mine))
    parts = [model.pipeline_chunk(c.layers, c.has_embedding, c.has_head) for c in mine]
    return chunks, mine, parts


def embedding_group(mesh_ranks: torch.Tensor, schedule: str) -> dist.ProcessGroup | None:
    """This rank's embedding group: the ranks of the first and last pipeline stage with the same dp, sp
    and tp coordinates (Megatron-LM's embedding group). ``mesh_ranks`` (pp, dp, sp, tp) are the global
    ranks of the mesh. Every rank must call this (it creates one group per coordinate). None with pp = 1
    or a V-shaped schedule (both ends on pipeline rank 0)."""
    pp = mesh_ranks.size(0)
    if pp == 1 or RULES[schedule].placement == "v":
        return None
    pairs = mesh_ranks[[0, pp - 1]].reshape(2, -1).t().tolist()  # [[first-stage rank, last-stage rank], ...]
    group, _ = dist.new_subgroups_by_enumeration(pairs, timeout=collective_timeout())
    return group
