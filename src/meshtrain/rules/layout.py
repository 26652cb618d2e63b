"""The layout rules: what a model's shapes need of tensor, sequence and expert parallelism. Torch-free.

One rule book, two readers. Config validation (:func:`meshtrain.config.checks.validate`) raises the first rule a
config breaks; the planner (:func:`meshtrain.planner.layout.framework_errors`) lists every rule a candidate breaks
under its ``meshtrain`` stack, from the same functions with the same words, so ``meshtrain plan`` never ranks a layout
that ``meshtrain train`` refuses. Other stacks are stated as their differences from the trainer (the keyword
arguments of :func:`layout_errors`: Megatron replicates kv heads past tp, folds expert parallelism into tp), and a
layout that breaks the rules with every difference allowed is one no stack runs
(:func:`meshtrain.planner.layout.divisibility_errors`).

The rules (Megatron tensor parallelism: Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3; DeepSpeed-Ulysses: Jacobs et
al. 2023, arXiv:2309.14509, Sec. 3; ring attention's zigzag chunks: Brandon et al. 2023, arXiv:2311.09431; Megatron
sequence parallelism: Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4.2.2):

- tp splits whole query heads, whole kv heads (grouped-query attention) and the dense MLP's hidden width;
- Ulysses (``sp_mode = "ulysses"``) hands each sp rank whole heads and kv heads of its tp rank's share; USP
  (``sp_mode = "usp"``, Fang and Zhao 2024, arXiv:2405.07719) the same over its ``sp_ulysses`` ranks, which divide sp
  (``sp_ulysses`` is USP's key only);
- the sequence splits into ``sp`` chunks (``2*sp`` for ring attention and USP) and further into ``tp`` with
  ``tp_sequence_parallel``, which needs tp > 1;
- expert parallelism splits whole experts over ranks borrowed from dp x sp; tp replicates the experts, which take
  the whole sequence (no ``tp_sequence_parallel``, unless the family's plan gathers it for them: DeepSeek-V3); it
  runs with the synchronous all-reduce and zero_stage 0, 2 or 3;
- a recurrence has neither a tensor-parallel plan nor a sequence split;
- an NF4 base (QLoRA, Dettmers et al. 2023, arXiv:2305.14314) is quantized in blocks along each weight's rows: no tp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtrain.axes import expert_degree_error
from meshtrain.models.registry import expert_families, family


@dataclass(frozen=True)
class LayoutShape:
    """What the layout rules read of a model: counts of heads, features and tokens."""

    label: str
    """How the messages name the model: "model.type = 'llama'" for a config, "model 'llama3-8b'" in the planner."""
    heads: int
    """Query heads; 0: no attention (a recurrence)."""
    kv_heads: int
    """Key/value heads (= ``heads`` without grouped-query attention)."""
    ffn_hidden: int
    """The dense MLP's hidden width, which tp splits; 0: no dense MLP split (experts stay whole, replicated over tp)."""
    seq_len: int
    """Tokens of one sample (``model.block_size``)."""
    experts: int = 0
    """Routed experts per MoE layer; 0: a dense model."""
    experts_sequence_parallel: bool = False
    """Whether its experts take ``tp_sequence_parallel`` (the family's tp plan gathers the sequence for them:
    :attr:`meshtrain.models.family.TPNames.experts_sequence_parallel`)."""
    nf4_base: bool = False
    """Whether the frozen base is stored in NF4 (QLoRA, ``adapter.quantize_base = "nf4"``), whose 64-weight blocks
    run along each weight's rows: no tp."""


def shape_of(cfg: Any) -> LayoutShape:
    """The :class:`LayoutShape` of a ``Config``'s model, from its family's declared shapes
    (:class:`meshtrain.models.family.Family`: ``blocks``, ``kv_heads``, ``ffn_hidden``, ``experts``) and its
    ``adapter.quantize_base``."""
    m, f = cfg.model, family(cfg.model.type)
    label, nf4 = f"model.type = {m.type!r}", cfg.adapter.quantize_base == "nf4"
    if not f.attention:
        return LayoutShape(label, heads=0, kv_heads=0, ffn_hidden=0, seq_len=m.block_size, nf4_base=nf4)
    return LayoutShape(label, heads=m.n_head, kv_heads=f.kv_heads(m), ffn_hidden=0 if f.experts else f.ffn_hidden(m),
                       seq_len=m.block_size, experts=m.num_experts if f.experts else 0, nf4_base=nf4,
                       experts_sequence_parallel=f.tp is not None and f.tp.experts_sequence_parallel)


