"""Rich tables and takeaway lines for ``meshtrain plan`` (search, ``--explain``, ``--validate``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table


from meshtrain.axes import SHORT_FLAGS, SPECS, degree
from meshtrain.batch_math import tokens_per_step
from meshtrain.planner.cost import optimizer_parts
from meshtrain.planner.estimate import Estimate, Job, estimate
from meshtrain.planner.hardware import GiB, Hardware
from meshtrain.planner.layout import Framework, Layout, divisibility_errors, framework_errors
from meshtrain.planner.memory import VERDICTS, Precision, memory_error_range
from meshtrain.planner.model_specs import ModelSpec
from meshtrain.planner.search import Ranked
from meshtrain.planner.stack import Speed, estimate_ranges


@dataclass(frozen=True)
class Context:
    """Everything a plan is about, resolved from the command line."""

    model: ModelSpec
    hw: Hardware
    precision: Precision
    framework: Framework
    job: Job
    config_layout: Layout | None = None
    speed: Speed = Speed()
    """The stack's speed factor (already applied to ``hw``) and its step-time range (:mod:`meshtrain.planner.stack`)."""

    def headline(self) -> str:
        m, d = self.model, self.hw.device
        active = f" ({param_count(m.active_params())} active)" if m.experts else ""
        unvalidated = "" if d.validated else ", unvalidated: no published run"
        return (f"{m.name}: {param_count(m.num_params())} params{active}, {m.layers} layers, seq_len {m.seq_len} | "
                f"{self.job.num_devices} x {d.name} ({d.memory_bytes / GiB:.0f} GiB{unvalidated}, "
                f"{d.peak(self.precision.compute_dtype) / 1e12:.4g} TFLOP/s {self.precision.compute_dtype}), "
                f"{self.hw.network.devices_per_node}/node | {self.precision.name}, {self.framework.name} | "
                f"global_batch_size {self.job.global_batch_size}")


def console() -> Console:
    """A rich console; 160 columns when the output is not a terminal, so piped tables do not wrap."""
    c = Console()
    return c if c.is_terminal else Console(width=160)


def duration(seconds: float | None) -> str:
    """``93784.0`` -> ``"1.09 d"``; seconds, minutes, hours or days with 3 significant digits."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def param_count(n: float) -> str:
    """A parameter count in the unit that reads: ``804_000`` -> ``"0.80 M"``, ``124e6`` -> ``"124 M"``,
    ``8.03e9`` -> ``"8.03 B"``, ``1.2e12`` -> ``"1.20 T"`` (3 significant digits, 2 decimals below 10)."""
    value, unit = next(((n / size, unit) for unit, size in (("T", 1e12), ("B", 1e9)) if n >= 0.9995 * size), (n / 1e6, "M"))
    return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f} {unit}"


def number(value: float) -> str:
    """Thousands with separators and no decimals; smaller numbers with 4 significant digits."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _axis_cell(b: Layout, axis: str) -> str:
    """One axis's column: its degree, with what runs it beside (dp: hierarchical all-reduce, local SGD every H
    steps, parameter servers; tp: Megatron sequence parallelism; sp: its mode)."""
    cell = str(degree(b, axis))
    if axis == "dp":
        cell += f"{' hier' if b.hierarchical_allreduce else ''}{f' H{b.local_sgd_steps}' if b.local_sgd_steps else ''}"
        cell += f" +{b.ps_servers}ps" if b.ps_servers else ""
    elif axis == "tp" and b.tp_sequence_parallel:
        cell += "+sp"
    elif axis == "sp" and b.sp > 1:
        cell += f" {b.sp_mode}" + (f" {b.sp_ulysses}x{b.sp // b.sp_ulysses}" if b.sp_mode == "usp" else "")
    return cell


def _shown_axes(model: ModelSpec) -> list[str]:
    """The axes a table has a column for: the world's, and expert parallelism's for a model with experts."""
    return [a for a in SHORT_FLAGS if SPECS[a].in_world or model.experts]


