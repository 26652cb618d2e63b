"""Enumerate every valid layout of a job, predict each, rank by time per step.

A layout is (dp, tp, pp, sp, zero_stage, micro_batch_size, gradient_accumulation_steps, recompute,
pp_schedule, virtual_stages, tp_sequence_parallel, sp_mode) with ``dp*tp*pp*sp = num_devices`` and
``micro_batch_size*gradient_accumulation_steps*dp = global_batch_size``. Candidates that break a
divisibility rule (:func:`meshtrain.planner.layout.divisibility_errors`) or need a feature the framework
lacks (:func:`meshtrain.planner.layout.framework_errors`) are never generated; those
that do not fit in memory are dropped (or kept, flagged, with ``keep_unfit``). Layouts that are
dominated by construction are skipped, since they only ever add time: for a given rest of the layout

- a recompute mode is tried only if the cheaper ones do not fit (Korthikanti et al. 2022, Sec. 5);
- tp without sequence parallelism only where sequence parallelism is not possible (ibid.);
- ZeRO-3 only in a recompute mode cheaper than the one ZeRO-2 fits in: it needs less memory than ZeRO-2 but
  gathers the weights again before backward, the rest of its step being ZeRO-2's
  (:func:`meshtrain.planner.cost.dp_time`). A pinned ``zero_stage = 3`` is always tried.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from meshtrain.planner.cost import bubble_time, micro_batch
from meshtrain.planner.estimate import Job, estimate
from meshtrain.planner.hardware import Hardware
from meshtrain.rules.pipeline import runs_with_data_parallel, schedule_error
from meshtrain.rules.support import zero_stage_error
from meshtrain.planner.layout import (RECOMPUTE, Framework, Layout, divisibility_errors, framework_errors,
                                     recompute_modes)
from meshtrain.planner.memory import (ActivationMemory, MemoryBreakdown, Precision, RecomputeMemory, composite_norms,
                                     shard_bytes, stage_params_floor, tight_budget)
from meshtrain.planner.model_specs import NF4_BYTES, ModelSpec


@lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _schedules(model: ModelSpec, pp: int, ga: int, allowed: tuple[str, ...], batch_degree: int) -> Iterator[tuple[str, int]]:
    """(pp_schedule, virtual_stages) pairs the framework runs for ``pp`` stages and ``ga`` micro-batches:
    the trainer's own rules (:func:`meshtrain.rules.pipeline.schedule_error`), virtual stages from the
    divisors of a stage's layers."""
    if pp == 1:
        yield "1f1b", 1
        return
    per_stage = -(-model.layers // pp)
    for sched in allowed:
        for v in [1] + [v for v in divisors(per_stage) if v > 1]:
            # zero_stage 2 runs every schedule; each stage's own rule is checked per candidate (runs_with_data_parallel)
            if schedule_error(sched, pp, v, ga, model.layers, batch_degree, zero_stage=2) is None:
                yield sched, v


def _choices(fixed: dict[str, Any], key: str, options: list[Any]) -> list[Any]:
    return [fixed[key]] if key in fixed else options


def candidate_layouts(model: ModelSpec, job: Job, framework: Framework, fixed: dict[str, Any] | None = None,
                      devices_per_node: int | None = None,
                      states_fit: Callable[[int, int, int, int], bool] | None = None) -> Iterator[tuple[Layout, list[str]]]:
    """Valid layouts the framework can run, as ``(layout, recompute modes)``: the layout holds the
    cheapest mode, the list every mode to try, cheapest first. ``fixed`` pins any Layout field (e.g.
    ``{"tp": 8, "recompute": "full"}``); a pinned value the framework lacks yields nothing. The model's
    divisibility rules are checked once per (tp, sp, sp_mode, pp, tp_sequence_parallel); batch and
    schedule rules hold by construction. With ``devices_per_node``, DDP layouts whose dp group spans
    nodes come both with a flat and a hierarchical gradient all-reduce. ``states_fit(tp, pp, dp*sp, zero_stage)``
    False skips every layout of those degrees and zero stage (their model states alone do not fit).
    """
    for layouts, modes in candidate_groups(model, job, framework, fixed, devices_per_node, states_fit):
        for layout in layouts:
            yield layout, modes


def candidate_groups(model: ModelSpec, job: Job, framework: Framework, fixed: dict[str, Any] | None = None,
                     devices_per_node: int | None = None,
                     states_fit: Callable[[int, int, int, int], bool] | None = None) -> Iterator[tuple[list[Layout], list[str]]]:
    """:func:`candidate_layouts` in groups ``(layouts, recompute modes)`` whose layouts differ only in
    ``zero_stage`` and ``hierarchical_allreduce``: the fields that change neither the activations nor the
    micro-batch's compute, so the search computes those once per group."""
    fixed = fixed or {}
    world, gbs = job.num_devices, job.global_batch_size
    degrees = divisors(world)
    modes = [m for m in _choices(fixed, "recompute", list(RECOMPUTE)) if m in framework.recompute]
    zeros = [z for z in _choices(fixed, "zero_stage", list(framework.zero_stages)) if z in framework.zero_stages]
    # QLoRA's NF4 blocks run along a weight's rows, which tp would cut: the trainer refuses tp > 1 with it
    # (meshtrain.adapters.spec), so the planner never ranks one
    tps = _choices(fixed, "tp", degrees if framework.tensor_parallel and not model.nf4_layer_params else [1])
    schedules: dict[tuple[int, int, int], list[tuple[str, int]]] = {}  # by (pp, ga, dp*sp)
    sync = {k: v for k, v in fixed.items() if k in SYNC_FIELDS}  # pinned only: the search ranks synchronous layouts
    for tp, sp, pp in itertools.product(tps, _choices(fixed, "sp", degrees), _choices(fixed, "pp", degrees)):
        if world % (tp * sp * pp) or pp > model.layers or (pp > 1 and not framework.pp_schedules) or not modes:
            continue
        dp = world // (tp * sp * pp)
        if fixed.get("dp", dp) != dp or gbs % dp:
            continue
        fitting_zeros = [z for z in zeros if states_fit is None or states_fit(tp, pp, dp * sp, z)]
        if not fitting_zeros:
            continue
        batch = dp * sp * framework.expert_fold(tp)  # the ranks ep borrows: Megatron folds it into tp too
        for ep, (sp_mode, seqp, ulysses) in itertools.product(expert_degrees(model, fixed, batch),
                                                              _model_splits(model, framework, fixed, dp, tp, pp, sp)):
            degrees_only = Layout(dp, tp, pp, sp, ep=ep, tp_sequence_parallel=seqp, sp_mode=sp_mode,
                                  sp_ulysses=ulysses, **sync)
            if sync and divisibility_errors(model, degrees_only, schedule=False):
                continue  # the pinned sync mode's own rules on these degrees (a DiLoCo group of whole replicas)
            # (zero_stage, hierarchical_allreduce) pairs: they depend on the degrees alone, but for the schedule's
            # rules on DDP and ZeRO-3 (runs_with_data_parallel, below)
            variants = [(zero, hier) for zero in fitting_zeros
                        if not (framework.zero1_ddp_only and zero_stage_error(zero, tp, pp))
                        and not (ep > 1 and zero == 1 and not framework.expert_folding)
                        for hier in _hierarchical(framework, _with(degrees_only, zero_stage=zero), devices_per_node,
                                                  fixed)]
            for mbs in _choices(fixed, "micro_batch_size", divisors(gbs // dp)):
                ga = gbs // (dp * mbs)
                if (gbs // dp) % mbs or fixed.get("gradient_accumulation_steps", ga) != ga:
                    continue
                if mbs % model.sequences_per_sample:  # a DPO pair's two sequences share a micro-batch
                    continue
                key = (pp, ga, dp * sp)
                if key not in schedules:
                    schedules[key] = list(_schedules(model, pp, ga, framework.pp_schedules, dp * sp))
                for sched, v in schedules[key]:
                    if fixed.get("pp_schedule", sched) != sched or fixed.get("virtual_stages", v) != v:
                        continue
                    runnable = recompute_modes(framework, modes, pp, sched)
                    if not runnable:
                        continue
                    group = [_with(degrees_only, zero_stage=zero, micro_batch_size=mbs, gradient_accumulation_steps=ga,
                                   recompute=runnable[0], pp_schedule=sched, virtual_stages=v,
                                   hierarchical_allreduce=hier)
                             for zero, hier in variants if runs_with_data_parallel(sched, dp * sp, zero)]
                    if group:
                        yield group, runnable


def expert_degrees(model: ModelSpec, fixed: dict[str, Any], batch_degree: int) -> list[int]:
    """The ``ep`` degrees to try: every divisor of both the expert count and ``batch_degree`` (the ranks ep borrows:
    dp*sp, or tp*dp*sp with ``Framework.expert_folding``) for a model with experts, else 1; a pinned one alone."""
    if "ep" in fixed:
        ep = fixed["ep"]
        return [ep] if (model.experts or ep == 1) and model.experts % ep == 0 and batch_degree % ep == 0 else []
    return list(divisors(math.gcd(model.experts, batch_degree))) if model.experts else [1]


def _hierarchical(framework: Framework, layout: Layout, devices_per_node: int | None,
                  fixed: dict[str, Any]) -> list[bool]:
    """Whether to try the gradient all-reduce flat, hierarchical, or both: hierarchical only where the
    framework has it, for DDP (zero_stage 0, tp 1) whose dp group spans nodes."""
    if "hierarchical_allreduce" in fixed:
        return [fixed["hierarchical_allreduce"]]
    possible = (framework.hierarchical_allreduce and layout.zero_stage == 0 and layout.tp == 1
                and devices_per_node is not None and layout.spans_nodes("dp", devices_per_node))
    return [False, True] if possible else [False]


def _model_splits(model: ModelSpec, framework: Framework, fixed: dict[str, Any], dp: int, tp: int, pp: int,
                  sp: int) -> Iterator[tuple[str, bool, int]]:
    """(sp_mode, tp_sequence_parallel, sp_ulysses) triples that the model's shape and the framework allow for these
    degrees: every sp mode of the framework when sp > 1 (one, "ulysses", when sp = 1), USP at each Ulysses degree
    strictly between 1 and sp (its ends are ring and Ulysses); sequence parallelism inside tp whenever it is
    possible, since it only saves memory and time."""
    sp_modes = _choices(fixed, "sp_mode", list(framework.sp_modes) if sp > 1 else ["ulysses"])
    for sp_mode in sp_modes:
        inner = [u for u in divisors(sp) if 1 < u < sp] if sp_mode == "usp" else [1]
        for ulysses in _choices(fixed, "sp_ulysses", inner):
            seqps = [fixed["tp_sequence_parallel"]] if "tp_sequence_parallel" in fixed else [True, False]
            for seqp in seqps:
                if seqp and (tp == 1 or not framework.sequence_parallel) and "tp_sequence_parallel" not in fixed:
                    continue
                layout = Layout(dp, tp, pp, sp, tp_sequence_parallel=seqp, sp_mode=sp_mode, sp_ulysses=ulysses)
                if not divisibility_errors(model, layout, schedule=False) and not framework_errors(framework, layout,
                                                                                                  model):
                    yield sp_mode, seqp, ulysses
                    break  # tp without sequence parallelism only where it is impossible


class Ranked(list):
    """Estimates, fastest first (a ``list[Estimate]``), and ``count``: how many layouts fit, ranked or not
    (:func:`search` with ``top`` leaves out those that cannot be among the first ``top``)."""

    count: int


def search(model: ModelSpec, hw: Hardware, precision: Precision, framework: Framework, job: Job,
           fixed: dict[str, Any] | None = None, keep_unfit: bool = False, top: int | None = None,
           through: float | None = None, tight: bool = False) -> Ranked:
    """Predict every candidate; return them fastest first (fitting ones first when ``keep_unfit``).

    For each candidate the first recompute mode that fits is kept (later ones are slower by
    construction); with ``keep_unfit`` and none fitting, the least-memory one is kept, flagged. With ``tight``
    (``meshtrain plan``), "fits" reads the memory range (:func:`meshtrain.planner.memory.memory_verdict`): the first
    mode whose verdict is not "does not fit" is kept too, its ``verdict`` "tight" (it may run out of memory), beside
    the first that surely fits when that one is slower; they rank by step time, whatever their verdict. Without it
    (``--layout auto``, which launches) only what fits the predicted peak. Degrees and
    zero stages whose model states alone exceed the memory (:func:`states_lower_bound`) are not generated
    (unless ``keep_unfit``), and each fitting layout's memory is predicted once.

    ``top`` (fitting layouts only): the result holds the ``top`` fastest layouts, exactly as without it, and every
    other layout whose step time could be at most the ``top``-th's or ``through`` seconds (so a given layout of that
    time finds its rank), but not the rest: a layout is predicted in full only when its lower bound -- its
    micro-batches' compute and tp/sp/pp/ep communication plus the pipeline bubble, every part of the step time but
    the dp, optimizer and per-step terms (:func:`lower_bound`) -- is below those. ``count`` is every fitting layout.
    """
    with _gc_paused():
        return _search(model, hw, precision, framework, job, fixed, keep_unfit, top, through, tight)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused: a search allocates ~10^5 objects that nearly all live on in its
    result, which the collector would scan again and again (~15% of the search) to free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(model: ModelSpec, hw: Hardware, precision: Precision, framework: Framework, job: Job,
            fixed: dict[str, Any] | None, keep_unfit: bool, top: int | None, through: float | None,
            tight: bool = False) -> Ranked:
    """:func:`search`, the garbage collector paused."""
    budget = hw.device.memory_bytes
    loose = max(budget, tight_budget(hw.device)) if tight else budget  # the largest peak not "does not fit"

    def states_fit(tp: int, pp: int, shard: int, zero: int) -> bool:
        return keep_unfit or states_lower_bound(model, tp, pp, shard, zero, hw, precision, framework) <= loose

    fits, unfit = [], []  # (layout, its memory breakdown)
    norms, memo = composite_norms(hw), {}  # memo: the model states that many layouts share, then the cost model's parts
    for group, modes in candidate_groups(model, job, framework, fixed, hw.network.devices_per_node, states_fit):
        activations = ActivationMemory(model, group[0], precision, framework, norms)  # the same for the whole group
        tried = modes
        for base in group:  # zero stages in increasing order
            memory_of = RecomputeMemory(model, base, hw, precision, framework, activations, memo)
            chosen = memory_of.cheapest_fitting(tried, budget) if tried else None
            risky = memory_of.cheapest_fitting(tried, loose) if tried and tight else chosen  # tight: a faster mode
            if base.zero_stage == 2 and chosen is not None:  # ZeRO-3 (next): only in the modes faster than this one
                tried = modes[:modes.index(chosen)]
            elif base.zero_stage == 3 and chosen is None and risky is None and tried is not modes:
                continue  # it fits only where ZeRO-2 fits, which is faster there
            for mode in dict.fromkeys(m for m in (risky, chosen) if m is not None):
                fits.append((base if mode == base.recompute else _with(base, recompute=mode), memory_of(mode)))
            if chosen is None and risky is None and keep_unfit:
                unfit.append((base if modes[-1] == base.recompute else _with(base, recompute=modes[-1]),
                              memory_of(modes[-1])))
    if top is not None and not keep_unfit:
        out = _top(model, hw, precision, framework, job, fits, memo, top, through)
    else:
        out = Ranked(estimate(model, layout, hw, precision, framework, job, memory, checked=True, memo=memo)
                     for layout, memory in fits + unfit)
    out.sort(key=lambda e: (e.verdict == "does not fit" if tight else not e.fits, e.time.total))
    out.count = len(fits)
    return out


def _top(model: ModelSpec, hw: Hardware, precision: Precision, framework: Framework, job: Job,
         fits: list[tuple[Layout, MemoryBreakdown]], memo: dict, top: int, through: float | None) -> Ranked:
    """The estimates of ``fits`` that :func:`search`'s ``top`` keeps: in the order of their lower bounds, until the
    next bound exceeds both the ``top``-th fastest step time so far (which only falls) and ``through``."""
    bounds = sorted(((lower_bound(model, layout, hw, precision, framework, memo), i) for i, (layout, _) in enumerate(fits)),
                    key=lambda b: b[0])
    out, fastest = Ranked(), []  # fastest: the step times of the first ``top``, sorted
    margin = 1 + 1e-9  # the bound and the step time add the same parts in other orders
    for bound, i in bounds:
        if len(fastest) == top and bound > fastest[-1] * margin and (through is None or bound > through * margin):
            break
        layout, memory = fits[i]
        e = estimate(model, layout, hw, precision, framework, job, memory, checked=True, memo=memo)
        out.append(e)
        if len(fastest) < top or e.time.total < fastest[-1]:
            bisect.insort(fastest, e.time.total)
            del fastest[top:]
    return out


def lower_bound(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, framework: Framework,
                memo: dict | None = None) -> float:
    """Seconds that ``layout``'s step takes at least: the parts of :func:`meshtrain.planner.cost.step_time` that come
    from its micro-batches (compute, tp/sp/ep collectives and pipeline sends, times gradient accumulation) and the
    bubble they leave; the dp communication, the optimizer step and the per-step collectives only add to it."""
    if layout.ps_servers:
        return 0.0
    mb = micro_batch(model, layout, hw, precision, framework, memo)
    m = layout.gradient_accumulation_steps
    return m * (mb.forward + mb.backward + mb.tp + mb.sp + mb.p2p + mb.ep) + bubble_time(layout, mb, framework)


SYNC_FIELDS = ("local_sgd_steps", "diloco_group", "diloco_inner_steps", "diloco_fragments", "diloco_delay",
               "diloco_precision")
"""Layout fields of the sync modes the search never chooses but keeps when ``--fix`` pins them."""


def _with(layout: Layout, **changes: Any) -> Layout:
    """``dataclasses.replace(layout, **changes)`` without its per-call field introspection and ``__init__`` (the
    search makes one per candidate and mode; this is ~5x faster). ``Layout`` is frozen and holds no derived
    state, so a copy of its fields with some changed is that layout."""
    new = object.__new__(Layout)
    new.__dict__.update(layout.__dict__, **changes)
    return new


def states_lower_bound(model: ModelSpec, tp: int, pp: int, shard: int, zero: int, hw: Hardware,
                       precision: Precision, framework: Framework | None = None) -> float:
    """Bytes per device that every layout of these degrees needs at least: the busiest stage's weights,
    gradients and optimizer states, each sharded over the ``shard`` = dp*sp ranks as ZeRO stage ``zero``
    can shard it (Rajbhandari et al. 2020, Sec. 5; gradients counted sharded from stage 2 even where gradient
    accumulation keeps them whole), plus the runtime overhead; no activations, no buffers. A lower bound of
    :func:`meshtrain.planner.memory.memory_breakdown` (``tests/test_planner_search.py`` checks it). A model with
    experts is counted at the largest ep these ranks allow (each ep rank holds E/ep experts). The optimizer's states
    (``framework.optimizer``, AdamW without one) are counted at its fewest per parameter (Muon: all at its own one)."""
    ep = math.gcd(model.experts, shard) if model.experts else 1
    weight_bytes, optimizer_bytes = shard_bytes(precision, framework, zero)  # FSDP's fp32 shards: the masters
    if framework is not None and framework.optimizer.name != "adamw":
        optimizer_bytes = framework.optimizer.fewest_state_bytes(optimizer_bytes)
    p = stage_params_floor(model, tp, pp, ep)  # whatever split and schedule the layouts of these degrees run
    t, weights = p, p * weight_bytes
    if model.adapter_layer_params:  # LoRA: the average rank's adapters train; QLoRA: at most its busiest rank's NF4
        t = model.layers / pp * model.adapter_layer_params / tp
        weights += t * precision.weight_bytes - (math.ceil(model.layers / pp) * model.nf4_layer_params / tp
                                                 * (precision.weight_bytes - NF4_BYTES))
    return (weights / (shard if zero >= 3 else 1) + t * precision.grad_bytes / (shard if zero >= 2 else 1)
            + t * optimizer_bytes / (shard if zero >= 1 else 1) + hw.device.framework_overhead_bytes)