def layout_errors(shape: LayoutShape, p: Any, dp: int, sync_mode: str = "sync", replicate_kv_heads: bool = False,
                  expert_folding: bool = False) -> list[str]:
    """Every rule the degrees ``p`` break for ``shape``, one line each, in the order config validation checks them
    (empty: none). ``p`` holds ``tp, sp, ep, sp_mode, sp_ulysses, tp_sequence_parallel, zero_stage,
    hierarchical_allreduce``
    (a ``ParallelConfig`` or the planner's ``Layout``); ``dp`` is the resolved data-parallel degree (-1: not known
    yet, its rules wait for :func:`meshtrain.config.checks.resolve_world`).

    Differences of other stacks: ``replicate_kv_heads`` (Megatron-LM: tp may also be a multiple of the kv heads, each
    kv head replicated over ``tp / kv_heads`` ranks); ``expert_folding`` (Megatron-Core's MoE parallel folding: ep
    folded into tp x dp x sp, each tp rank routing its own sequence shard, with its distributed optimizer).
    """
    if split := _sp_split_errors(p):
        return split
    if shape.nf4_base and p.tp > 1:
        return [f"adapter.quantize_base = 'nf4' with parallel.tp = {p.tp}: an NF4 weight's blocks run along its rows, "
                f"which tensor parallelism would cut; use tp = 1 (dp, FSDP2, pp and sp work)"]
    if not shape.heads:
        return _recurrent_errors(shape, p)
    return [*_head_errors(shape, p, replicate_kv_heads), *_mlp_errors(shape, p), *_sequence_errors(shape, p),
            *_expert_errors(shape, p, dp, sync_mode, expert_folding)]


def _recurrent_errors(shape: LayoutShape, p: Any) -> list[str]:
    e = []
    if p.tp != 1:
        e.append(f"parallel.tp = {p.tp} is not supported for {shape.label}: recurrent layers have no "
                 f"tensor-parallel plan; use tp = 1 (and dp or pp)")
    if p.sp != 1:
        e.append(f"parallel.sp = {p.sp} is not supported for {shape.label}: a recurrence runs its "
                 f"sequence in order on one rank; use sp = 1 (and model.tbptt_steps for long sequences)")
    return e


def _splits(count: int, ranks: int, replicate: bool) -> bool:
    """Whether ``ranks`` take whole ones of ``count`` heads (or, with ``replicate``, share each of them)."""
    return count % ranks == 0 or (replicate and ranks % count == 0)


def _sp_split_errors(p: Any) -> list[str]:
    """``sp_ulysses``: at least 1, USP's key only, and a divisor of sp (the ring degree is ``sp / sp_ulysses``)."""
    u = p.sp_ulysses
    if u < 1:
        return [f"parallel.sp_ulysses = {u} must be >= 1"]
    if u != 1 and p.sp_mode != "usp":
        return [f"parallel.sp_ulysses = {u} splits sp for sp_mode = 'usp' only (sp_mode is {p.sp_mode!r}): use "
                f"sp_mode = 'usp' or sp_ulysses = 1"]
    if p.sp % u:
        valid = ", ".join(str(d) for d in range(1, p.sp + 1) if p.sp % d == 0)
        return [f"parallel.sp_ulysses = {u} does not divide parallel.sp = {p.sp}: USP runs Ulysses over sp_ulysses "
                f"ranks and ring attention over sp/sp_ulysses; use sp_ulysses in {valid}"]
    return []


def _ulysses_degree(p: Any) -> tuple[int, str]:
    """The ranks an all-to-all of heads spans and how messages name them: sp under Ulysses, sp_ulysses under USP,
    1 (no head split) under ring attention or sp = 1."""
    if p.sp > 1 and p.sp_mode == "ulysses":
        return p.sp, "sp"
    if p.sp > 1 and p.sp_mode == "usp" and p.sp_ulysses > 1:
        return p.sp_ulysses, "sp_ulysses"
    return 1, ""


def _head_errors(shape: LayoutShape, p: Any, replicate_kv_heads: bool) -> list[str]:
    """Whole query heads per tp rank, per tp*sp rank under Ulysses (tp*sp_ulysses under USP), and the same for the
    kv heads."""
    e, heads, kv = [], shape.heads, shape.kv_heads
    u, name = _ulysses_degree(p)
    who = "Ulysses hands each sp rank" if name == "sp" else "USP's Ulysses hands each of its sp_ulysses ranks"
    if heads % p.tp:
        e.append(f"model.n_head = {heads} is not divisible by parallel.tp = {p.tp}: tensor parallelism splits whole "
                 f"heads across tp ranks; use a tp that divides {heads}")
    elif u > 1 and heads % (p.tp * u):
        e.append(f"model.n_head = {heads} is not divisible by tp*{name} = {p.tp * u}: {who} "
                 f"n_head/(tp*{name}) whole heads; use sp_mode = 'ring' (no head restriction) or fewer ranks")
    if kv == heads:
        return e
    if not _splits(kv, p.tp, replicate_kv_heads):
        e.append(f"model.n_kv_head = {kv} is not divisible by parallel.tp = {p.tp}: tensor parallelism gives each tp "
                 f"rank whole kv heads (grouped-query attention); use a tp that divides {kv}")
    elif u > 1 and not _splits(kv, p.tp * u, replicate_kv_heads):
        e.append(f"model.n_kv_head = {kv} is not divisible by tp*{name} = {p.tp * u}: {who} "
                 f"n_kv_head/(tp*{name}) whole kv heads; use sp_mode = 'ring' or fewer ranks")
    return e


