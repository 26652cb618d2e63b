"""Pipeline schedules: the rules each one sets on a layout, its idle fraction and its activations in flight.

No torch here: config validation, the trainer's report and the planner read the same numbers. ``p``
pipeline ranks, ``m`` micro-batches per step (``gradient_accumulation_steps``), ``v`` chunks per rank
(``virtual_stages``). Bubbles assume every stage takes equally long, a backward twice a forward, and
for the zero-bubble schedules the backward split into equal input-gradient (I) and weight-gradient
(W) halves (the F = I = W case of Qi et al. 2024, arXiv:2401.10241, Sec. 2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleRule:
    """What a schedule needs, in one place (the trainer rejects what torch would reject mid-run)."""

    virtual_stages: str
    """"1", "2" or ">=2": chunks per rank the schedule runs with."""
    microbatches: str
    """"any", ">=p" or "multiple of p"."""
    placement: str = "loop"
    """"loop": chunk c on rank c % p; "v": chunks r and 2p-1-r on rank r."""
    ddp: bool = True
    """Whether it runs under DDP (zero_stage 0 or 1) at dp*sp > 1. Torch 2.13's zero-bubble schedules split
    each backward into an input pass and a weight pass; DDP's reducer does not follow that split (measured:
    step 2's loss is off by 6e-3 at pp = 2, dp = 2), FSDP2 (zero_stage 2 and 3) does (equal to one process)."""
    selective_recompute: bool = True
    """Whether ``train.recompute = "selective"`` runs under it: a zero-bubble weight pass is a second backward
    through each block, which torch 2.13's selective activation checkpointing does not allow."""
    fsdp_zero3: bool = True
    """Whether it runs under zero_stage 3, whose FSDP2 units reshard after each forward. Torch 2.13's zero-bubble
    weight pass (``stage_backward_weight``) writes a block's weight gradients after FSDP2's post-backward of that
    block has run, and its next reshard drops them (measured: every parameter of the last chunk's first block has
    no gradient after the step, at dp 1 and 2, with and without recomputation). zero_stage 2 keeps the units
    unsharded through the step and runs it (torchtitan keeps them unsharded whenever pp > 1)."""


RULES: dict[str, ScheduleRule] = {
    "naive": ScheduleRule("1", "any"),
    "gpipe": ScheduleRule("1", "any"),
    "1f1b": ScheduleRule("1", ">=p"),
    "interleaved-1f1b": ScheduleRule(">=2", "multiple of p"),
    "zero-bubble": ScheduleRule(">=1", "multiple of p", ddp=False, selective_recompute=False, fsdp_zero3=False),
    "zbv": ScheduleRule("2", ">=p", placement="v", ddp=False, selective_recompute=False, fsdp_zero3=False),
}

CHUNKED_SCHEDULES = tuple(name for name, rule in RULES.items() if rule.virtual_stages in ("2", ">=2"))
"""Schedules that run several model chunks per pipeline rank (``virtual_stages`` >= 2): none at pp = 1."""

def runs_with_data_parallel(schedule: str, batch_degree: int, zero_stage: int) -> bool:
    """Whether ``schedule`` runs under the data parallelism of ``zero_stage`` over ``batch_degree`` = dp*sp
    ranks: any schedule without one (``batch_degree`` 1) or under FSDP2's zero_stage 2; under DDP (zero_stage 0, 1)
    the schedules whose rule says ``ddp``; under zero_stage 3 those whose rule says ``fsdp_zero3``, at any
    ``batch_degree`` (FSDP2 wraps a single rank too)."""
    if zero_stage == 3:
        return RULES[schedule].fsdp_zero3
    return batch_degree == 1 or zero_stage >= 2 or RULES[schedule].ddp


def schedule_error(schedule: str, pp: int, virtual_stages: int, microbatches: int, n_layer: int,
                   batch_degree: int = 1, zero_stage: int = 0) -> str | None:
    """The one-line reason ``schedule`` cannot run this pipeline, or None. ``microbatches`` is
    ``batch.gradient_accumulation_steps``; ``batch_degree`` is dp*sp (ranks that each hold other tokens),
    ``zero_stage`` picks their data parallelism (0, 1: DDP; 2, 3: FSDP2)."""
    if schedule not in RULES:
        return f"parallel.pp_schedule = {schedule!r} is not valid: use one of {', '.join(RULES)}"
    rule, v, m = RULES[schedule], virtual_stages, microbatches
    want_v = {"1": v == 1, "2": v == 2, ">=2": v >= 2, ">=1": v >= 1}[rule.virtual_stages]
    if not want_v:
        return (f"parallel.virtual_stages = {v} does not fit pp_schedule = {schedule!r}: it runs "
                f"{rule.virtual_stages.replace('>=', 'at least ')} chunk(s) per rank; set virtual_stages accordingly")
    if rule.microbatches == ">=p" and m < pp:
        return (f"batch.gradient_accumulation_steps = {m} is below pp = {pp}: pp_schedule = {schedule!r} needs at "
                f"least one micro-batch per stage; use gradient_accumulation_steps >= {pp} or pp_schedule = 'gpipe'")
    if rule.microbatches == "multiple of p" and m % pp:
        return (f"batch.gradient_accumulation_steps = {m} is not a multiple of pp = {pp}: pp_schedule = {schedule!r} "
                f"runs micro-batches in rounds of pp; use a multiple of {pp}")
    if zero_stage == 3 and not rule.fsdp_zero3:
        return (f"pp_schedule = {schedule!r} cannot run with zero_stage = 3: FSDP2 reshards each unit after forward, "
                f"and torch 2.13's weight-gradient pass then loses a block's gradients; use zero_stage = 2, or "
                f"pp_schedule = '1f1b' / 'interleaved-1f1b'")
    if not runs_with_data_parallel(schedule, batch_degree, zero_stage):
        return (f"pp_schedule = {schedule!r} cannot run under DDP (zero_stage = {zero_stage}) with dp*sp = "
                f"{batch_degree} > 1: DDP does not follow its split backward; use zero_stage 2 or 3 (FSDP2), "
                f"dp = sp = 1, or pp_schedule = '1f1b' / 'interleaved-1f1b'")
    if pp * v > n_layer:
        return (f"pp * virtual_stages = {pp * v} exceeds model.n_layer = {n_layer}: every pipeline chunk needs a "
                f"block; use fewer stages or more layers")
    return None


