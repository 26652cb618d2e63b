"""``meshtrain train CONFIG --layout auto``: the planner picks the layout, the trainer runs it.

The search is ``meshtrain plan CONFIG --num-gpus N``'s (:func:`meshtrain.planner.search.search`) for the
ranks of the command line (``--nproc`` x ``--nnodes``), on the hardware the run will use (the GPU's catalog
entry, or this CPU's calibrated profile with the node's available memory shared by its ranks), keeping the
config's global batch. It chooses dp, tp, pp, sp, ep (experts), zero stage, micro-batch size, gradient accumulation,
recompute mode, pipeline schedule and virtual stages; layout keys given on the command line (``--tp 2``,
``--parallel.zero_stage 3``, ``--train.recompute full``) are pinned, not searched. The choice becomes
config overrides (:meth:`meshtrain.planner.layout.Layout.to_overrides`) set on the launcher's config, which is
resolved once and handed to the ranks (:mod:`meshtrain.resolved`), so the ranks, the memory check and
``plan_vs_actual.json`` see exactly the layout the planner ranked. Every layout the search may return is one
the trainer runs (the planner and config validation read the same rules, :mod:`meshtrain.rules`;
``tests/test_planned_layouts.py`` trains them).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from dataclasses import dataclass, replace

from meshtrain.axes import SHORT_FLAGS
from meshtrain.batch_math import global_batch_size
from meshtrain.config.checks import resolve_world
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.planner.estimate import Estimate
from meshtrain.planner.stack import Speed

PINNABLE = {**{key: axis for axis, key in SHORT_FLAGS.items()},
            "parallel.zero_stage": "zero_stage", "batch.micro_batch_size": "micro_batch_size",
            "batch.gradient_accumulation_steps": "gradient_accumulation_steps", "train.recompute": "recompute",
            "parallel.pp_schedule": "pp_schedule", "parallel.virtual_stages": "virtual_stages",
            "parallel.tp_sequence_parallel": "tp_sequence_parallel", "parallel.sp_mode": "sp_mode",
            "parallel.sp_ulysses": "sp_ulysses",
            "parallel.hierarchical_allreduce": "hierarchical_allreduce"}
"""Command-line override keys that pin a :class:`~meshtrain.planner.layout.Layout` field of the search."""


@dataclass(frozen=True)
class Choice:
    """What ``--layout auto`` chose: the fastest layout that fits, the next one, and how many fit."""

    best: Estimate
    runner_up: Estimate | None
    fitting: int
    global_batch_size: int
    memory_per_rank_bytes: float
    hardware: str
    speed: Speed | None = None
    """The speed factor the layouts were ranked at and its step-time range (:mod:`meshtrain.planner.stack`)."""

    sequences_per_sample: int = 1
    """2 for DPO: the layouts' micro-batches are in sequences, the config's in pairs."""

    def overrides(self) -> dict[str, str]:
        """The ``section.key`` -> value overrides that run :attr:`best` (``parallel.dp`` included; the micro-batch
        in the config's samples: DPO's pairs)."""
        out = self.best.layout.to_overrides()
        key = "batch.micro_batch_size"
        return out | {key: str(int(out[key]) // self.sequences_per_sample)} if key in out else out

    def lines(self) -> list[str]:
        """The few lines the launcher prints: the choice, the runner-up, and why the one beat the other."""
        b = self.best
        unit = " pairs, micro-batches below in sequences" if self.sequences_per_sample > 1 else ""
        head = (f"layout auto: {b.layout.world_size} ranks, global batch {self.global_batch_size}{unit} (the config's), "
                f"{self.fitting} layout(s) fit in {self.memory_per_rank_bytes / 2**30:,.2f} GiB per rank "
                f"({self.hardware})")
        out = [head, f"  chosen:    {_summary(b)}"]
        if self.runner_up is not None:
            out.append(f"  runner-up: {_summary(self.runner_up)}")
            out.append(f"  why: {reason(b, self.runner_up)}{self._overlap()}")
        else:
            out.append("  why: the only layout that fits")
        return out


    def _overlap(self) -> str:
        """``"; within the chosen one's range ..."`` when the runner-up's predicted step time lies inside the range
        of the chosen one's (the ranking is then within the planner's measured error), else nothing."""
        if self.speed is None or self.runner_up is None:
            return ""
        low, high = self.speed.step_time_range(self.best.time.total)
        if math.isnan(high) or self.runner_up.time.total > high:
            return ""
        return (f"; within the chosen one's range ({low:.4g}-{high:.4g} s/step, {self.speed.basis}), so the two "
                f"may swap in practice")


def _summary(e: Estimate) -> str:
    return (f"{e.layout.label()}: {e.time.total:.4g} s/step, {e.memory.total / 2**30:,.2f} GiB/rank predicted")


def reason(best: Estimate, other: Estimate) -> str:
    """One clause saying where ``other`` loses time to ``best``: the step-time terms
    (:class:`meshtrain.planner.cost.StepTime`, seconds) that grow most from ``best`` to ``other``."""
    a, b = best.time.to_dict(), other.time.to_dict()
    a.pop("total"), b.pop("total")
    deltas = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    total = other.time.total - best.time.total
    grew = [f"{k.replace('_', ' ')} +{d * 1e3:.3g} ms" for d, k in deltas[:2] if d > 0]
    gains = [f"{k.replace('_', ' ')} {d * 1e3:.3g} ms" for d, k in deltas[::-1][:1] if d < 0]
    text = f"the runner-up is {total / best.time.total:+.1%} per step"
    if grew:
        text += f" ({', '.join(grew)}" + (f"; {gains[0]}" if gains else "") + ")"
    return text


def config_global_batch(cfg: Config, world: int) -> int:
    """The global batch the config trains with on ``world`` ranks: ``micro_batch_size *
    gradient_accumulation_steps * dp`` of its own layout (:func:`meshtrain.config.checks.resolve_world`).

    Raises:
        ConfigError: the config's layout does not suit ``world`` ranks, so it names no global batch there.
    """
    try:
        _, dp = resolve_world(cfg, world, schedule=False)  # the split is the planner's to choose
    except ConfigError as e:
        raise ConfigError(f"--layout auto keeps the config's global batch (micro_batch_size * "
                          f"gradient_accumulation_steps * dp), but the config's own layout names none on {world} "
                          f"ranks ({e}); set parallel.dp (or --dp) so that it does") from None
    return global_batch_size(cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps, dp)


def pinned(overrides: dict[str, str]) -> dict:
    """Layout fields the command line fixes (``{"tp": 2}`` for ``--tp 2``), typed as :class:`Layout`'s.

    Raises:
        ConfigError: a pinned value that is not of the field's type.
    """
    from meshtrain.planner.layout import parse_fix

    return parse_fix(",".join(f"{PINNABLE[k]}={v}" for k, v in overrides.items() if k in PINNABLE))


def choose_layout(cfg: Config, world: int, nproc: int, threads: int, fixed: dict,
                  calibrate_from: Path | None = None) -> Choice:
    """The fastest layout for ``cfg`` on ``world`` ranks (``nproc`` per node) that fits the devices' memory.

    On CUDA the planner's catalog entry of the GPU (:func:`meshtrain.planner.actual.hardware_for_run`) and its
    memory; on the CPU the calibrated profile for ``threads`` torch threads per rank and the node's available
    memory (:func:`meshtrain.launch.checks.available_memory`) shared by ``nproc`` ranks, less the corpus each
    rank loads. The precision is the config's ``train.dtype`` on that device. ``calibrate_from``: a finished run's
    folder whose measured speed scales the device's compute (:func:`meshtrain.planner.stack.run_dir_speed`).

    Raises:
        ConfigError: a model or sync mode the planner does not model, a global batch no layout can split, or
            no layout that fits (with the smallest one's memory).
    """
    _check_plannable(cfg)
    from meshtrain.launch.checks import available_memory
    from meshtrain.planner.actual import corpus_rss_bytes, hardware_for_run
    from meshtrain.planner.estimate import Job
    from meshtrain.planner.hardware import DEFAULT_PROFILE
    from meshtrain.planner.layout import meshtrain_framework, sequences_per_sample
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import corpus_vocab_size, from_config
    from meshtrain.planner.search import search
    from meshtrain.runtime.device import compute_dtype

    gbs = config_global_batch(cfg, world)
    spp = sequences_per_sample(cfg)  # DPO: the planner counts a pair's two sequences
    if "micro_batch_size" in fixed:
        fixed = fixed | {"micro_batch_size": fixed["micro_batch_size"] * spp}
    what, available = available_memory()
    device = "cuda" if what == "GPU" else "cpu"
    hw, description = hardware_for_run(device, DEFAULT_PROFILE, threads)
    from meshtrain.planner.stack import calibrated_speed, run_dir_speed, scaled, speed_for

    framework = meshtrain_framework(cfg, device)
    speed = speed_for(framework.name, hw.device.name, peak_source=hw.device.peak_source)
    if calibrate_from is not None:
        factor, what = run_dir_speed(calibrate_from)
        hw, description = scaled(hw, factor), f"{description}, speed x{factor:.3g} calibrated on {what}"
        speed = calibrated_speed(factor, what, hw.device.name)
    per_rank = available if device == "cuda" else available / nproc - corpus_rss_bytes(cfg, DEFAULT_PROFILE)
    hw = replace(hw, device=replace(hw.device, memory_bytes=per_rank))
    model = from_config(cfg, cfg.model.vocab_size or corpus_vocab_size(cfg))
    precision = PRECISIONS["bf16-autocast" if compute_dtype(cfg.train.dtype, device) == "bfloat16" else "fp32"]
    job = Job(world, gbs * spp, total_steps=cfg.train.steps)
    fitting = search(model, hw, precision, framework, job, fixed=fixed, top=2)  # the choice and its runner-up
    if not fitting:
        unfit = search(model, hw, precision, framework, job, fixed=fixed, keep_unfit=True)
        raise _no_fit(unfit, fixed, world, gbs, per_rank)
    return Choice(fitting[0], fitting[1] if len(fitting) > 1 else None, fitting.count, gbs, per_rank, description,
                  speed, spp)


def _check_plannable(cfg: Config) -> None:
    """Raises ConfigError: a run ``--layout auto`` does not plan (a family without a planner model, a sync mode other
    than "sync")."""
    if cfg.model.family().planner is None:
        raise ConfigError(f"--layout auto plans transformers: model.type = {cfg.model.type!r} has no planner model; "
                          f"give the layout in the config")
    if cfg.parallel.sync_mode != "sync":
        raise ConfigError(f"--layout auto plans synchronous training: parallel.sync_mode = "
                          f"{cfg.parallel.sync_mode!r}; use sync_mode = 'sync' or give the layout in the config")


def _no_fit(unfit: list, fixed: dict, world: int, gbs: int, per_rank: float) -> ConfigError:
    """Why no layout fits: none splits the batch and meets the rules (``unfit`` empty), or the smallest of ``unfit``
    (every valid layout, fitting or not) needs more than ``per_rank`` bytes."""
    pins = f" with {', '.join(f'{k}={v}' for k, v in fixed.items())} pinned" if fixed else ""
    if not unfit:
        return ConfigError(f"--layout auto: no layout of this model on {world} ranks{pins} splits the global batch "
                           f"{gbs} (micro_batch_size * gradient_accumulation_steps * dp) and meets the divisibility "
                           f"rules; change the batch, the ranks or the pins")
    smallest = min(unfit, key=lambda e: e.memory.total)
    return ConfigError(f"--layout auto: no layout on {world} ranks{pins} fits in {per_rank / 2**30:,.2f} GiB per "
                       f"rank; the smallest ({smallest.layout.label()}) needs {smallest.memory.total / 2**30:,.2f} "
                       f"GiB: add ranks, shrink the model or the batch")


def apply(cfg: Config, overrides: dict[str, str], world: int, nproc: int, threads: int,
          calibrate_from: Path | None = None) -> dict[str, str]:
    """Choose the layout (:func:`choose_layout`, the command line's layout keys in ``overrides`` pinned),
    print the choice to stderr, and return the overrides that run it."""
    choice = choose_layout(cfg, world, nproc, threads, pinned(overrides), calibrate_from)
    print("\n".join(choice.lines()), file=sys.stderr)
    return choice.overrides()

