"""Predict published training runs from their configuration and compare with what they measured.

Input schema (``meshtrain/planner/data/published_runs.toml``, the default of ``plan --validate``): ``[[run]]`` tables with ``name``, ``source``,
``gpu``, ``num_gpus``, ``model = {layers, hidden, heads, vocab, seq_len, [ffn_hidden, kv_heads]}``,
``layout = {tp, pp, dp, global_batch_size, [micro_batch_size, gradient_accumulation_steps, recompute,
zero_stage, pp_schedule]}`` and ``measured = {...}`` with one or more of ``tflops_per_gpu`` (+
``tflops_per_gpu_kind`` "hardware" or "model"), ``percent_of_peak``, ``mfu_percent``,
``tokens_per_s_per_gpu``, ``iteration_time_s`` (seconds per optimizer step of the whole global batch)
and ``peak_memory_gib`` (peak memory per GPU as the source reports it: compared with the planner's peak,
never used to fit), or ``out_of_memory = true`` alone (the source says the run did not fit); any other key is
an error. Every run is also a verdict: one that measured something trained, so it fit (:func:`fit_verdicts`).

Honest errors (docs/planner.md, "Validation"): the only constant fitted to these runs is each device's
``matmul_efficiency`` (:func:`fit_matmul_efficiency`). Next to the in-sample errors (catalog constants)
:func:`leave_one_source_out` refits it without each source (paper or recipe) and predicts that source.

Uniform rules for what a run does not state (docs/planner.md, "Validation"):

- layout fields a run leaves out are chosen by the planner's own search: the fastest layout that fits,
  with every stated field fixed (what a user of ``meshtrain plan`` would get);
- ``tflops_per_gpu`` without a kind is model FLOPs (Megatron-LM's ``num_floating_point_operations``
  counts no recomputation); ``percent_of_peak`` uses the same kind as ``tflops_per_gpu``;
- the software stack is read from the source: Narayanan et al. 2021 -> ``megatron-2021``,
  Megatron-Core -> ``megatron-core``, llm-foundry (FSDP) -> ``fsdp``; a run may name ``framework`` (or ``stack``)
  and ``attention``, the kernel its software version ran (``"flash2"``: FlashAttention-2);
- mixed precision is the framework's: fp16 with fp16 gradients for ``megatron-2021`` (Narayanan et al.
  trained in fp16), bf16 with fp32 gradients otherwise; Adam states in fp32.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from meshtrain.config.load import read_toml
from meshtrain.errors import ConfigError
from meshtrain.planner.estimate import Estimate, Job
from meshtrain.planner.hardware import EFFICIENCY_FROM, GiB, Hardware, get_hardware, network_with
from meshtrain.planner.hardware import PUBLISHED_RUNS as PUBLISHED_RUNS  # shipped runs: re-exported, read here
from meshtrain.planner.layout import ATTENTION_KERNELS, FRAMEWORKS, PP_SPLITS, Framework
from meshtrain.axes import SHORT_FLAGS
from meshtrain.planner.memory import PRECISIONS, VERDICTS, Precision
from meshtrain.planner.model_specs import ModelSpec, from_table
from meshtrain.planner.search import search
from meshtrain.planner.stack import layout_speed, nulls, parse_stack, scaled

SOURCE_FRAMEWORKS = (("torchtitan", "torchtitan"), ("megatron-core", "megatron-core"), ("narayanan", "megatron-2021"),
                     ("korthikanti", "megatron-2022"), ("llm-foundry", "fsdp"), ("fsdp", "fsdp"))
"""(keyword of a run's source, framework), first match wins: "torchtitan ... (FSDP)" is torchtitan."""
FIXABLE = (*SHORT_FLAGS, "zero_stage", "micro_batch_size", "gradient_accumulation_steps", "recompute",
           "pp_schedule", "virtual_stages", "tp_sequence_parallel", "sp_mode")
PREDICTABLE = ("tflops_per_gpu", "percent_of_peak", "mfu_percent", "tokens_per_s_per_gpu", "iteration_time_s",
               "peak_memory_gib")
TIME_FIELDS = ("iteration_time_s",)  # inversely proportional to throughput: measured/predicted is inverted
MEMORY_FIELDS = ("peak_memory_gib",)  # the planner's peak per device; never part of the efficiency fit
TFLOPS_KINDS = ("model", "hardware")
MODIFIERS = ("tflops_per_gpu_kind", "out_of_memory")
"""``measured`` keys that are not predicted numbers: the kind of ``tflops_per_gpu``, and ``out_of_memory = true``
for a run that did not fit (its source says so); every other run trained, so it fit."""


def out_of_memory(run: dict[str, Any]) -> bool:
    """Whether ``run``'s source says it ran out of memory (``measured.out_of_memory = true``)."""
    return run.get("measured", {}).get("out_of_memory") is True


@dataclass(frozen=True)
class RunResult:
    """One published run: what was predicted, what was measured, signed relative errors (fractions)."""

    name: str
    source: str
    layout: str
    verdict: str
    """The memory verdict of the predicted layout: "fits", "tight" or "does not fit"
    (:func:`meshtrain.planner.memory.memory_verdict`)."""
    predicted: dict[str, float]
    measured: dict[str, float]
    relative_error: dict[str, float]

    @property
    def fits(self) -> bool:
        """Whether the verdict lets the run train: "fits" or "tight"."""
        return self.verdict != "does not fit"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "layout": self.layout, "fits": self.fits,
                "verdict": self.verdict, "predicted": self.predicted, "measured": self.measured,
                "relative_error": self.relative_error}