def _row(rank: str, e: Estimate, shown: list[str], speed: Speed) -> list[str]:
    b = e.layout
    sched = "-" if b.pp == 1 else b.pp_schedule + (f"x{b.virtual_stages}" if b.virtual_stages > 1 else "")
    low, high = speed.step_time_range(e.time.total)
    return [rank, *(_axis_cell(b, axis) for axis in shown), str(b.zero_stage), str(b.micro_batch_size), str(b.gradient_accumulation_steps), b.recompute, sched,
            f"{e.memory.total / GiB:.1f}", fit_cell(e), f"{e.time.total:.4g}", "-" if math.isnan(low) else f"{low:.3g}-{high:.3g}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.mfu:.1%}", duration(e.total_time_s)]


def _table(mfu: str, shown: list[str]) -> Table:
    t = Table()
    for name in ("#", *shown, "zero", "mbs", "GA", "recompute", "pp_schedule", "GiB/dev", "memory",
                 "s/step", "range", "tokens/s", mfu, "total"):
        t.add_column(name, justify="right" if name not in ("recompute", "pp_schedule", "memory") else "left")
    return t


def fit_cell(e: Estimate) -> str:
    """The memory verdict of ``e`` with the range of its measured peak: "fits", "tight 62-81" (GiB), "does not fit"."""
    if e.verdict == "fits":
        return "fits"
    low, high = (v / GiB for v in e.memory_range)
    return f"{e.verdict} {low:.0f}-{high:.0f}"


def memory_range_line(ctx: Context) -> str:
    """What the memory column's verdicts mean on ``ctx``'s device: the range's basis, and "unvalidated" where the
    device has no published run."""
    lo, hi = memory_error_range()
    d = ctx.hw.device
    line = (f"Memory: \"tight\" = the measured peak should lie in the range shown (GiB), which holds the "
            f"{d.memory_bytes / GiB:.0f} GiB capacity: it may train or run out of memory (the predicted peaks of the "
            f"published runs err {lo:+.1%} to {hi:+.1%}; docs/planner.md, \"Memory\")")
    if not d.validated:
        line += (f"; {d.name} is unvalidated (no published run was predicted on it): the range is widened by its "
                 f"assumed {d.framework_overhead_bytes / GiB:.0f} GiB runtime overhead on each side")
    return line + "."


def _dominant(e: Estimate) -> str:
    parts = {k: v for k, v in e.time.to_dict().items() if k not in ("total", "compute")}
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"after compute ({e.time.compute / e.time.total:.0%}), the largest cost is {name} ({value / e.time.total:.0%})"


def optimizer_line(ctx: Context, e: Estimate) -> str:
    """The optimizer's share of ``e``'s step and its states per device, in one line; with Muon its parts
    (:func:`meshtrain.planner.cost.optimizer_parts`: element-wise, Newton-Schulz on the busiest rank, the exchange)."""
    plan, seconds = ctx.framework.optimizer, e.time.optimizer
    line = f"Optimizer {plan.name}: {seconds:.4g} s/step ({seconds / e.time.total:.1%} of the step)"
    if plan.muon and not e.layout.ps_servers:
        parts = optimizer_parts(ctx.model, e.layout, ctx.hw, ctx.precision, ctx.framework)
        line += (f" = element-wise {parts.elementwise:.3g} s + Newton-Schulz {parts.newton_schulz:.3g} s "
                 f"({plan.ns_steps} steps in {plan.ns_dtype}, busiest rank) + {plan.exchange} exchange "
                 f"{parts.exchange:.3g} s")
    return line + f"; states {e.memory.optimizer / GiB:.2f} GiB/device."


def _tight_best_line(ctx: Context, best: Estimate, sure: Estimate | None) -> str:
    """When the fastest layout is tight: its range, and the fastest layout that surely fits (``sure``: its whole
    range within the device), with what it costs."""
    low, high = (v / GiB for v in best.memory_range)
    head = f"Best is tight: its measured peak should lie in {low:.0f}-{high:.0f} GiB on {ctx.hw.device.memory_bytes / GiB:.0f} GiB"
    if sure is None:
        return head + "; no layout surely fits (more devices would leave room)."
    return (head + f"; the fastest that surely fits is {sure.layout.label()} -> {sure.time.total:.4g} s/step "
            f"({sure.time.total / best.time.total - 1:+.1%}), {sure.memory.total / GiB:.1f} GiB.")