def pipeline_error(schedule: str, pp: int, virtual_stages: int, microbatches: int, n_layer: int,
                   batch_degree: int = 1, zero_stage: int = 0) -> str | None:
    """:func:`schedule_error` for a pipeline (pp > 1); at pp = 1 no pipeline runs, and a setting that asks for model
    chunks (``virtual_stages`` > 1, a schedule of :data:`CHUNKED_SCHEDULES`) says something that is not so. The one
    check config validation and the planner both run."""
    if pp > 1:
        return schedule_error(schedule, pp, virtual_stages, microbatches, n_layer, batch_degree, zero_stage)
    if virtual_stages != 1:
        return (f"parallel.virtual_stages = {virtual_stages} needs parallel.pp > 1 (it is 1): set pp >= 2, or "
                f"virtual_stages = 1")
    if schedule in CHUNKED_SCHEDULES:
        return f"parallel.pp_schedule = {schedule!r} needs parallel.pp > 1 (it is 1): set pp >= 2, or pp_schedule = '1f1b'"
    return None


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step of ``schedule`` with equal stage times.

    - naive: ``(p-1)/p`` (one stage busy at a time);
    - gpipe, 1f1b: ``(p-1)/(m+p-1)`` (Huang et al. 2019, arXiv:1811.06965, Sec. 2.3; Narayanan et al. 2021,
      arXiv:2104.04473, Sec. 2.2.1);
    - interleaved-1f1b: ``(p-1)/(v*m+p-1)`` (Narayanan et al. 2021, Sec. 2.2.2);
    - zero-bubble (ZB-H1 per chunk): ``(p-1)(F+I-W)`` idle against ``m(F+I+W)`` busy (Qi et al. 2024,
      Sec. 3.1), ``(p-1)/(3*v*m+p-1)`` at F = I = W;
    - zbv: ``(p-1)(F+I-2W)`` (Qi et al. 2024, Sec. 6): 0 at F = I = W.
    """
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule == "naive":
        return (p - 1) / p
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero-bubble":
        return (p - 1) / (3 * v * m + p - 1)
    if schedule == "zbv":
        return 0.0
    return (p - 1) / (m + p - 1)


def microbatches_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches of one whole stage's activations the first (busiest) rank holds at its peak.

    naive 1; GPipe ``m``; 1F1B, ZB-H1 and ZB-V ``min(m, p)`` (Narayanan et al. 2021, Sec. 2.2.1; Qi et al.
    2024 keep 1F1B's memory); interleaved ``min(m, p + (p-1)/v)`` stage-equivalents (Korthikanti et al.
    2022, arXiv:2205.05198, Sec. 4.2.3).
    """
    p, m, v = pp, microbatches, virtual_stages
    if p == 1 or schedule == "naive":
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved-1f1b", "zero-bubble") and v > 1:
        return min(float(m), p + (p - 1) / v)
    return float(min(m, p))


def loss_rank_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches of one whole stage's activations the rank that computes the loss holds at its peak
    (stage-equivalents, as :func:`microbatches_in_flight`).

    The loss is on the last rank, except under zbv, whose V placement puts the last chunk on rank 0 (Qi et
    al. 2024, Sec. 6), the first rank. naive and 1F1B run each micro-batch's backward right after its
    forward there: 1; GPipe holds all ``m``; the interleaved schedules warm the last rank up with ``(v-1)*p``
    chunk forwards (torch's ``ScheduleInterleaved1F1B``; Narayanan et al. 2021, Sec. 2.2.2), so it holds
    ``((v-1)*p + 1)/v`` stage-equivalents, at most ``m``.
    """
    p, m, v = pp, microbatches, virtual_stages
    if p == 1 or schedule == "zbv":
        return microbatches_in_flight(schedule, p, m, v)
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return min(float(m), ((v - 1) * p + 1) / v)
    return 1.0
