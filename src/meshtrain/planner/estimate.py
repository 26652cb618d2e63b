"""One layout's full prediction: memory, step time, tokens/s, MFU, total training time, batch arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.batch_math import steps_per_epoch, tokens_per_step
from meshtrain.errors import ConfigError
from meshtrain.planner.cost import StepTime, hardware_flops, model_flops, step_time
from meshtrain.planner.hardware import Hardware
from meshtrain.planner.layout import Framework, Layout, divisibility_errors, framework_errors
from meshtrain.planner.memory import (MemoryBreakdown, Precision, memoized, memory_breakdown, memory_range,
                                     memory_verdict)
from meshtrain.planner.model_specs import ModelSpec


@dataclass(frozen=True)
class Job:
    """What to train: samples per step and how much. Give ``num_samples`` (+ ``epochs``), a
    ``token_budget`` (tokens to train on) or ``total_steps``; with none, no total time is predicted."""

    num_devices: int
    global_batch_size: int
    num_samples: int | None = None
    epochs: float | None = None
    token_budget: float | None = None
    total_steps: int | None = None

    def steps(self, seq_len: int) -> int | None:
        """Optimizer steps of the job, or None without a data size. Raises ConfigError for bad sizes.

        ``ceil(token_budget / tokens_per_step)`` (``tokens_per_step = global_batch_size * seq_len``), or
        ``ceil(epochs * ceil(num_samples / global_batch_size))`` (the training-time example of docs/architecture.md;
        both via :mod:`meshtrain.batch_math`).
        """
        if self.total_steps is not None:
            return self.total_steps
        if self.token_budget is not None:
            if self.token_budget <= 0:
                raise ConfigError(f"token budget = {self.token_budget} must be > 0")
            return math.ceil(self.token_budget / tokens_per_step(self.global_batch_size, seq_len))
        if self.num_samples is None:
            return None
        per_epoch = steps_per_epoch(self.num_samples, self.global_batch_size)
        epochs = self.epochs if self.epochs is not None else 1.0
        if epochs <= 0:
            raise ConfigError(f"epochs = {epochs} must be > 0")
        return max(1, math.ceil(round(epochs * per_epoch, 9)))


@dataclass
class Estimate:
    """The prediction for one layout on one device type (per-device figures are for the busiest stage). The rates
    (tokens/s, MFU, TFLOP/s) and the total time are derived from the step's work and time when read."""

    model: ModelSpec
    layout: Layout
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    tokens_per_step: int
    model_flops_per_step: float
    """The model's FLOPs of a step, forward and backward (:func:`meshtrain.planner.cost.model_flops`)."""
    hardware_flops_per_step: float
    """The FLOPs the devices run in a step, recomputation included (:func:`meshtrain.planner.cost.hardware_flops`)."""
    peak_flops: float
    """One device's peak FLOP/s in the compute dtype (MFU's denominator)."""
    total_steps: int | None
    verdict: str = "fits"
    """The memory verdict, "fits", "tight" or "does not fit" (:func:`meshtrain.planner.memory.memory_verdict`: the
    predicted peak's range against the device's memory); ``fits`` is the predicted peak alone against it."""
    memory_range: tuple[float, float] = (0.0, 0.0)
    """Bytes the measured peak should lie in (:func:`meshtrain.planner.memory.memory_range`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.total

    @property
    def mfu(self) -> float:
        """Model FLOPs per second / (world_size * peak FLOP/s of the compute dtype)."""
        return self.model_flops_per_step / self.time.total / (self.layout.world_size * self.peak_flops)

    @property
    def hardware_tflops_per_device(self) -> float:
        return self.hardware_flops_per_step / self.time.total / self.layout.world_size / 1e12

    @property
    def model_tflops_per_device(self) -> float:
        return self.model_flops_per_step / self.time.total / self.layout.world_size / 1e12

    @property
    def total_time_s(self) -> float | None:
        """Seconds of the whole job (``total_steps`` x the step time), None without a data size."""
        return self.total_steps * self.time.total if self.total_steps else None

    def to_dict(self) -> dict:
        """The JSON record of ``meshtrain plan --json``."""
        b = self.layout
        return {**b.to_dict(), "world_size": b.world_size, "global_batch_size": b.global_batch_size,
                "tokens_per_step": self.tokens_per_step,
                "memory_per_device_bytes": int(self.memory.total), "fits": self.fits,
                "memory_verdict": self.verdict, "memory_range_bytes": [int(v) for v in self.memory_range],
                "step_time_s": self.time.total, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "model_tflops_per_device": self.model_tflops_per_device,
                "hardware_tflops_per_device": self.hardware_tflops_per_device,
                "total_steps": self.total_steps, "total_time_s": self.total_time_s,
                "memory_breakdown_bytes": {k: int(v) for k, v in self.memory.to_dict().items()},
                "time_breakdown_s": self.time.to_dict()}


def estimate(model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, framework: Framework,
             job: Job | None = None, memory: MemoryBreakdown | None = None, checked: bool = False,
             memo: dict | None = None) -> Estimate:
    """Predict ``layout``. MFU = model FLOPs per second / (world_size * peak FLOP/s of the compute dtype).
    ``memory``: its :func:`memory_breakdown` when the caller has it; ``checked``: the caller generated the
    layout by the rules (:mod:`meshtrain.planner.search`), so they are not checked again; ``memo``: a dict
    shared by the calls for one model, hardware, precision and framework (:func:`meshtrain.planner.cost.step_time`).

    Raises:
        ConfigError: the layout breaks a divisibility rule or needs a feature the framework lacks
            (all of them listed in one line).
    """
    if not checked:
        errors = divisibility_errors(model, layout, job.global_batch_size if job else None)
        errors += framework_errors(framework, layout, model)
        if errors:
            raise ConfigError(f"layout {layout.label()} is invalid: " + "; ".join(errors))
    mem = memory if memory is not None else memory_breakdown(model, layout, hw, precision, framework)
    t = step_time(model, layout, hw, precision, framework, memo)
    samples = layout.global_batch_size
    tokens, mflops, hflops, steps = memoized(memo, ("step work", samples, layout.recompute, job), _step_work, model,
                                             samples, layout.recompute, framework, job)
    return Estimate(model=model, layout=layout, memory=mem, time=t, fits=mem.total <= hw.device.memory_bytes,
                    tokens_per_step=tokens, model_flops_per_step=mflops, hardware_flops_per_step=hflops,
                    peak_flops=hw.device.peak(precision.compute_dtype), total_steps=steps,
                    verdict=memory_verdict(mem.total, hw.device), memory_range=memory_range(mem.total, hw.device))


def _step_work(model: ModelSpec, samples: int, recompute: str, framework: Framework,
               job: Job | None) -> tuple[int, float, float, int | None]:
    """(tokens, model FLOPs, hardware FLOPs) of a step of ``samples`` sequences and the job's optimizer steps."""
    hflops = hardware_flops(model, samples, recompute, framework.selective, framework.mla_up_proj_recompute)
    return (tokens_per_step(samples, model.seq_len), model_flops(model, samples), hflops,
            job.steps(model.seq_len) if job else None)