def print_search(ctx: Context, fitting: Ranked, smallest: Estimate | None, top: int, plot: Path | None,
                 mine: Estimate | None = None, sure: Estimate | None = None) -> None:
    """Print the ranked table of fitting layouts (a :func:`meshtrain.planner.search.search` result) and the takeaways
    (``smallest``: the least-memory layout when none fits; ``mine``: :func:`config_estimate`, ranked among them;
    ``sure``: the fastest layout that surely fits, named when the fastest is tight)."""
    out = console()
    out.print(ctx.headline(), soft_wrap=True)
    shown = _shown_axes(ctx.model)
    table = _table(ctx.hw.device.mfu_label(), shown)
    for i, e in enumerate(fitting[:top], 1):
        table.add_row(*_row(str(i), e, shown, ctx.speed))
    if mine is not None:
        table.add_row(*_row("config", mine, shown, ctx.speed), style="bold")
    out.print(table)
    count = fitting.count  # a search's top leaves out layouts that fit
    tight = sum(e.verdict == "tight" for e in fitting)
    lines = [f"{count} layouts fit in {ctx.hw.device.memory_bytes / GiB:.0f} GiB per device or are tight "
             "(each with the cheapest recompute mode predicted within it, and a faster one that is tight if any)"
             + (f"; {tight} of those ranked are tight." if tight else "."), memory_range_line(ctx)]
    if fitting:
        best = fitting[0]
        b = best.layout
        lines.append(f"Best: {b.label()} -> {best.time.total:.4g} s/step, {best.tokens_per_s:,.0f} tokens/s, "
                     f"{ctx.hw.device.mfu_label()} {best.mfu:.1%}; {_dominant(best)}.")
        if best.verdict == "tight":
            lines.append(_tight_best_line(ctx, best, sure))
        lines.append(f"Batch: global_batch_size = micro_batch_size * gradient_accumulation_steps * dp = "
                     f"{b.micro_batch_size} * {b.gradient_accumulation_steps} * {b.dp} = {b.global_batch_size} "
                     f"samples = {tokens_per_step(b.global_batch_size, ctx.model.seq_len):,} tokens per step.")
        lines.append(optimizer_line(ctx, best))
        lines.append(_range_line(ctx, best, fitting[:top]))
        if best.total_steps:
            low, high = estimate_ranges(best, ctx.speed)["total_time_range_s"]
            within = "" if low is None else f" (range {duration(low)} - {duration(high)})"
            lines.append(f"Training: {best.total_steps:,} steps x {best.time.total:.4g} s = {duration(best.total_time_s)}"
                         f"{within}.")
        if b.diloco_group:
            lines.append(diloco_trade(b))
    elif smallest is not None:
        lines.append(f"No layout fits: the smallest needs {smallest.memory.total / GiB:.1f} GiB per device "
                     f"({smallest.layout.label()}); add devices, a device with more memory, or a smaller batch.")
    if mine is not None:
        rank = next((i for i, r in enumerate(fitting, 1) if r.layout == mine.layout), None)
        where = f"rank {rank} of {count}" if rank else (mine.verdict if mine.verdict == "does not fit" else "not ranked")
        lines.append(f"Your config's layout: {mine.layout.label()} -> {mine.time.total:.4g} s/step, "
                     f"{mine.memory.total / GiB:.2f} GiB/device, {fit_cell(mine)} ({where}).")
    if plot is not None:
        lines.append(f"Wrote {plot}.")
    for line in lines:
        out.print(line, soft_wrap=True)


def config_estimate(ctx: Context) -> Estimate | None:
    """The estimate of the layout the training config sets (``ctx.config_layout``), or None without a config or when
    that layout breaks a rule."""
    config = ctx.config_layout
    if config is None or divisibility_errors(ctx.model, config) + framework_errors(ctx.framework, config, ctx.model):
        return None
    job = replace(ctx.job, global_batch_size=config.global_batch_size) if config.ps_servers else ctx.job
    return estimate(ctx.model, config, ctx.hw, ctx.precision, ctx.framework, job)