def _mlp_errors(shape: LayoutShape, p: Any) -> list[str]:
    """tp splits the dense MLP's hidden width (column-parallel up, row-parallel down) into equal shards."""
    if shape.ffn_hidden and shape.ffn_hidden % p.tp:
        return [f"the MLP's hidden width {shape.ffn_hidden} (model.ffn_hidden, or its default from model.n_embd) is "
                f"not divisible by parallel.tp = {p.tp}: tensor parallelism gives each tp rank an equal slice of it; "
                f"use a tp that divides {shape.ffn_hidden}"]
    return []


def _sequence_errors(shape: LayoutShape, p: Any) -> list[str]:
    """``tp_sequence_parallel`` needs tp > 1; the sequence splits into sp (2*sp for ring and USP) and then tp
    chunks."""
    e = []
    if p.tp_sequence_parallel and p.tp == 1:
        e.append("parallel.tp_sequence_parallel = true needs parallel.tp > 1 (it is 1): set tp >= 2 or use false")
    ring = p.sp > 1 and p.sp_mode in ("ring", "usp")  # USP cuts each of its 2*sp/sp_ulysses ring chunks further
    chunks = p.sp * (2 if ring else 1) * (p.tp if p.tp_sequence_parallel else 1)
    if shape.seq_len % chunks:
        what = " * ".join(name for name, on in (("sp", p.sp > 1), ("2 (ring chunks)", ring),
                                               ("tp (tp_sequence_parallel)", p.tp_sequence_parallel)) if on)
        e.append(f"model.block_size = {shape.seq_len} is not divisible by {what} = {chunks}: each rank holds "
                 f"block_size/{chunks} tokens of a sample; use a block_size that is a multiple of {chunks}")
    return e


def _expert_errors(shape: LayoutShape, p: Any, dp: int, sync_mode: str, folding: bool) -> list[str]:
    """Whole experts per ep rank, ep ranks borrowed from dp x sp (tp x dp x sp with ``folding``), experts replicated
    over tp (no ``tp_sequence_parallel``), and what the experts' own gradient reduction runs with."""
    e = []
    if shape.experts and p.tp_sequence_parallel and not (folding or shape.experts_sequence_parallel):
        e.append(f"parallel.tp_sequence_parallel = true is not supported with {shape.label} (tensor "
                 f"parallelism replicates its experts, which take every token of the sequence): use "
                 f"tp_sequence_parallel = false")
    if p.ep == 1:
        return e
    if not shape.experts:
        return [*e, f"parallel.ep = {p.ep} splits a mixture of experts' experts, and {shape.label} has "
                    f"none: use ep = 1, or a model with experts ({expert_families()})"]
    if shape.experts % p.ep:
        e.append(f"model.num_experts = {shape.experts} is not divisible by parallel.ep = {p.ep}: each ep rank holds "
                 f"num_experts/ep whole experts; use an ep that divides {shape.experts}")
    if folding and dp != -1 and (p.tp * dp * p.sp) % p.ep:
        e.append(f"parallel.ep = {p.ep} does not divide tp*dp*sp = {p.tp * dp * p.sp}: parallel folding borrows "
                 f"expert ranks from them")
    if folding:
        return e
    if dp != -1 and (dp * p.sp) % p.ep:
        e.append(expert_degree_error(p.ep, dp, p.sp))
    if sync_mode != "sync":
        e.append(f"parallel.ep = {p.ep} cannot be combined with parallel.sync_mode = {sync_mode!r}: the experts' "
                 f"ranks exchange tokens every step; use 'sync' or ep = 1")
    if p.hierarchical_allreduce:
        e.append(f"parallel.hierarchical_allreduce = true is not supported with parallel.ep = {p.ep}: use false or "
                 f"ep = 1")
    if p.zero_stage == 1:
        e.append(f"parallel.zero_stage = 1 is not supported with parallel.ep = {p.ep} (the sharded optimizer "
                 f"broadcasts whole parameters, and an ep rank holds some experts only): use zero_stage 0, 2 or 3")
    return e
