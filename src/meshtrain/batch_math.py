"""Batch arithmetic: global batch, tokens per step, steps per epoch, total training time.

The general form (docs/architecture.md, "Terms")::

    dp                = world_size / (pp * sp * tp)
    global_batch_size = micro_batch_size * gradient_accumulation_steps * dp      [samples / step]
    tokens_per_step   = global_batch_size * seq_len                             [tokens / step]
    steps_per_epoch   = ceil(num_samples / global_batch_size)                   [optimizer steps]
    total_time_s      = total_steps * time_per_step_s                           [seconds]
    lr                = base_lr * (global_batch_size / reference_batch_size) ** k  (k = 1 linear, 1/2 sqrt)

Only the dp factor multiplies the batch: tp, pp and sp ranks work on the *same* samples. The
"sp_size" seed (``(num_gpus / sp_size) * train_sp_batch_size * GA``) and the "training time" seed
(``GA * nnodes * nproc_per_node * micro_batch_size``) are the cases tp=pp=1 and tp=pp=sp=1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshtrain.axes import REPLICA_AXES, product_text, replica_size
from meshtrain.config.sections import LR_SCALINGS
from meshtrain.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of one layout; optional fields are None when their input was not given."""

    world_size: int
    tp: int
    pp: int
    sp: int
    dp: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    seq_len: int | None = None
    tokens_per_step: int | None = None
    num_samples: int | None = None
    steps_per_epoch: int | None = None
    micro_steps_per_epoch: int | None = None
    epochs: float | None = None
    total_steps: int | None = None
    time_per_step_s: float | None = None
    total_time_s: float | None = None
    base_lr: float | None = None
    lr_scaling: str = "none"
    reference_batch_size: int | None = None
    lr: float | None = None
    """Peak learning rate at this global batch (:func:`scaled_lr`)."""
    diloco_workers: int | None = None
    """DiLoCo's workers (``world_size / diloco_group``); the fields below only with them."""
    worker_batch_size: int | None = None
    """Samples one worker takes per inner step, ``global_batch_size / diloco_workers``."""
    diloco_inner_steps: int | None = None
    """H: inner steps between two outer steps."""
    outer_steps: int | None = None
    """``ceil(total_steps / H)``: the exchanges between workers (one fragment's, with Streaming DiLoCo)."""

    def to_dict(self) -> dict:
        return asdict(self)


def data_parallel_size(world_size: int, **degrees: int) -> int:
    """dp = world_size / (pp * sp * tp): the ranks of one replica are the product of the degrees of
    :data:`meshtrain.axes.REPLICA_AXES` (``degrees`` by name, e.g. ``tp=2``; an axis not given is 1).

    Raises:
        ConfigError: a degree < 1, or world_size not divisible by pp*sp*tp.
        TypeError: a keyword that names no replica axis.
    """
    names = [str(a) for a in REPLICA_AXES]
    unknown = sorted(set(degrees) - set(names))
    if unknown:
        raise TypeError(f"data_parallel_size() got degrees of no replica axis: {', '.join(unknown)} (valid: {names})")
    full = {name: degrees.get(name, 1) for name in names}
    for name, value in {"world_size": world_size, **full}.items():
        if value < 1:
            raise ConfigError(f"{name} = {value} must be >= 1")
    inner = replica_size(full)
    if world_size % inner:
        raise ConfigError(f"world_size = {world_size} is not divisible by {product_text(REPLICA_AXES, full)} = {inner}: "
                          f"use a world size that is a multiple of {inner}")
    return world_size // inner


def global_batch_size(micro_batch_size: int, gradient_accumulation_steps: int, dp: int) -> int:
    """Samples per optimizer step = micro_batch_size * gradient_accumulation_steps * dp."""
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size = {micro_batch_size} must be >= 1")
    if gradient_accumulation_steps < 1:
        raise ConfigError(f"gradient_accumulation_steps = {gradient_accumulation_steps} must be >= 1")
    return micro_batch_size * gradient_accumulation_steps * dp