def _range_line(ctx: Context, best: Estimate, shown: list[Estimate]) -> str:
    """The range's basis, and how many of the shown layouts predict a step time inside the best's range."""
    s, (low, high) = ctx.speed, ctx.speed.step_time_range(best.time.total)
    if math.isnan(low):
        return f"Range: none ({s.basis})."
    inside = sum(low <= e.time.total <= high for e in shown[1:])
    overlap = (f"; {inside} of the other {len(shown) - 1} shown layouts predict a step time inside it (the ranking "
               f"among them is within the model's error, though errors of one stack move layouts together)"
               if len(shown) > 1 else "")
    return (f"Range: the measured step time of the best layout should lie in {low:.4g}-{high:.4g} s "
            f"(speed factor {s.factor:.3g}, {s.basis}; signed step-time errors {s.low:+.1%} to {s.high:+.1%}){overlap}.")


def diloco_trade(layout: Layout) -> str:
    """What a DiLoCo layout trades, in one line: the traffic it saves is modelled, the quality per step it may cost
    is not (the papers' results and this project's measurement are named instead)."""
    L = layout
    streamed = (f", each exchange 1/{L.diloco_fragments} of the weights (Streaming DiLoCo)" if L.diloco_fragments > 1
                else "")
    return (f"DiLoCo: {L.diloco_workers} workers exchange every {L.diloco_inner_steps} steps{streamed}: cross-worker "
            f"traffic 1/{L.diloco_inner_steps} of DDP's. Not modelled: the loss per step it costs. Douillard et al. 2023 "
            f"report 8 workers at H = 500 as good as synchronous training on C4 while communicating 500x less "
            f"(arXiv:2311.08105); Streaming DiLoCo similar quality with two orders of magnitude less bandwidth "
            f"(arXiv:2501.18512); measured on a small model here: docs/strategies.md, DiLoCo.")


def explain(ctx: Context, layout: Layout, as_json: bool = False) -> int:
    """Say why ``layout`` is invalid, or break down its memory and step time. Returns the exit code 0."""
    errors = divisibility_errors(ctx.model, layout, ctx.job.global_batch_size)
    errors += framework_errors(ctx.framework, layout, ctx.model)
    if errors:
        if as_json:
            print(json.dumps({"layout": layout.to_dict(), "valid": False, "errors": errors}))
        else:
            out = console()
            out.print(f"{layout.label()} is not a valid layout of {ctx.model.name} on {ctx.job.num_devices} devices:")
            for e in errors:
                out.print(f"  - {e}", soft_wrap=True)
        return 0
    e = estimate(ctx.model, layout, ctx.hw, ctx.precision, ctx.framework, ctx.job)
    if as_json:
        print(json.dumps({"valid": True, **e.to_dict()}, indent=1))
        return 0
    out = console()
    out.print(ctx.headline(), soft_wrap=True)
    table = Table()
    for name in ("memory part", "GiB/device", "time part", "s/step"):
        table.add_column(name, justify="left" if "part" in name else "right")
    mem = [(k, v / GiB) for k, v in e.memory.to_dict().items()]
    tim = list(e.time.to_dict().items())
    for (mk, mv), (tk, tv) in zip(mem, tim + [("", None)] * (len(mem) - len(tim))):
        table.add_row(mk, f"{mv:.2f}", tk, "" if tv is None else f"{tv:.4g}")
    out.print(table)
    capacity = ctx.hw.device.memory_bytes / GiB
    low, high = (v / GiB for v in e.memory_range)
    verdict = {"fits": "fits", "tight": "tight", "does not fit": "does NOT fit"}[e.verdict] + (
        f": {e.memory.total / GiB:.1f} GiB predicted, the measured peak should lie in {low:.1f}-{high:.1f} GiB "
        f"(capacity {capacity:.0f} GiB" + (")" if ctx.hw.device.validated else
                                           f"; {ctx.hw.device.name} unvalidated: range widened)"))
    out.print(f"{layout.label()} {verdict}; {e.tokens_per_s:,.0f} tokens/s, {ctx.hw.device.mfu_label()} {e.mfu:.1%}, "
                  f"{e.hardware_tflops_per_device:.4g} hardware TFLOP/s per device; {_dominant(e)}.", soft_wrap=True)
    out.print(optimizer_line(ctx, e), soft_wrap=True)
    if layout.diloco_group:
        out.print(diloco_trade(layout), soft_wrap=True)
    return 0


