"""The decoders' tensor-parallel plan: which submodule is column-, row- or sequence-parallel, by the module names a
family's ``spec.py`` gives (:class:`meshtrain.models.family.TPNames`).

Megatron-LM's layout (Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3, Fig. 3): in each block the q, k,
v projections and the MLP up-projection are column-parallel (each tp rank computes ``C/tp`` of their
output features: ``nh/tp`` whole heads, ``4C/tp`` hidden units), the attention output projection
and the MLP down-projection are row-parallel (each rank multiplies its slice and the partial sums
are all-reduced: the ``g`` operator). The token embedding is split by vocabulary rows and the
output head by vocabulary columns (the tied weight keeps one ``Shard(0)`` layout for both), and the
loss is computed on vocabulary-sharded logits (``loss_parallel``), so no rank holds full-vocab logits.

With ``tp_sequence_parallel`` (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2) the residual
stream between the tp regions, with its layer norms and dropouts, is split along the sequence
across the tp ranks: the column-parallel inputs all-gather the sequence and the row-parallel
outputs reduce-scatter it (the ``g``/``g-bar`` pair), instead of one all-reduce. Here the
embedding output is all-reduced and then split (Megatron reduce-scatters it): it keeps the learned
position embedding outside the sharded region.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from meshtrain.models.family import TPNames


def tp_plan(layers: Iterable[str], sequence_parallel: bool, embedding: bool, names: TPNames) -> dict[str, ParallelStyle]:
    """``parallelize_module`` plan of a decoder whose blocks' modules are named by ``names`` (its family's), on the
    "tp" mesh axis.

    Activation layouts at block boundaries: (B, T, C) replicated across tp, or (B, T/tp, C) with
    ``sequence_parallel``. ``layers`` are the keys of ``blocks`` this model (or pipeline stage) holds;
    ``embedding``: whether it holds the embedding (a later pipeline stage receives the residual stream
    already in its sequence-parallel layout, so its first block needs no input split);
    entries for modules a stage lacks are dropped by the caller. The head's output stays a ``DTensor`` (B, T, V) sharded on V, for
    :func:`torch.distributed.tensor.parallel.loss_parallel`. ``names.extra_inputs``: plain tensors a block and its
    attention take after the residual stream (Llama's RoPE ``cos, sin``), passed through unchanged.
    A block's ``attn`` or ``mlp`` with no column-parallel module in ``names`` (a mixture of experts' MLP) is left
    whole: it takes the replicated residual stream as a plain tensor.
    ``names.head_norms`` (Qwen3's q and k norms) act on (B, T, heads/tp, hd), this rank's heads: their weight is
    replicated and its gradient, a partial sum over each rank's heads, is all-reduced (``SequenceParallel`` over
    the head dim).
    ``names.plain_inputs`` (DeepSeek-V3): ``attn`` and ``mlp`` get the replicated stream as a plain tensor, so that
    replicated layers inside them (MLA's down-projections, a router) run on it whole; each column-parallel module
    then all-reduces its own input's gradient (one ``f`` operator per module, not one per block).
    """
    extra = (None,) * names.extra_inputs
    layers = list(layers)
    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    if sequence_parallel and embedding:
        # embedding output (B, T, C) replicated -> this rank's (B, T/tp, C) slice: no communication
        plan[f"blocks.{layers[0]}"] = PrepareModuleInput(input_layouts=(Replicate(), *extra),
                                                         desired_input_layouts=(Shard(1), *extra), use_local_output=True)
    for i in layers:
        b = f"blocks.{i}"
        if sequence_parallel:
            for name in ("ln_1", "ln_2"):
                plan[f"{b}.{name}"] = SequenceParallel()
        for name, more in (("attn", extra), ("mlp", ())):
            if not any(c.startswith(f"{name}.") for c in names.colwise):
                continue  # not split (a mixture of experts' MLP: tp replicates it)
            # One DTensor input for all of q, k, v: their gradients add up as one partial sum before a
            # single all-reduce (reduce-scatter with sequence parallelism), Megatron's f operator,
            # instead of one collective per matrix.
            plan[f"{b}.{name}"] = PrepareModuleInput(input_layouts=(seq, *more), desired_input_layouts=(Replicate(), *more),
                                                     use_local_output=names.plain_inputs)
        plan.update({f"{b}.{name}": ColwiseParallel() for name in names.colwise})
        plan.update({f"{b}.{name}": RowwiseParallel(output_layouts=seq) for name in names.rowwise})
        plan.update({f"{b}.{name}": SequenceParallel(sequence_dim=2, use_local_output=True) for name in names.head_norms})
    return plan
