"""Software stacks, calibration from one measured run, and the ranges the validation residuals give.

The same device runs the same layout at different speeds under different software (fused kernels, the attention
implementation, overlap options, library generation): the efficiency a published H100 run implies spans 0.36-0.74 of
peak (docs/planner.md, "Stacks and calibration"). The planner models that with one number per stack, a **speed
factor** ``s`` on everything a device computes (:func:`scaled`: the GEMM rate, the element-wise bandwidth and the host
time; communication is left alone): ``s = 1.2`` runs every kernel 1.2x faster than the catalog's constants say.

- A stack is a framework of :data:`meshtrain.planner.layout.FRAMEWORKS`, optionally a version of it, with options
  (:func:`parse_stack`: ``torchtitan+compile``, ``megatron-core@nemo-24.09+no-tp-comm-overlap``); its factor and its
  step-time range come from the shipped table ``data/stacks.toml`` (:func:`speed_for`), which
  :mod:`meshtrain.planner.validate` fits leave-one-source-out on the published runs
  (:func:`meshtrain.planner.validate.fit_stacks`; ``python -m meshtrain.planner.refit`` rewrites it). A stack without runs gets the pooled factor and the pooled, wider range.
- One measured run fits ``s`` to itself (:func:`fit_speed`; ``meshtrain plan --measured`` / ``--calibrate-from``),
  and the range narrows to the spread of calibrated predictions on the published runs.

A range is the signed relative step-time errors ``r = (predicted - measured) / measured`` the held-out predictions
made, ``[r_low, r_high]``: a predicted step time ``t`` says the measured one lies in ``[t / (1 + r_high),
t / (1 + r_low)]`` (:meth:`Speed.step_time_range`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from meshtrain.errors import ConfigError
from meshtrain.planner.hardware import EFFICIENCY_FROM, HOST_KEYS, Hardware
from meshtrain.planner.layout import FRAMEWORKS, Framework
from meshtrain.planner.stacks_table import STACKS_FILE, load_stacks  # noqa: F401 (STACKS_FILE: refit's)

STACK_OPTIONS: dict[str, dict[str, Any]] = {
    "compile": {"eager_elementwise": None},
    "flash": {"attention": "flash"},
    "flash2": {"attention": "flash2"},
    "flash-triton": {"attention": "flash-triton"},
    "materialized": {"attention": "materialized"},
    "tp-comm-overlap": {"tp_comm_overlap": True},
    "no-tp-comm-overlap": {"tp_comm_overlap": False},
    "fused-ce": {"cross_entropy_bytes": 24.0},
    "bf16-ce": {"loss_backward_bytes": 6.0, "loss_parallel_bytes": 6.0},
    "deepep": {"ep_dispatch": "node-limited"},
    "ep-a2a-overlap": {"ep_comm_overlap": True},
    "mla-up-proj-recompute": {"mla_up_proj_recompute": True},
    "norm-recompute": {"norm_recompute": True},
    "moe-act-recompute": {"moe_act_recompute": True},
    "fp8": {"fp8": True, "mixed_precision": "fp8"},
    "dualpipe": {"pp_bubble": "dualpipe"},
    "zb1p": {"pp_bubble": "zb1p"},
}
"""Options a stack adds to its framework, and what each changes in :class:`~meshtrain.planner.layout.Framework`:
``compile`` fuses the element-wise kernels (torch.compile), ``flash``/``flash2``/``flash-triton``/``materialized`` the
attention kernel (``flash2``: FlashAttention-2, below the GEMM rate on Hopper,
:data:`~meshtrain.planner.hardware.FLASH2_HOPPER`; ``flash-triton`` slower still),
``tp-comm-overlap`` hides tp's collectives behind the GEMMs (Megatron-Core ``--tp-comm-overlap``), ``fused-ce`` a
fused cross-entropy (24 bytes per logit, :class:`~meshtrain.planner.layout.Framework`), ``bf16-ce`` the loss on the
16-bit logits without an fp32 copy (``F.cross_entropy`` on bf16: its log-softmax, the log-softmax's gradient and the
logits' gradient at 2 bytes each, 6 bytes per logit held in backward, Megatron-Core's own figure), ``deepep`` the node-limited
dispatch of a mixture of experts (each token once per destination node, ``Framework.ep_dispatch``), ``ep-a2a-overlap``
its dispatch and combine beside other micro-batches' compute (``Framework.ep_comm_overlap``),
``mla-up-proj-recompute`` MLA's latents kept instead of its heads' q, k, v (``Framework.mla_up_proj_recompute``),
``norm-recompute`` and ``moe-act-recompute`` the RMSNorms' outputs and the experts' SwiGLU outputs recomputed in
backward (``Framework.norm_recompute``, ``Framework.moe_act_recompute``), ``fp8`` DeepSeek-V3's FP8 mixed precision
(``Framework.fp8``) and ``dualpipe`` its pipeline schedule's bubble and memory (``Framework.pp_bubble``): together
DeepSeek-V3's recipe (V3 report, Sec. 3.2-3.3); ``zb1p`` the zero-bubble schedule's bubble in a framework of its own
(DeepSeek-V2's HAI-LLM: ZB-H1 under ZeRO-1, which torch's schedules do not run)."""
RUN_RECORD = "plan_vs_actual.json"
"""The record of a finished run ``--calibrate-from RUN_DIR`` reads (:func:`meshtrain.planner.actual.write_plan_vs_actual`)."""
SPEED_BOUNDS = (1 / 20, 20.0)
"""The speed factors :func:`fit_speed` searches: a run 20x off the model is a wrong input, not a stack."""
_TIME_KEYS = tuple(k for k in HOST_KEYS if k.endswith("_s"))


def scaled(hw: Hardware, factor: float) -> Hardware:
    """``hw`` whose device computes ``factor`` times faster: matmul and memory efficiency (and a calibrated CPU's
    measured GEMM and attention tables) times ``factor``, host times divided by it; peaks (MFU's denominator), memory
    and the network unchanged. ``factor`` > 0."""
    d = hw.device

    def table(t: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
        return {dtype: [(k, f * factor) for k, f in rows] for dtype, rows in t.items()}

    host = {k: getattr(d, k) / factor for k in _TIME_KEYS}
    flash2 = None if d.flash2_efficiency is None else d.flash2_efficiency * factor
    return replace(hw, device=replace(d, matmul_efficiency=d.matmul_efficiency * factor,
                                      memory_efficiency=d.memory_efficiency * factor, flash2_efficiency=flash2,
                                      matmul_table=table(d.matmul_table), attention_table=table(d.attention_table),
                                      **host))


def fit_speed(step_time: Callable[[Hardware], float], hw: Hardware, measured_s: float) -> float:
    """The speed factor ``s`` at which ``step_time(scaled(hw, s))`` equals ``measured_s`` (seconds per step).

    Step time falls monotonically with ``s`` (every compute term is divided by it, communication stays), so a bisection
    on ``log s`` over :data:`SPEED_BOUNDS` finds it to 1e-4 relative.

    Raises:
        ConfigError: ``measured_s`` is not reachable at any factor in the bounds (a run more than 20x faster or
            slower than its layout's compute allows, or faster than its communication alone).
    """
    lo, hi = (math.log(b) for b in SPEED_BOUNDS)
    fast, slow = step_time(scaled(hw, SPEED_BOUNDS[1])), step_time(scaled(hw, SPEED_BOUNDS[0]))
    if not fast <= measured_s <= slow:
        raise ConfigError(f"a measured step time of {measured_s:.4g} s is outside what this layout can take on "
                          f"{hw.device.name} at any speed factor in {SPEED_BOUNDS[0]:g}-{SPEED_BOUNDS[1]:g} "
                          f"({fast:.4g}-{slow:.4g} s): check the layout, the model and the measurement")
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        if step_time(scaled(hw, math.exp(mid))) > measured_s:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


@dataclass(frozen=True)
class Speed:
    """A stack's speed factor and the signed step-time errors its held-out predictions made (fractions)."""

    factor: float = 1.0
    low: float = 0.0
    high: float = 0.0
    basis: str = "catalog constants"

    def step_time_range(self, t: float) -> tuple[float, float]:
        """Where a measured step time lies for a predicted ``t`` (seconds): ``(t / (1 + high), t / (1 + low))``."""
        return t / (1 + self.high), t / (1 + self.low)

    def to_dict(self) -> dict[str, Any]:
        """JSON fields (NaN bounds, the uncalibrated CPU's, as null)."""
        return {"speed_factor": self.factor, "step_time_error_range": nulls((self.low, self.high)), "basis": self.basis}


def parse_stack(text: str) -> tuple[str, Framework]:
    """``--stack FRAMEWORK[@VERSION][+OPTION...]`` -> (canonical name, framework with the options applied).

    A version (``megatron-core@nemo-24.09``) changes no fact of the framework, only which fitted speed the stack
    gets: the same framework ran 1.3x apart in two releases (docs/planner.md, "Stacks and calibration").

    Raises:
        ConfigError: an unknown framework or option (with the valid ones), two options that set the same thing
            differently (``flash+flash2``, ``tp-comm-overlap+no-tp-comm-overlap``), or a malformed version.
    """
    head, *options = [p.strip() for p in text.strip().split("+")]
    base, at, version = (part.strip() for part in head.partition("@"))
    if base not in FRAMEWORKS:
        raise ConfigError(f"--stack {text!r}: unknown framework {base!r}: valid are {', '.join(FRAMEWORKS)}")
    if at and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", version):
        raise ConfigError(f"--stack {text!r}: version {version!r} must be letters, digits, '.', '_' or '-' after the "
                          f"'@', e.g. megatron-core@nemo-24.09")
    fw = FRAMEWORKS[base]
    set_by: dict[str, str] = {}
    for option in options:
        if option not in STACK_OPTIONS:
            raise ConfigError(f"--stack {text!r}: unknown option {option!r}: valid are {', '.join(STACK_OPTIONS)}")
        for field_name, value in STACK_OPTIONS[option].items():
            other = set_by.setdefault(field_name, option)
            if STACK_OPTIONS[other][field_name] != value:
                raise ConfigError(f"--stack {text!r}: options {other!r} and {option!r} contradict each other (each sets "
                                  f"the {field_name.replace('_', ' ')} its own way): keep one of them")
        fw = replace(fw, **STACK_OPTIONS[option])
    name = "+".join([f"{base}@{version}" if at else base, *sorted(set(options))])
    return name, replace(fw, name=name) if name != base else fw


def speed_for(stack: str, device: str, table: dict[str, Any] | None = None, peak_source: str = "datasheet") -> Speed:
    """The fitted speed of ``stack`` on ``device`` (a device type or the one whose constants it shares,
    :data:`meshtrain.planner.hardware.EFFICIENCY_FROM`): its exact name, else without its options, else its framework's
    without a version; else the pooled one (a stack no published run used on that device: factor 1, the range of every
    held-out prediction).

    A CPU (``device`` "cpu..."): factor 1 and, for a calibrated profile (``peak_source`` not "assumed"), the range
    ``bench/plan_vs_actual.py`` measured on this project's machine (table ``cpu``); the uncalibrated reference profile
    (:data:`meshtrain.planner.hardware.CPU_REFERENCE`) has no range (NaN: its error on another machine is unknown)."""
    table = load_stacks() if table is None else table
    if device.startswith("cpu"):
        if peak_source == "assumed":
            return Speed(1.0, math.nan, math.nan, "uncalibrated cpu (the reference machine's profile), no range: run "
                                                   "meshtrain plan --calibrate, or --calibrate-from a run of this machine")
        cpu = table.get("cpu", {"low": math.nan, "high": math.nan})
        return Speed(1.0, cpu["low"], cpu["high"], "calibrated cpu profile: the errors bench/plan_vs_actual.py measured")
    fitted = table.get("stack", {})
    group = EFFICIENCY_FROM.get(device, device)
    versioned = stack.split("+")[0]
    for key in dict.fromkeys((f"{stack}/{group}", f"{versioned}/{group}", f"{versioned.split('@')[0]}/{group}")):
        if key in fitted:
            s = fitted[key]
            return Speed(s["factor"], s["low"], s["high"],
                         f"stack {key}: {s['runs']} published runs from {s['sources']} source(s), held out by source")
    pooled = table.get("pooled", {"low": 0.0, "high": 0.0})
    return Speed(1.0, pooled["low"], pooled["high"], f"stack {stack} has no published run on {group}: pooled range")


def calibrated_speed(factor: float, what: str, device: str = "", table: dict[str, Any] | None = None) -> Speed:
    """The speed fitted to one measured run (``what`` names it), with the calibrated range of the published runs
    (each source calibrated on its first run, its other runs predicted); on a CPU the range of
    ``bench/plan_vs_actual.py`` (its layouts' errors, each against the same calibrated profile)."""
    table = load_stacks() if table is None else table
    spread = table.get("cpu" if device.startswith("cpu") else "calibrated", {"low": math.nan, "high": math.nan})
    return Speed(factor, spread["low"], spread["high"], f"calibrated on {what}")


def write_stacks(fit: dict[str, Any], path: Path = STACKS_FILE) -> None:
    """Write ``fit`` (:func:`meshtrain.planner.validate.fit_stacks`) as the TOML of :func:`load_stacks`."""
    lines = ["# Written by `python -m meshtrain.planner.refit` from planner/data/published_runs.toml:",
             "# per stack the median speed factor of its runs and the [low, high] signed step-time errors of its",
             "# runs predicted leave-one-source-out (docs/planner.md, \"Stacks and calibration\").", ""]
    for section in ("pooled", "calibrated", "memory", "cpu"):
        if section not in fit:
            continue
        lines += [f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in fit[section].items()] + [""]
    for name, s in fit["stack"].items():
        lines += [f'[stack."{name}"]'] + [f"{k} = {_toml(v)}" for k, v in s.items()] + [""]
    path.write_text("\n".join(lines))


def _toml(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def nulls(values: Any) -> list[float | None]:
    """``values`` as a JSON list, a NaN or infinite bound (no range: the uncalibrated CPU's) as null."""
    return [x if math.isfinite(x) else None for x in values]


def layout_speed(model: Any, layout: Any, hw: Hardware, precision: Any, framework: Framework, measured_s: float) -> float:
    """:func:`fit_speed` of one layout's step time (:func:`meshtrain.planner.cost.step_time`) to ``measured_s``."""
    from meshtrain.planner.cost import step_time

    return fit_speed(lambda h: step_time(model, layout, h, precision, framework).total, hw, measured_s)


def estimate_ranges(e: Any, speed: Speed) -> dict[str, list[float]]:
    """Ranges of an :class:`~meshtrain.planner.estimate.Estimate`'s step time, tokens/s, MFU, total time (seconds)
    and peak memory per device (bytes), from ``speed``'s step-time errors and the estimate's own memory range
    (:func:`meshtrain.planner.memory.memory_range`, which widens it on a device never validated): each
    ``[low, high]`` where the measured value would lie if this prediction errs as the held-out ones did."""
    lo, hi = speed.step_time_range(e.time.total)
    out = {"step_time_range_s": [lo, hi], "tokens_per_s_range": [e.tokens_per_step / hi, e.tokens_per_step / lo],
           "mfu_range": [e.mfu * e.time.total / hi, e.mfu * e.time.total / lo],
           "memory_range_bytes": list(e.memory_range)}
    if e.total_steps:
        out["total_time_range_s"] = [e.total_steps * lo, e.total_steps * hi]
    return {k: nulls(v) for k, v in out.items()}


def parse_measured(text: str) -> tuple[dict[str, Any], str, float]:
    """``--measured "tp=8,pp=4,micro_batch_size=1,step_time_s=12.9"`` -> (layout fields, measurement key, value).

    The measurement is one of :data:`MEASURED_KEYS`; the other items are layout fields as ``--fix`` takes them.

    Raises:
        ConfigError: no measurement, two of them, a value that is not a number > 0 or an MFU over 100% (the layout
            fields are checked by :func:`meshtrain.planner.layout.parse_fix`; what the measurement implies for the
            layout, by :func:`check_measured`).
    """
    from meshtrain.planner.layout import parse_fix

    items = [p.strip() for p in text.split(",") if p.strip()]
    found = [p for p in items if p.split("=")[0].strip() in MEASURED_KEYS]
    if len(found) != 1:
        keys = [p.split("=")[0].strip() for p in found]
        given = ("has no measurement" if not keys else f"gives {keys[0]} {len(keys)} times" if len(set(keys)) == 1
                 else f"gives {' and '.join(dict.fromkeys(keys))}")
        raise ConfigError(f"--measured {text!r} {given}: give exactly one of {', '.join(MEASURED_KEYS)} "
                          f"(e.g. --measured tp=8,pp=4,step_time_s=12.9)")
    key, _, value = (part.strip() for part in found[0].partition("="))
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise ConfigError(f"--measured {key} = {value!r} must be a number > 0")
    if key == "mfu_percent" and number > 100:
        raise ConfigError(f"--measured mfu_percent = {value} is over 100: MFU is the percentage of the devices' peak "
                          f"FLOP/s a run reaches; give a value in (0, 100] (e.g. mfu_percent=41.5)")
    return parse_fix(",".join(p for p in items if p is not found[0]), "--measured"), key, number


MEASURED_KEYS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu_percent")
"""What ``--measured`` takes: seconds per optimizer step, tokens per second of the whole job or per device, or MFU
in percent (against the device's datasheet peak, model FLOPs as :func:`meshtrain.planner.cost.model_flops`)."""


def measured_step_time(key: str, value: float, e: Any) -> float:
    """The step time (seconds) a measurement of ``key`` implies for the layout of estimate ``e`` (same batch)."""
    if key == "step_time_s":
        return value
    if key == "tokens_per_s":
        return e.tokens_per_step / value
    if key == "tokens_per_s_per_gpu":
        return e.tokens_per_step / (value * e.layout.world_size)
    return e.time.total * e.mfu / (value / 100)  # mfu_percent


WORK_PARTS = ("compute", "bubble", "optimizer")
"""The parts of a :class:`~meshtrain.planner.cost.StepTime` a speed factor divides (the rest is communication)."""


def breakdown_speed(parts: dict[str, float], measured_s: float) -> float:
    """The speed factor ``s`` at which a predicted step's :data:`WORK_PARTS` (seconds, from
    :meth:`~meshtrain.planner.cost.StepTime.to_dict`, ``total`` included) divided by ``s``, plus its communication as
    predicted, equal ``measured_s``; NaN where the measured time is not above that communication (nothing to calibrate
    the compute with)."""
    work = sum(float(parts[k]) for k in WORK_PARTS)
    comm = float(parts["total"]) - work
    return work / (measured_s - comm) if measured_s > comm and work > 0 and math.isfinite(measured_s) else math.nan


def run_dir_speed(run_dir: Path, plan_device: str | None = None) -> tuple[float, str]:
    """The speed factor a finished meshtrain run implies: from its ``plan_vs_actual.json`` (the prediction for its own
    layout and the step time it measured), the ``s`` at which the predicted compute, bubble and optimizer times
    divided by ``s`` plus the predicted communication equal the measured step time (the communication a CPU rank
    cannot overlap is kept as predicted). Returns (factor, description). ``plan_device``: the device type of the plan
    it calibrates (a run on a CPU calibrates a CPU plan only, a run on a GPU a GPU plan only).

    Raises:
        ConfigError: no ``plan_vs_actual.json``, one that is not a regular file of a record's size
            (:func:`meshtrain.fileio.read_checked`), not JSON, a field missing or out of range, a measured time
            not above the predicted communication alone or implying a speed factor outside :data:`SPEED_BOUNDS`,
            or a run on another kind of device than ``plan_device``.
    """
    import json

    from meshtrain.fileio import read_text_checked

    path = Path(run_dir) / RUN_RECORD
    fix = "give --calibrate-from the --out folder of a finished meshtrain train run, or re-run it to write it again"
    text = read_text_checked(path, "run record", fix, missing_ok=True)
    if text is None:
        raise ConfigError(f"--calibrate-from {run_dir}: no {RUN_RECORD} there: give the --out folder of a finished "
                          f"meshtrain train run")
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"run record '{path}' is not JSON ({e}): {fix}") from None
    parts, measured, layout, device = _record_fields(data, path, fix)
    factor = breakdown_speed(parts, measured)
    if math.isnan(factor):
        comm = parts["total"] - sum(parts[k] for k in WORK_PARTS)
        raise ConfigError(f"--calibrate-from {run_dir}: the measured step time {measured:.4g} s of its {RUN_RECORD} is "
                          f"not above the predicted communication {comm:.4g} s: nothing to calibrate the compute with")
    if not SPEED_BOUNDS[0] <= factor <= SPEED_BOUNDS[1]:
        raise ConfigError(f"--calibrate-from {run_dir}: the measured step time {measured:.4g} s of its {RUN_RECORD} "
                          f"against the predicted {parts['total']:.4g} s implies a speed factor of {factor:.3g}, outside "
                          f"{SPEED_BOUNDS[0]:g}-{SPEED_BOUNDS[1]:g}: the record is damaged, or something else slowed "
                          f"the run (re-run it on an idle machine)")
    if plan_device is not None and device is not None and device != device_kind(plan_device):
        ran, other = (("a CPU", "a run on that GPU (or --measured), or plan for --gpu cpu") if device == "cpu" else
                      ("a GPU", "a run on this CPU, or plan for the run's GPU with --gpu"))
        raise ConfigError(f"--calibrate-from {run_dir}: its {RUN_RECORD} is of a run on {ran}, and this plan is for "
                          f"{plan_device}: one kind of device's speed says nothing of another's; calibrate from {other}")
    return factor, f"{run_dir} ({layout}, {measured:.4g} s/step measured)"


def device_kind(device: str) -> str:
    """``"cpu"`` for a CPU device type of the catalog (``cpu``, ``cpu-4threads``), else ``"cuda"``."""
    return "cpu" if device.startswith("cpu") else "cuda"


def _record_fields(data: Any, path: Path, fix: str) -> tuple[dict[str, float], float, str, str | None]:
    """(time breakdown, measured step time, layout label, device kind or None) of a run record, each checked. The
    device is the record's ``predicted.device``, or for a record written before that field its hardware description
    (``catalog H100-...`` on a GPU, a cpu profile on a CPU); None where neither tells."""
    def bad(key: str, value: Any, want: str) -> ConfigError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return ConfigError(f"run record '{path}': '{key}' = {shown} must be {want}: {fix}")

    def seconds(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf

    predicted = data.get("predicted") if isinstance(data, dict) else None
    if not isinstance(predicted, dict):
        raise bad("predicted", predicted, "a table (the planner's prediction for the run)")
    parts = predicted.get("time_breakdown_s")
    if not isinstance(parts, dict):
        raise bad("predicted.time_breakdown_s", parts, f"a table of seconds with {', '.join(WORK_PARTS)} and total")
    for key, value in ({k: None for k in (*WORK_PARTS, "total")} | parts).items():
        if not seconds(value) or (key == "total" and not value):
            raise bad(f"predicted.time_breakdown_s.{key}", value, f"a number of seconds {'>' if key == 'total' else '>='} 0")
    measured = data.get("measured")
    if not isinstance(measured, dict):
        raise bad("measured", measured, "a table (what the run measured)")
    step = measured.get("step_time_s")
    if not seconds(step) or not step:
        raise bad("measured.step_time_s", step, "a number of seconds > 0")
    layout = predicted.get("layout", "?")
    if not isinstance(layout, str):
        raise bad("predicted.layout", layout, "a layout label such as 'dp2 tp1 pp1 sp1 z0 mbs4 ga1 none'")
    device = predicted.get("device")
    if device is None:
        profile = predicted.get("profile")
        device = None if not isinstance(profile, str) else "cuda" if profile.startswith("catalog ") else (
            "cpu" if "cpu" in profile else None)
    elif device not in ("cpu", "cuda"):
        raise bad("predicted.device", device, "'cpu' or 'cuda'")
    return {k: float(v) for k, v in parts.items()}, float(step), layout, device



MEASURED_UNITS = {"step_time_s": "seconds per optimizer step", "tokens_per_s": "tokens per second of the whole job",
                  "tokens_per_s_per_gpu": "tokens per second of one device", "mfu_percent": "percent of peak"}


def _measured_value(key: str, seconds: float, e: Any) -> float:
    """The value of ``key`` a step time of ``seconds`` means for the layout of estimate ``e`` (the inverse of
    :func:`measured_step_time`)."""
    return {"step_time_s": seconds, "tokens_per_s": e.tokens_per_step / seconds,
            "tokens_per_s_per_gpu": e.tokens_per_step / (seconds * e.layout.world_size),
            "mfu_percent": e.time.total * e.mfu / seconds * 100}[key]


def measured_speed(key: str, value: float, e: Any, model: Any, hw: Hardware, precision: Any,
                   framework: Framework) -> tuple[float, float]:
    """(speed factor, step time in seconds) of ``--measured KEY=VALUE`` for the layout of estimate ``e``.

    A measurement is possible when its step time lies between the fastest one allowed, the larger of the layout's
    time at the top of :data:`SPEED_BOUNDS` and its time at 100% MFU (its model FLOPs at the devices' peak), and its
    time at the bottom of the bounds (:func:`fit_speed`).

    Raises:
        ConfigError: a measurement outside that range, with the range in ``key``'s own unit.
    """
    from meshtrain.planner.cost import step_time

    seconds = measured_step_time(key, value, e)
    layout_time = lambda h: step_time(model, e.layout, h, precision, framework).total  # noqa: E731
    fastest = max(layout_time(scaled(hw, SPEED_BOUNDS[1])), e.time.total * e.mfu)
    slowest = layout_time(scaled(hw, SPEED_BOUNDS[0]))
    if not fastest <= seconds <= slowest:
        mfu = e.time.total * e.mfu / seconds
        means = (f"faster than the devices' peak ({mfu:.3g}x it)" if mfu > 1 else
                 f"{'faster' if seconds < fastest else 'slower'} than any speed factor in "
                 f"{SPEED_BOUNDS[0]:g}-{SPEED_BOUNDS[1]:g} makes this layout")
        low, high = sorted((_measured_value(key, fastest, e), _measured_value(key, slowest, e)))
        raise ConfigError(f"--measured {key} = {value:g} is not possible for {e.layout.label()} of {model.name} on "
                          f"{e.layout.world_size} x {hw.device.name}: a step of {seconds:.4g} s is {means}; for this "
                          f"layout give {key} in {low:.4g}-{high:.4g} ({MEASURED_UNITS[key]}), or check the layout "
                          f"fields")
    return fit_speed(layout_time, hw, seconds), seconds