HELD_OUT = "held out by source"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _validation_rows(result: dict) -> list[list[str]]:
    """One row per run and field: predicted, measured, in-sample error, leave-one-source-out error."""
    rows = []
    for run in result["runs"]:
        for field, err in run["relative_error"].items():
            held = run.get("leave_one_source_out_relative_error", {}).get(field)
            rows.append([run["name"], run["layout"], field, number(run["predicted"][field]),
                         number(run["measured"][field]), f"{err:+.1%}", "-" if held is None else f"{held:+.1%}"])
    return rows


def _source_rows(result: dict) -> list[list[str]]:
    """Per source and overall: runs, step-time |error| median / mean in sample and held out by source."""
    loso = result.get("leave_one_source_out")
    if loso is None:
        return []

    def row(name: str, stats: dict, fitted: str) -> list[str]:
        inside, held = stats["step_time"]["in_sample"], stats["step_time"]["held_out"]
        return [name, str(inside["runs"]), f"{_pct(inside['median_abs_error'])} / {_pct(inside['mean_abs_error'])}",
                f"{_pct(held['median_abs_error'])} / {_pct(held['mean_abs_error'])}", fitted]

    rows = [row(s["source"], s, ", ".join(f"{g} {'-' if e is None else f'{e:.3f}'}" for g, e in s["gpus"].items()))
            for s in loso["sources"]]
    return rows + [row("all sources", loso, "catalog (in sample)")]


def _memory_line(result: dict) -> str | None:
    """Peak memory per GPU over the runs that report one (nothing in the memory model is fitted)."""
    memory = result.get("leave_one_source_out", {}).get("memory", {}).get("in_sample")
    if not memory or not memory["runs"]:
        return None
    return (f"peak memory per GPU ({memory['runs']} runs report it): median |error| {_pct(memory['median_abs_error'])}, "
            f"mean {_pct(memory['mean_abs_error'])}, max {_pct(memory.get('max_abs_error'))}; nothing in the memory "
            f"model is fitted, so held out = in sample")


def _fits_line(result: dict) -> str | None:
    """How often the planner's fits / out-of-memory verdict agrees with what the runs did."""
    fits = result.get("fits")
    if not fits:
        return None
    wrong = "; ".join(f"{d['name']} predicted {d['predicted']}, {d['measured']} measured" for d in fits["disagree"])
    table = "; ".join(f"{outcome}: " + ", ".join(f"{n} {verdict}" for verdict, n in counts.items())
                      for outcome, counts in fits.get("table", {}).items())
    lo, hi = memory_error_range()
    return (f"fits in memory: the planner's verdict agrees for {fits['agree']} of {fits['runs']} runs (a run that "
            f"measured something fit; one the source reports out of memory did not; \"tight\", the capacity inside the "
            f"range the errors {lo:+.1%} to {hi:+.1%} give, agrees with either)" + (f"; by outcome: {table}" if table else "")
            + (f"; disagrees: {wrong}" if wrong else ""))


SOURCE_COLUMNS = ("source held out", "runs", "step time |error| in sample (median / mean)",
                  f"{HELD_OUT} (median / mean)", "matmul_efficiency refitted on the other sources")


def print_validation(result: dict) -> None:
    """Table of predicted vs measured for every run and field, with the in-sample and the
    leave-one-source-out errors (:func:`meshtrain.planner.validate.leave_one_source_out`), then the
    step-time errors per source."""
    table = Table(title="meshtrain plan --validate: predicted vs measured", title_justify="left")
    for name in ("run", "layout (searched where unstated)", "field", "predicted", "measured", "error", HELD_OUT):
        table.add_column(name, justify="right" if name in ("predicted", "measured", "error", HELD_OUT) else "left")
    for row in _validation_rows(result):
        table.add_row(*row)
    out = console()
    out.print(table)
    out.print(f"median |error| {result['median_abs_error']:.1%}, max {result['max_abs_error']:.1%} "
              f"(catalog constants; their matmul_efficiency was fitted on runs of this table)")
    if "leave_one_source_out" in result:
        loso = result["leave_one_source_out"]
        out.print(f"{HELD_OUT}: median |error| {_pct(loso['median_abs_error'])}, max {_pct(loso['max_abs_error'])} "
                  f"(each source predicted with the matmul efficiency fitted on the other sources' runs)")
        sources = Table(title="step time by source: in sample vs held out by source", title_justify="left")
        for name in SOURCE_COLUMNS:
            sources.add_column(name, justify="right" if "|error|" in name or "median" in name or name == "runs"
                               else "left")
        for row in _source_rows(result):
            sources.add_row(*row)
        out.print(sources)
        if _memory_line(result):
            out.print(_memory_line(result))
        if loso["not_held_out"]:
            out.print(f"no other source on their device, so not held out: {', '.join(loso['not_held_out'])}")
    fits = _fits_line(result)
    if fits:
        out.print(fits)
    if "calibrated" in result:
        out.print(_calibrated_line(result["calibrated"]), soft_wrap=True)