def framework_for(run: dict[str, Any]) -> Framework:
    """The software of ``run``: its ``stack`` (a framework with options, :func:`meshtrain.planner.stack.parse_stack`)
    or ``framework`` key, else the first keyword of its source; then its ``attention`` key, the kernel that run's
    software version ran (:class:`~meshtrain.planner.layout.Framework` ``attention``), and its ``pipeline_split``
    key, how that run cut its pipeline (``Framework.pp_split``): facts of the run that leave its stack (and so the
    stack's fitted factor) as it is.

    Raises:
        ConfigError: both keys, an unknown framework or option, an unknown attention kernel or pipeline split."""
    fw = _framework_named(run)
    attention = run.get("attention", fw.attention)
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(f"run {run.get('name')!r}: attention {attention!r} is not one of "
                          f"{', '.join(ATTENTION_KERNELS)}")
    split = run.get("pipeline_split", fw.pp_split)
    if split not in PP_SPLITS:
        raise ConfigError(f"run {run.get('name')!r}: pipeline_split {split!r} is not one of {', '.join(PP_SPLITS)}")
    return replace(fw, attention=attention, pp_split=split)


def _framework_named(run: dict[str, Any]) -> Framework:
    if "stack" in run:
        if "framework" in run:
            raise ConfigError(f"run {run.get('name')!r}: give stack or framework, not both (a stack is a framework "
                              f"with options)")
        return parse_stack(str(run["stack"]))[1]
    name = run.get("framework")
    if name is None:
        source = str(run.get("source", "")).lower()
        name = next((fw for key, fw in SOURCE_FRAMEWORKS if key in source), "megatron-core")
    if name not in FRAMEWORKS:
        raise ConfigError(f"run {run.get('name')!r}: framework {name!r} is not one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def measured_fields(run: dict[str, Any]) -> dict[str, float]:
    """The predictable fields of ``run``'s ``measured`` table as floats (:data:`MODIFIERS` are not fields; a run
    with ``out_of_memory = true`` may have none).

    Raises:
        ConfigError: an unknown field, none predictable (and not out of memory), a value that is not a number > 0,
            a bad kind, or ``out_of_memory`` other than true.
    """
    name, measured = run.get("name", "?"), run["measured"]
    use = f"use any of {', '.join(PREDICTABLE)}"
    if not isinstance(measured, dict):
        raise ConfigError(f"run {name!r}: measured must be a table of {', '.join(PREDICTABLE)}")
    unknown = [k for k in measured if k not in PREDICTABLE and k not in MODIFIERS]
    if unknown:
        raise ConfigError(f"run {name!r}: measured field(s) {', '.join(map(repr, unknown))} cannot be predicted: {use}")
    if "out_of_memory" in measured and measured["out_of_memory"] is not True:
        raise ConfigError(f"run {name!r}: measured out_of_memory = {measured['out_of_memory']!r} must be true "
                          f"(leave it out for a run that trained)")
    fields = {k: v for k, v in measured.items() if k in PREDICTABLE}
    if not fields and not out_of_memory(run):
        raise ConfigError(f"run {name!r}: measured has no field the planner can predict: {use}")
    for k, v in fields.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
            raise ConfigError(f"run {name!r}: measured {k} = {v!r} must be a number > 0")
    kind = measured.get("tflops_per_gpu_kind", "model")
    if kind not in TFLOPS_KINDS:
        raise ConfigError(f"run {name!r}: tflops_per_gpu_kind = {kind!r} is not one of {', '.join(TFLOPS_KINDS)}")
    return {k: float(v) for k, v in fields.items()}


@dataclass(frozen=True)
class RunContext:
    """What a published run is about, resolved: model, hardware, precision, framework, job and stated layout fields."""

    model: ModelSpec
    hw: Hardware
    precision: Precision
    framework: Framework
    job: Job
    fixed: dict[str, Any]


def run_context(run: dict[str, Any], profile: Path | None = None, matmul_efficiency: float | None = None,
                speed: float = 1.0) -> RunContext:
    """Resolve ``run``; ``matmul_efficiency`` replaces the catalog's constant for its device (cross-validation),
    ``speed`` scales its device's compute (:func:`meshtrain.planner.stack.scaled`, a stack's or a calibration's factor).
    A run's optional ``network`` table replaces numbers of the catalog's network (:func:`network_with`).

    Raises:
        ConfigError: a run without model/layout/gpu, an unknown gpu, a bad ``measured`` table
            (:func:`measured_fields`) or a bad ``network`` table.
    """
    for key in ("name", "gpu", "num_gpus", "model", "layout", "measured"):
        if key not in run:
            raise ConfigError(f"validation run {run.get('name', '?')!r} lacks '{key}'")
    measured_fields(run)
    model = from_table(dict(run["model"]), name=run["name"])
    hw = get_hardware(run["gpu"], profile=profile)
    if "network" in run:  # the run's own cluster, where it differs from the catalog's
        hw = replace(hw, network=network_with(hw.network, dict(run["network"]), f"run {run['name']!r} network"))
    if matmul_efficiency is not None:
        hw = replace(hw, device=replace(hw.device, matmul_efficiency=matmul_efficiency))
    if speed != 1.0:
        hw = scaled(hw, speed)
    lay = dict(run["layout"])
    gbs = int(lay.pop("global_batch_size"))
    fixed = {k: v for k, v in lay.items() if k in FIXABLE}
    if "pp_schedule" in fixed and fixed.get("pp", 1) == 1:
        fixed.pop("pp_schedule")
    job = Job(num_devices=int(run["num_gpus"]), global_batch_size=gbs)
    fw = framework_for(run)
    return RunContext(model, hw, PRECISIONS[fw.mixed_precision], fw, job, fixed)


def predict_run(run: dict[str, Any], profile: Path | None = None,
                matmul_efficiency: float | None = None, speed: float = 1.0) -> tuple[Estimate, dict[str, float]]:
    """The estimate for one run and the predicted value of each measured field it has (:func:`run_context` for the
    arguments and errors)."""
    ctx = run_context(run, profile, matmul_efficiency, speed)
    model, hw, prec, fw, job, fixed = ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job, ctx.fixed
    measured = measured_fields(run)
    ranked = search(model, hw, prec, fw, job, fixed=fixed, keep_unfit=True, tight=True)  # as `meshtrain plan` ranks
    if not ranked:
        raise ConfigError(f"run {run['name']!r}: no valid layout matches its stated fields {fixed}")
    fitting = [r for r in ranked if r.verdict != "does not fit"]
    best = (fitting or ranked)[0]
    kind = run["measured"].get("tflops_per_gpu_kind", "model")
    tflops = best.hardware_tflops_per_device if kind == "hardware" else best.model_tflops_per_device
    predicted = {"tflops_per_gpu": tflops, "percent_of_peak": 100 * tflops * 1e12 / hw.device.peak("bfloat16"),
                 "mfu_percent": 100 * best.mfu, "tokens_per_s_per_gpu": best.tokens_per_s / job.num_devices,
                 "iteration_time_s": best.time.total, "peak_memory_gib": best.memory.total / GiB}
    return best, {k: v for k, v in predicted.items() if k in measured}


def _ratio(run: dict[str, Any], profile: Path | None, efficiency: float) -> float:
    """Measured / predicted throughput for ``run`` (mean over its measured fields) at a given matmul
    efficiency; a time field counts as predicted / measured, so every ratio > 1 means "run faster"."""
    _, predicted = predict_run(run, profile, efficiency)
    measured = measured_fields(run)
    return statistics.mean(v / measured[k] if k in TIME_FIELDS else measured[k] / v for k, v in predicted.items()
                           if k not in MEMORY_FIELDS)


def efficiency_group(run: dict[str, Any], profile: Path | None = None) -> str:
    """The device type whose fitted ``matmul_efficiency`` ``run``'s device uses (:data:`EFFICIENCY_FROM`)."""
    name = get_hardware(run["gpu"], profile=profile).device.name
    return EFFICIENCY_FROM.get(name, name)


def _timed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that measured a time or a throughput of a dense model (those that constrain the matmul efficiency: a
    mixture of experts' run is predicted, never fitted to, so its routing, dispatch and expert GEMMs are tested by
    the same dense GEMM rate rather than absorbed into it)."""
    return [r for r in runs if any(k not in MEMORY_FIELDS for k in measured_fields(r))
            and not (isinstance(r.get("model"), dict) and r["model"].get("experts"))]


def fit_matmul_efficiency(runs: list[dict[str, Any]], start: float, profile: Path | None = None) -> float:
    """The matmul efficiency of one device type that makes the median measured/predicted ratio of
    ``runs`` equal to 1 (fixed-point iteration: throughput is nearly proportional to it)."""
    efficiency, runs = start, _timed(runs)
    for _ in range(4 if runs else 0):
        efficiency *= statistics.median(_ratio(r, profile, efficiency) for r in runs)
    return efficiency


def cross_validate(runs: list[dict[str, Any]], profile: Path | None = None) -> dict[str, dict[str, float]]:
    """Leave-one-out errors: each run is predicted with its device's matmul efficiency fitted on the
    *other* runs of that device (the catalog value when it is the only one). ``{name: {field: error}}``."""
    out, groups = {}, [efficiency_group(r, profile) for r in runs]
    for i, run in enumerate(runs):
        others = _timed([r for j, r in enumerate(runs) if j != i and groups[j] == groups[i]])
        start = get_hardware(run["gpu"], profile=profile).device.matmul_efficiency
        eff = fit_matmul_efficiency(others, start, profile) if others else start
        _, predicted = predict_run(run, profile, eff)
        out[run["name"]] = {k: (v - float(run["measured"][k])) / float(run["measured"][k]) for k, v in predicted.items()}
    return out


def _summary(errors: list[float]) -> tuple[float | None, float | None]:
    return (statistics.median(errors), max(errors)) if errors else (None, None)


def source_key(run: dict[str, Any]) -> str:
    """The paper or recipe a run comes from: its ``source`` up to the first comma or parenthesis
    ("Narayanan et al. 2021", "Megatron-LM README", "mosaicml/llm-foundry scripts/train/benchmarking/README.md");
    the unit that :func:`leave_one_source_out` holds out."""
    text = str(run.get("source", "")).strip() or "(no source)"
    return text.split(",")[0].split(" (")[0].strip()


def step_time_error(field: str, error: float) -> float:
    """The step-time error a field's error implies: a time as it is; a throughput (TFLOP/s, MFU, tokens/s)
    is inversely proportional to the step time of the same global batch, so ``1 / (1 + e) - 1``."""
    return error if field in TIME_FIELDS else 1 / (1 + error) - 1


def _run_step_error(errors: dict[str, float]) -> float | None:
    """One step-time error per run: the mean over its time and throughput fields (views of one measurement)."""
    steps = [step_time_error(k, e) for k, e in errors.items() if k not in MEMORY_FIELDS]
    return statistics.mean(steps) if steps else None


def _abs_stats(errors: list[float]) -> dict[str, float | int | None]:
    """Median, mean and max of absolute errors (fractions), and how many there were."""
    values = [abs(e) for e in errors]
    return {"runs": len(values), "median_abs_error": statistics.median(values) if values else None,
            "mean_abs_error": statistics.mean(values) if values else None,
            "max_abs_error": max(values) if values else None}


def leave_one_source_out(runs: list[dict[str, Any]], profile: Path | None = None) -> dict[str, Any]:
    """Leave-one-source-out errors: for every source (:func:`source_key`) and device it ran on, the one
    fitted constant (the device's ``matmul_efficiency``, :func:`fit_matmul_efficiency`) is refitted on the
    runs of that device from every *other* source, and this source's runs are predicted with it.

    A device whose runs all come from this source has nothing to fit on: those runs get no held-out
    error (listed under ``"not_held_out"``). Returns ``{"errors": {run name: {field: error}},
    "efficiency": {source: {gpu: value or None}}, "not_held_out": [names]}``. Everything else of the
    model (frameworks, overlaps, traffic laws) is the same in and out of sample. Leave-one-out over runs
    of the same paper flatters the fit: a paper's runs share its stack, cluster and counting conventions
    (grouped cross-validation, Hastie, Tibshirani and Friedman, The Elements of Statistical Learning,
    Sec. 7.10: the held-out unit must be as independent of the fit as a new user's run will be).
    """
    errors: dict[str, dict[str, float]] = {}
    efficiency: dict[str, dict[str, float | None]] = {}
    not_held_out: list[str] = []
    keyed = [(source_key(r), efficiency_group(r, profile), r) for r in runs]
    for source in dict.fromkeys(k for k, _, _ in keyed):
        efficiency[source] = {}
        for gpu in dict.fromkeys(g for k, g, _ in keyed if k == source):
            others = _timed([r for k, g, r in keyed if g == gpu and k != source])
            start = get_hardware(gpu, profile=profile).device.matmul_efficiency
            eff = fit_matmul_efficiency(others, start, profile) if others else None
            efficiency[source][gpu] = eff
            for run in (r for k, g, r in keyed if k == source and g == gpu):
                if eff is None:
                    not_held_out.append(run["name"])
                    continue
                _, predicted = predict_run(run, profile, eff)
                errors[run["name"]] = {k: (v - float(run["measured"][k])) / float(run["measured"][k])
                                       for k, v in predicted.items()}
    return {"errors": errors, "efficiency": efficiency, "not_held_out": not_held_out}


def _source_summary(records: list[dict[str, Any]], loso: dict[str, Any]) -> dict[str, Any]:
    """Per source and overall: step-time |error| in sample and held out by source (median, mean)."""
    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        held = [r["leave_one_source_out_relative_error"] for r in rs if "leave_one_source_out_relative_error" in r]
        step = [_run_step_error(r["relative_error"]) for r in rs]
        held_step = [_run_step_error(e) for e in held]
        memory = [r["relative_error"][k] for r in rs for k in MEMORY_FIELDS if k in r["relative_error"]]
        held_memory = [e[k] for e in held for k in MEMORY_FIELDS if k in e]
        return {"step_time": {"in_sample": _abs_stats([e for e in step if e is not None]),
                              "held_out": _abs_stats([e for e in held_step if e is not None])},
                "memory": {"in_sample": _abs_stats(memory), "held_out": _abs_stats(held_memory)}}

    sources = [{"source": s, "gpus": loso["efficiency"][s], **stats([r for r in records if r["source"] == s])}
               for s in loso["efficiency"]]
    return {"sources": sources, **stats(records), "not_held_out": loso["not_held_out"],
            "fitted": "matmul_efficiency per device type (hardware catalog), refitted without the held-out source"}


def fit_verdicts(runs: list[dict[str, Any]], results: list[RunResult]) -> dict[str, Any]:
    """Whether the planner's memory verdict agrees with what each run did: a run that reports a measurement trained,
    so it fit; one marked ``out_of_memory`` did not. "tight" agrees with either (the range holds the capacity: it
    says the run may or may not fit); "fits" disagrees with an out-of-memory run, "does not fit" with one that
    trained. ``{"runs", "agree", "disagree": [{"name", "predicted", "measured"}], "table": {measured: {verdict:
    count}}}`` with "fits" / "out of memory" as the measured outcomes."""
    disagree = []
    table = {outcome: dict.fromkeys(VERDICTS, 0) for outcome in ("fits", "out of memory")}
    for run, result in zip(runs, results, strict=True):
        measured = "out of memory" if out_of_memory(run) else "fits"
        table[measured][result.verdict] += 1
        wrong = "does not fit" if measured == "fits" else "fits"
        if result.verdict == wrong:
            disagree.append({"name": run["name"], "predicted": result.verdict, "measured": measured})
    return {"runs": len(results), "agree": len(results) - len(disagree), "disagree": disagree, "table": table}


def validate_file(path: Path, profile: Path | None = None, cross: bool = True, calibrate: bool = False) -> dict[str, Any]:
    """Predict every run of ``path``; return ``{"runs": [...], "median_abs_error", "max_abs_error"}``.

    Errors are signed fractions ``(predicted - measured) / measured``; the median and max are over the
    absolute errors of every time and throughput field of every run (memory is reported apart). With
    ``cross``, also the leave-one-out errors (:func:`cross_validate`) under ``"leave_one_out"``, and the
    leave-one-source-out errors (:func:`leave_one_source_out`) per run, per source and overall, in-sample
    beside held-out, step time and memory, under ``"leave_one_source_out"``.

    Raises:
        ConfigError: missing file, bad TOML, or a malformed run.
    """
    from meshtrain.fileio import check_readable

    check_readable(path, "validation file", "give a TOML file of [[run]] tables, e.g. planner/data/published_runs.toml")
    runs = read_toml(path, "validation file").get("run", [])
    if not runs:
        raise ConfigError(f"validation file '{path}' has no [[run]] tables")
    results = []
    for run in runs:
        best, predicted = predict_run(run, profile)
        measured = {k: float(run["measured"][k]) for k in predicted}
        errors = {k: (predicted[k] - measured[k]) / measured[k] for k in predicted}
        results.append(RunResult(run["name"], source_key(run), best.layout.label(), best.verdict, predicted, measured,
                                 errors))
    median, worst = _summary([abs(e) for r in results for k, e in r.relative_error.items() if k not in MEMORY_FIELDS])
    out = {"runs": [r.to_dict() for r in results], "median_abs_error": median, "max_abs_error": worst,
           "fits": fit_verdicts(runs, results)}
    if cross:
        loo = cross_validate(runs, profile)
        for record in out["runs"]:
            record["leave_one_out_relative_error"] = loo[record["name"]]
        median, worst = _summary([abs(e) for errs in loo.values() for k, e in errs.items() if k not in MEMORY_FIELDS])
        out["leave_one_out"] = {"median_abs_error": median, "max_abs_error": worst}
        loso = leave_one_source_out(runs, profile)
        for record in out["runs"]:
            if record["name"] in loso["errors"]:
                record["leave_one_source_out_relative_error"] = loso["errors"][record["name"]]
        median, worst = _summary([abs(e) for errs in loso["errors"].values() for k, e in errs.items()
                                  if k not in MEMORY_FIELDS])
        out["leave_one_source_out"] = {"median_abs_error": median, "max_abs_error": worst,
                                       **_source_summary(out["runs"], loso)}
    if calibrate:
        out["calibrated"] = _calibrated_summary(runs, out["runs"], profile)
    return out


def _calibrated_summary(runs: list[dict[str, Any]], records: list[dict[str, Any]], profile: Path | None) -> dict[str, Any]:
    """``validate_file``'s ``calibrated`` entry: :func:`calibrate_one_per_source`'s step-time errors (dense runs in the
    headline, mixtures of experts apart), each run's ``calibrated_step_time_error``, and the interval coverage of
    :func:`fit_stacks` (pooled: uncalibrated, held out by source; calibrated)."""
    cal = calibrate_one_per_source(runs, profile)
    for record in records:
        if record["name"] in cal["errors"]:
            record["calibrated_step_time_error"] = cal["errors"][record["name"]]
    dense = [abs(e) for n, e in cal["errors"].items() if n not in cal["moe"]]
    moe = [abs(e) for n, e in cal["errors"].items() if n in cal["moe"]]
    median, worst = _summary(dense)
    fit = fit_stacks(runs, profile, cal)
    return {"median_abs_error": median, "max_abs_error": worst, "runs": len(dense),
            "moe": dict(zip(("median_abs_error", "max_abs_error"), _summary(moe)), runs=len(moe)),
            "calibrated_on": cal["calibrated_on"],
            "coverage": {"uncalibrated": fit["pooled"]["coverage"], "calibrated": fit["calibrated"]["coverage"]},
            "range": {"uncalibrated": nulls([fit["pooled"]["low"], fit["pooled"]["high"]]),
                      "calibrated": nulls([fit["calibrated"]["low"], fit["calibrated"]["high"]])},
            "step_time": "signed (predicted - measured) / measured of the step time (time and throughput fields)"}



def stack_of(run: dict[str, Any]) -> str:
    """A run's software stack (:mod:`meshtrain.planner.stack`): its ``stack`` key (canonical: options sorted, a version
    kept), else its framework's name."""
    return parse_stack(str(run["stack"]))[0] if "stack" in run else framework_for(run).name


def _step_error(run: dict[str, Any], predicted: dict[str, float]) -> float:
    measured = measured_fields(run)
    return _run_step_error({k: (v - measured[k]) / measured[k] for k, v in predicted.items()})


def run_speed(run: dict[str, Any], profile: Path | None = None) -> float:
    """The speed factor (:func:`meshtrain.planner.stack.fit_speed`) at which ``run``'s predicted step time equals the
    one it measured (its time and throughput fields' mean step-time error, :func:`step_time_error`), on the layout the
    search picks at the catalog constants."""
    ctx = run_context(run, profile)
    best, predicted = predict_run(run, profile)
    measured_s = best.time.total / (1 + _step_error(run, predicted))
    return layout_speed(ctx.model, best.layout, ctx.hw, ctx.precision, ctx.framework, measured_s)


def _has_time(run: dict[str, Any]) -> bool:
    return any(k not in MEMORY_FIELDS for k in measured_fields(run))


def calibrate_one_per_source(runs: list[dict[str, Any]], profile: Path | None = None) -> dict[str, Any]:
    """Calibrate on one run per source and predict the source's other runs: the first run of each source
    (:func:`source_key`) that measured a time fits the speed factor (:func:`run_speed`); every other timed run of the
    source is predicted at that factor (what ``meshtrain plan --measured`` does for a user with one run of their
    stack). ``{"errors": {name: step-time error}, "moe": [names of mixture-of-experts runs], "calibrated_on":
    {source: {"run": name, "speed_factor": s}}}``; a source with one timed run has nothing to predict."""
    errors: dict[str, float] = {}
    on: dict[str, dict[str, Any]] = {}
    timed = [r for r in runs if _has_time(r)]
    for source in dict.fromkeys(source_key(r) for r in timed):
        first, *rest = [r for r in timed if source_key(r) == source]
        factor = run_speed(first, profile)
        on[source] = {"run": first["name"], "speed_factor": factor}
        for run in rest:
            _, predicted = predict_run(run, profile, speed=factor)
            errors[run["name"]] = _step_error(run, predicted)
    moe = [r["name"] for r in timed if isinstance(r.get("model"), dict) and r["model"].get("experts")]
    return {"errors": errors, "moe": moe, "calibrated_on": on}


def _spread(errors: list[float]) -> dict[str, float]:
    """The [low, high] of signed errors (NaN for none)."""
    return {"low": min(errors), "high": max(errors)} if errors else {"low": math.nan, "high": math.nan}


def fit_stacks(runs: list[dict[str, Any]], profile: Path | None = None,
               calibrated: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each stack's speed factor per device type, and the step-time ranges, from the dense timed runs (:func:`_timed`).

    - ``stack[name][device]``: the median :func:`run_speed` of the stack's runs on that device type (its
      :func:`efficiency_group`), with ``runs`` and ``sources`` counted; its ``low``/``high`` are the signed
      step-time errors of the held-out predictions of runs whose stack another source also ran (so that the factor
      was fitted without them), else the pooled ones.
    - ``pooled``: every run predicted leave-one-source-out, at the stack factor fitted on the other sources when
      they ran the stack on that device, else at the pooled factor of the other sources' runs on that device (the
      held-out refit of the device constant): ``low``/``high`` over all of them, and their ``coverage`` (the
      share of each source's errors inside the range the other sources' errors span).
    - ``calibrated``: the range of :func:`calibrate_one_per_source`'s dense errors, and its coverage the same way.

    Everything is relative to the catalog's constants (a factor of 1 is the catalog): see :mod:`meshtrain.planner.stack`.
    """
    timed = _timed(runs)
    keyed = [(source_key(r), stack_of(r), efficiency_group(r, profile), r) for r in timed]
    speeds = {r["name"]: run_speed(r, profile) for r in timed}
    held: dict[str, tuple[float, str, str, bool]] = {}
    for source in dict.fromkeys(k for k, _, _, _ in keyed):
        others = [(st, g, r) for k, st, g, r in keyed if k != source]
        for _, st, g, run in ((k, st, g, r) for k, st, g, r in keyed if k == source):
            same = [speeds[r["name"]] for s2, g2, r in others if s2 == st and g2 == g]
            pooled = [speeds[r["name"]] for _, g2, r in others if g2 == g]
            if not (same or pooled):
                continue
            factor = statistics.median(same or pooled)
            _, predicted = predict_run(run, profile, speed=factor)
            held[run["name"]] = (_step_error(run, predicted), st, g, bool(same))
    stacks: dict[str, dict[str, Any]] = {}
    all_errors = [e for e, _, _, _ in held.values()]
    for st, g in dict.fromkeys((st, g) for _, st, g, _ in keyed):
        mine = [(k, r) for k, s2, g2, r in keyed if s2 == st and g2 == g]
        fitted = [held[r["name"]][0] for _, r in mine if r["name"] in held and held[r["name"]][3]]
        stacks[f"{st}/{g}"] = {"factor": statistics.median(speeds[r["name"]] for _, r in mine),
                               **_spread(fitted or all_errors), "runs": len(mine),
                               "sources": len({k for k, _ in mine})}
    calibrated = calibrated or calibrate_one_per_source(runs, profile)
    dense = {n: e for n, e in calibrated["errors"].items() if n not in calibrated["moe"]}
    by_source = {r["name"]: source_key(r) for r in runs}
    memory = [predict_run(r, profile)[1]["peak_memory_gib"] / float(r["measured"]["peak_memory_gib"]) - 1
              for r in runs if "peak_memory_gib" in r.get("measured", {})]
    return {"stack": stacks, "memory": {**_spread(memory or [0.0]), "runs": len(memory)},
            "pooled": {**_spread(all_errors), "coverage": _coverage({n: e for n, (e, *_) in held.items()}, by_source),
                       "runs": len(all_errors)},
            "calibrated": {**_spread(list(dense.values())), "coverage": _coverage(dense, by_source), "runs": len(dense)}}


def _coverage(errors: dict[str, float], source: dict[str, str]) -> float:
    """The share of errors inside the [min, max] of the errors of every *other* source (a range a run's own source
    did not shape)."""
    inside = []
    for name, e in errors.items():
        rest = [x for n, x in errors.items() if source[n] != source[name]]
        if rest:
            inside.append(min(rest) <= e <= max(rest))
    return sum(inside) / len(inside) if inside else 0.0