def tokens_per_step(global_batch_size: int, seq_len: int) -> int:
    """Tokens per optimizer step (docs/architecture.md's ``tokens_per_step``) = global_batch_size * seq_len.

    ``global_batch_size``: samples per optimizer step (:func:`global_batch_size`); ``seq_len``: tokens per
    sample (the trainer's ``model.block_size``, the planner's ``ModelSpec.seq_len``).
    """
    return global_batch_size * seq_len


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Optimizer steps to see ``num_samples`` once: ceil(num_samples / global_batch) (last step may be partial)."""
    if num_samples < 1:
        raise ConfigError(f"num_samples = {num_samples} must be >= 1")
    if global_batch < 1:
        raise ConfigError(f"global_batch_size = {global_batch} must be >= 1")
    return math.ceil(num_samples / global_batch)


def scaled_lr(lr: float, global_batch: int, reference_batch_size: int, rule: str) -> float:
    """The learning rate for ``global_batch`` samples per step, given ``lr`` tuned at ``reference_batch_size``.

    - "linear": ``lr * B / B_ref`` -- Goyal et al. 2017 ("Accurate, Large Minibatch SGD", arXiv:1706.02677,
      Sec. 2.1, the linear scaling rule, with gradual warmup, Sec. 2.2): k times the batch averages k
      times the gradients, so k times the step keeps the SGD trajectory while the gradient changes slowly.
    - "sqrt": ``lr * sqrt(B / B_ref)`` -- Krizhevsky 2014 (arXiv:1404.5997, Sec. 5) for SGD: keeps the
      variance of the update constant; Malladi et al. 2022 (arXiv:2205.10287, Sec. 3) derive it as the
      rule for Adam, whose update is normalised by the gradient's second moment.
    - "none": ``lr``.

    Takeaway: linear for SGD up to the "critical" batch, sqrt for Adam(W); both need warmup when the
    scaled rate is large.

    Raises:
        ConfigError: an unknown rule, or a non-positive batch or reference.
    """
    if rule not in LR_SCALINGS:
        raise ConfigError(f"optim.lr_scaling = {rule!r} is not valid: use one of {', '.join(LR_SCALINGS)}")
    if rule == "none":
        return lr
    if global_batch < 1 or reference_batch_size < 1:
        raise ConfigError(f"lr scaling needs global_batch_size = {global_batch} and "
                          f"optim.reference_batch_size = {reference_batch_size} both >= 1")
    ratio = global_batch / reference_batch_size
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def plan_batch(world_size: int, micro_batch_size: int, gradient_accumulation_steps: int = 1, *,
               tp: int = 1, pp: int = 1, sp: int = 1, seq_len: int | None = None,
               num_samples: int | None = None, epochs: float | None = None, total_steps: int | None = None,
               time_per_step_s: float | None = None, lr: float | None = None, lr_scaling: str = "none",
               reference_batch_size: int | None = None, diloco_group: int = 0, diloco_inner_steps: int = 1) -> BatchPlan:
    """Derive the whole :class:`BatchPlan` of a layout.

    Give ``num_samples`` with ``epochs`` (-> total_steps = ceil(epochs * steps_per_epoch)) or with
    ``total_steps`` (-> epochs = total_steps / steps_per_epoch). ``time_per_step_s`` (seconds) gives
    ``total_time_s = total_steps * time_per_step_s``. ``micro_steps_per_epoch`` counts the forward/backward
    passes one dp replica runs per epoch (steps_per_epoch * gradient_accumulation_steps). ``lr`` with
    ``lr_scaling`` and ``reference_batch_size`` gives the scaled peak learning rate (:func:`scaled_lr`).
    ``diloco_group`` > 0 (ranks per DiLoCo worker) with ``diloco_inner_steps`` (H) adds the workers, a worker's
    samples per inner step and the outer steps (a step here is an inner step: every worker takes one).

    Raises:
        ConfigError: non-divisible world size, non-positive sizes, epochs and total_steps both given, or a
            DiLoCo group that does not split the ranks into >= 2 workers of whole replicas.
    """
    dp = data_parallel_size(world_size, tp=tp, pp=pp, sp=sp)
    gbs = global_batch_size(micro_batch_size, gradient_accumulation_steps, dp)
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len = {seq_len} must be >= 1")
    if epochs is not None and total_steps is not None:
        raise ConfigError("give epochs or total_steps, not both")
    if epochs is not None and epochs <= 0:
        raise ConfigError(f"epochs = {epochs} must be > 0")
    if total_steps is not None and total_steps < 1:
        raise ConfigError(f"total_steps = {total_steps} must be >= 1")
    if time_per_step_s is not None and time_per_step_s <= 0:
        raise ConfigError(f"time_per_step = {time_per_step_s} must be > 0 seconds")
    spe, epochs, total_steps = _run_length(num_samples, gbs, epochs, total_steps)
    mspe = spe * gradient_accumulation_steps if spe is not None else None
    total_time = total_steps * time_per_step_s if (total_steps and time_per_step_s) else None
    if lr_scaling != "none" and lr is None:
        raise ConfigError(f"lr scaling '{lr_scaling}' needs the learning rate it scales: give --lr too")
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"lr = {lr} must be a finite number > 0")
    scaled = scaled_lr(lr, gbs, reference_batch_size or 0, lr_scaling) if lr is not None else None
    diloco = {}
    if diloco_group:
        diloco = _diloco(world_size, tp * pp * sp, gbs, total_steps, diloco_group, diloco_inner_steps)
    return BatchPlan(**diloco, world_size=world_size, tp=tp, pp=pp, sp=sp, dp=dp, micro_batch_size=micro_batch_size,
                     gradient_accumulation_steps=gradient_accumulation_steps, global_batch_size=gbs,
                     seq_len=seq_len, tokens_per_step=tokens_per_step(gbs, seq_len) if seq_len else None,
                     num_samples=num_samples, steps_per_epoch=spe, micro_steps_per_epoch=mspe,
                     epochs=float(epochs) if epochs is not None else None, total_steps=total_steps,
                     time_per_step_s=time_per_step_s, total_time_s=total_time, base_lr=lr,
                     lr_scaling=lr_scaling, reference_batch_size=reference_batch_size, lr=scaled)


def _run_length(num_samples: int | None, gbs: int, epochs: float | None,
                total_steps: int | None) -> tuple[int | None, float | None, int | None]:
    """(steps_per_epoch, epochs, total_steps) of :func:`plan_batch`: with ``num_samples``, the one of ``epochs`` and
    ``total_steps`` not given follows from the other (one epoch when neither is); without, they stay as given.

    Raises:
        ConfigError: ``epochs`` without ``num_samples``, or ``num_samples`` < 1."""
    if num_samples is None:
        if epochs is not None:
            raise ConfigError("epochs needs num_samples: give --num-samples too")
        return None, epochs, total_steps
    spe = steps_per_epoch(num_samples, gbs)
    if epochs is not None:
        total_steps = max(1, math.ceil(round(epochs * spe, 9)))  # 1.1 * 100 = 110.00000000000001 in floats
    elif total_steps is not None:
        epochs = total_steps / spe
    else:
        epochs, total_steps = 1.0, spe
    return spe, epochs, total_steps


def _diloco(world_size: int, replica: int, gbs: int, total_steps: int | None, diloco_group: int,
            diloco_inner_steps: int) -> dict[str, int | None]:
    """The DiLoCo fields of :func:`plan_batch`'s :class:`BatchPlan`: workers of ``diloco_group`` ranks (whole replicas
    of ``replica`` = tp*pp*sp ranks), a worker's samples per inner step, H, and the outer steps of ``total_steps``.

    Raises:
        ConfigError: a group that does not split the ranks into >= 2 workers of whole replicas, or H < 1."""
    if diloco_group < 1 or world_size % diloco_group or diloco_group % replica or world_size // diloco_group < 2:
        raise ConfigError(f"diloco_group = {diloco_group} must split world_size = {world_size} into >= 2 workers "
                          f"of whole replicas (a multiple of tp*pp*sp = {replica})")
    if diloco_inner_steps < 1:
        raise ConfigError(f"diloco_inner_steps = {diloco_inner_steps} must be >= 1")
    workers = world_size // diloco_group
    return {"diloco_workers": workers, "worker_batch_size": gbs // workers, "diloco_inner_steps": diloco_inner_steps,
            "outer_steps": math.ceil(total_steps / diloco_inner_steps) if total_steps else None}


@dataclass(frozen=True)
class OpenSoraLog:
    """What Open-Sora-Plan's ``train_t2v_diffusers.py`` logs for an sp layout, next to the real numbers.

    In that code every rank loads ``loader_batch_size`` (b) samples; an all-to-all gives each sp group
    ``sp*b`` samples, run as ``b*sp/train_sp_batch_size`` micro-steps that all count toward gradient
    accumulation (docs/architecture.md). The real samples per optimizer step are
    ``(world/sp) * train_sp_batch_size * GA``; the log prints ``b * world * GA / sp * train_sp_batch_size``
    (a factor b too large) and counts ``len(dataloader) / GA`` updates per epoch, ignoring the inner loop.
    """

    real_global_batch_size: int
    logged_global_batch_size: int
    real_steps_per_epoch: int | None
    logged_steps_per_epoch: int | None
    inner_micro_steps: int
    loader_batch_size: int
    train_sp_batch_size: int
    sp: int
    gradient_accumulation_steps: int

    def to_dict(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        """Plain-words comparison of the log with the real numbers, for ``meshtrain batch``."""
        micro, ga = self.inner_micro_steps, self.gradient_accumulation_steps
        loader_batch_size, train_sp_batch_size, sp = self.loader_batch_size, self.train_sp_batch_size, self.sp
        per_loader = f"{micro / ga:g} optimizer step(s)"
        text = (f"Open-Sora-Plan with loader batch b = {loader_batch_size} per rank: each sp group gathers "
                f"sp*b = {sp * loader_batch_size} samples per loader step and runs them as {micro} micro-steps of "
                f"{train_sp_batch_size} sample(s); each micro-step counts toward gradient_accumulation_steps = {ga}, "
                f"so one loader step makes {per_loader} of global batch {self.real_global_batch_size:,}. "
                f"Its log would print global batch {self.logged_global_batch_size:,} "
                f"(real {self.real_global_batch_size:,})")
        if self.logged_steps_per_epoch is None:
            return text + "; give --num-samples to compare updates per epoch as well."
        return (text + f" and {self.logged_steps_per_epoch:,} updates/epoch "
                f"(real {self.real_steps_per_epoch:,}: it ignores the micro-steps inside a loader step).")


def open_sora_log(world_size: int, sp: int, train_sp_batch_size: int, gradient_accumulation_steps: int,
                  loader_batch_size: int, num_samples: int | None = None) -> OpenSoraLog:
    """Compare the real batch arithmetic of an Open-Sora-Plan sp run with what its log prints.

    Raises:
        ConfigError: ``sp * loader_batch_size`` not divisible by ``train_sp_batch_size``, or bad sizes.
    """
    dp = data_parallel_size(world_size, sp=sp)
    if loader_batch_size < 1:
        raise ConfigError(f"loader_batch_size = {loader_batch_size} must be >= 1")
    real = global_batch_size(train_sp_batch_size, gradient_accumulation_steps, dp)  # checks the sizes first
    if (sp * loader_batch_size) % train_sp_batch_size:
        raise ConfigError(f"sp*loader_batch_size = {sp * loader_batch_size} is not divisible by "
                          f"train_sp_batch_size = {train_sp_batch_size}")
    logged = loader_batch_size * world_size * gradient_accumulation_steps // sp * train_sp_batch_size
    real_spe = steps_per_epoch(num_samples, real) if num_samples else None
    # len(dataloader) per rank = num_samples / (world * b); the code divides that by GA.
    logged_spe = math.ceil(num_samples / (world_size * loader_batch_size) / gradient_accumulation_steps) \
        if num_samples else None
    return OpenSoraLog(real_global_batch_size=real, logged_global_batch_size=logged,
                       real_steps_per_epoch=real_spe, logged_steps_per_epoch=logged_spe,
                       inner_micro_steps=sp * loader_batch_size // train_sp_batch_size,
                       loader_batch_size=loader_batch_size, train_sp_batch_size=train_sp_batch_size, sp=sp,
                       gradient_accumulation_steps=gradient_accumulation_steps)