def validation_markdown(result: dict) -> str:
    """The validation tables as Markdown (what docs/planner.md publishes)."""
    lines = [f"| run | layout (searched where unstated) | field | predicted | measured | error | {HELD_OUT} |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(row) + " |" for row in _validation_rows(result)]
    lines.append("")
    lines.append("Median \\|error\\| " f"{result['median_abs_error']:.1%}, max {result['max_abs_error']:.1%} with the catalog "
                 "constants (their matmul_efficiency was fitted on runs of this table).")
    if "leave_one_source_out" in result:
        loso = result["leave_one_source_out"]
        lines.append(f"Held out by source: median \\|error\\| {_pct(loso['median_abs_error'])}, "
                     f"max {_pct(loso['max_abs_error'])}.")
        lines += ["", "| " + " | ".join(SOURCE_COLUMNS).replace("|error|", "\\|error\\|") + " |",
                  "|---|---:|---:|---:|---|"]
        lines += ["| " + " | ".join(row) + " |" for row in _source_rows(result)]
        memory = _memory_line(result)
        if memory:
            lines += ["", "P" + memory[1:].replace("|error|", "\\|error\\|") + "."]
            lines += ["", *memory_table_markdown(result)]
        if loso["not_held_out"]:
            lines += ["", f"Not held out (no other source on their device): {', '.join(loso['not_held_out'])}."]
    fits = _fits_line(result)
    if fits:
        lines += ["", "F" + fits[1:] + "."]
        if "table" in result["fits"]:
            lines += ["", "| measured | " + " | ".join(VERDICTS) + " |", "|---|" + "---:|" * len(VERDICTS)]
            lines += [f"| {outcome} | " + " | ".join(str(counts[v]) for v in VERDICTS) + " |"
                      for outcome, counts in result["fits"]["table"].items()]
    if "calibrated" in result:
        lines += ["", _calibrated_line(result["calibrated"]).replace("|error|", "\\|error\\|")]
    return "\n".join(lines)


def memory_table_markdown(result: dict) -> list[str]:
    """The memory table: every run that reports its peak memory per GPU, with its source, layout, measured and
    predicted peak (GiB), error, and the verdict against its device (:func:`meshtrain.planner.memory.memory_verdict`)."""
    lines = ["| run | source | layout | measured GiB | predicted GiB | error | verdict |", "|---|---|---|---:|---:|---:|---|"]
    for r in result["runs"]:
        if "peak_memory_gib" in r["measured"]:
            lines.append(f"| {r['name']} | {r['source']} | {r['layout']} | {r['measured']['peak_memory_gib']:.4g} | "
                         f"{r['predicted']['peak_memory_gib']:.4g} | {r['relative_error']['peak_memory_gib']:+.1%} | "
                         f"{r.get('verdict', '-')} |")
    return lines


def _calibrated_line(cal: dict) -> str:
    """One line on ``plan --validate --calibrate one-per-source``: the calibrated errors and the ranges' coverage."""
    moe = cal["moe"]
    low, high = cal["range"]["calibrated"]
    bounds = "" if low is None else f" (signed errors {low:+.1%} to {high:+.1%})"
    return (f"Calibrated on each source's first timed run, its other runs' step time: median |error| "
            f"{_pct(cal['median_abs_error'])}, max {_pct(cal['max_abs_error'])} over {cal['runs']} dense runs{bounds}; "
            f"mixtures of experts apart: median {_pct(moe['median_abs_error'])}, max {_pct(moe['max_abs_error'])} "
            f"({moe['runs']} runs). Interval coverage (each source's errors inside the range the other sources' "
            f"span): {cal['coverage']['uncalibrated']:.0%} uncalibrated, {cal['coverage']['calibrated']:.0%} calibrated.")
