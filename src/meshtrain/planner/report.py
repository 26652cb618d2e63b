"""Rich tables and takeaway lines for ``meshtrain plan`` (search, ``--explain``, ``--validate``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table


from meshtrain.batch import tokens_per_step
from meshtrain.planner.estimate import Estimate, Job, estimate
from meshtrain.planner.hardware import GiB, Hardware
from meshtrain.planner.layout import Framework, Layout, divisibility_errors, framework_errors
from meshtrain.planner.memory import Precision
from meshtrain.planner.model_specs import ModelSpec


@dataclass(frozen=True)
class Context:
    """Everything a plan is about, resolved from the command line."""

    model: ModelSpec
    hw: Hardware
    precision: Precision
    framework: Framework
    job: Job
    config_layout: Layout | None = None

    def headline(self) -> str:
        m, d = self.model, self.hw.device
        return (f"{m.name}: {param_count(m.num_params())} params, {m.layers} layers, seq_len {m.seq_len} | "
                f"{self.job.num_devices} x {d.name} ({d.memory_bytes / GiB:.0f} GiB, "
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


def _row(rank: str, e: Estimate) -> list[str]:
    b = e.layout
    sched = "-" if b.pp == 1 else b.pp_schedule + (f"x{b.virtual_stages}" if b.virtual_stages > 1 else "")
    sp = f"{b.sp} {b.sp_mode}" if b.sp > 1 else "1"
    dp = f"{b.dp}{' hier' if b.hierarchical_allreduce else ''}{f' H{b.local_sgd_steps}' if b.local_sgd_steps else ''}"
    dp += f" +{b.ps_servers}ps" if b.ps_servers else ""
    return [rank, dp, f"{b.tp}{'+sp' if b.tp_sequence_parallel else ''}", str(b.pp), sp,
            str(b.zero_stage), str(b.micro_batch_size), str(b.gradient_accumulation_steps), b.recompute, sched,
            f"{e.memory.total / GiB:.1f}", f"{e.time.total:.4g}", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
            duration(e.total_time_s)]


def _table(mfu: str) -> Table:
    t = Table()
    for name in ("#", "dp", "tp", "pp", "sp", "zero", "mbs", "GA", "recompute", "pp_schedule", "GiB/dev",
                 "s/step", "tokens/s", mfu, "total"):
        t.add_column(name, justify="right" if name not in ("recompute", "pp_schedule") else "left")
    return t


def _dominant(e: Estimate) -> str:
    parts = {k: v for k, v in e.time.to_dict().items() if k not in ("total", "compute")}
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"after compute ({e.time.compute / e.time.total:.0%}), the largest cost is {name} ({value / e.time.total:.0%})"


def print_search(ctx: Context, fitting: list[Estimate], smallest: Estimate | None, top: int,
                 plot: Path | None) -> None:
    """Print the ranked table of fitting layouts and the takeaways (``smallest``: the least-memory
    layout when none fits)."""
    out = console()
    out.print(ctx.headline(), soft_wrap=True)
    table = _table(ctx.hw.device.mfu_label())
    for i, e in enumerate(fitting[:top], 1):
        table.add_row(*_row(str(i), e))
    mine = None
    config = ctx.config_layout
    if config is not None and not (divisibility_errors(ctx.model, config)
                                   + framework_errors(ctx.framework, config, ctx.model)):
        job = replace(ctx.job, global_batch_size=config.global_batch_size) if config.ps_servers else ctx.job
        mine = estimate(ctx.model, config, ctx.hw, ctx.precision, ctx.framework, job)
        table.add_row(*_row("config", mine), style="bold")
    out.print(table)
    lines = [f"{len(fitting)} layouts fit in {ctx.hw.device.memory_bytes / GiB:.0f} GiB per device "
             "(each with the cheapest recompute mode that fits)."]
    if fitting:
        best = fitting[0]
        b = best.layout
        lines.append(f"Best: {b.label()} -> {best.time.total:.4g} s/step, {best.tokens_per_s:,.0f} tokens/s, "
                     f"{ctx.hw.device.mfu_label()} {best.mfu:.1%}; {_dominant(best)}.")
        lines.append(f"Batch: global_batch_size = micro_batch_size * gradient_accumulation_steps * dp = "
                     f"{b.micro_batch_size} * {b.gradient_accumulation_steps} * {b.dp} = {b.global_batch_size} "
                     f"samples = {tokens_per_step(b.global_batch_size, ctx.model.seq_len):,} tokens per step.")
        if best.total_steps:
            lines.append(f"Training: {best.total_steps:,} steps x {best.time.total:.4g} s = {duration(best.total_time_s)}.")
    elif smallest is not None:
        lines.append(f"No layout fits: the smallest needs {smallest.memory.total / GiB:.1f} GiB per device "
                     f"({smallest.layout.label()}); add devices, a device with more memory, or a smaller batch.")
    if mine is not None:
        rank = next((i for i, r in enumerate(fitting, 1) if r.layout == mine.layout), None)
        where = f"rank {rank} of {len(fitting)}" if rank else ("does not fit" if not mine.fits else "not ranked")
        lines.append(f"Your config's layout: {mine.layout.label()} -> {mine.time.total:.4g} s/step, "
                     f"{mine.memory.total / GiB:.2f} GiB/device ({where}).")
    if plot is not None:
        lines.append(f"Wrote {plot}.")
    for line in lines:
        out.print(line, soft_wrap=True)


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
    verdict = "fits" if e.fits else f"does NOT fit: {e.memory.total / GiB:.1f} > {capacity:.0f} GiB"
    out.print(f"{layout.label()} {verdict}; {e.tokens_per_s:,.0f} tokens/s, {ctx.hw.device.mfu_label()} {e.mfu:.1%}, "
                  f"{e.hardware_tflops_per_device:.4g} hardware TFLOP/s per device; {_dominant(e)}.", soft_wrap=True)
    return 0


def print_validation(result: dict) -> None:
    """Table of predicted vs measured for every run and field, with the median and max errors."""
    table = Table(title="meshtrain plan --validate: predicted vs measured", title_justify="left")
    for name in ("run", "layout (searched where unstated)", "field", "predicted", "measured", "error", "held-out error"):
        table.add_column(name, justify="right" if name in ("predicted", "measured", "error", "held-out error") else "left")
    for run in result["runs"]:
        for field, err in run["relative_error"].items():
            loo = run.get("leave_one_out_relative_error", {}).get(field)
            table.add_row(run["name"], run["layout"], field, number(run["predicted"][field]),
                          number(run["measured"][field]), f"{err:+.1%}", "-" if loo is None else f"{loo:+.1%}")
    out = console()
    out.print(table)
    out.print(f"median |error| {result['median_abs_error']:.1%}, max {result['max_abs_error']:.1%} "
                  f"(catalog constants, fitted on these runs)")
    if "leave_one_out" in result:
        loo = result["leave_one_out"]
        out.print(f"held out: median |error| {loo['median_abs_error']:.1%}, max {loo['max_abs_error']:.1%} "
                      f"(each run predicted with its device's matmul efficiency fitted on the other runs)")


def validation_markdown(result: dict) -> str:
    """The validation table as Markdown (what docs/planner.md publishes)."""
    lines = ["| run | layout (searched where unstated) | field | predicted | measured | error | held-out error |",
             "|---|---|---|---:|---:|---:|---:|"]
    for run in result["runs"]:
        for field, err in run["relative_error"].items():
            loo = run.get("leave_one_out_relative_error", {}).get(field)
            lines.append(f"| {run['name']} | {run['layout']} | {field} | {number(run['predicted'][field])} | "
                         f"{number(run['measured'][field])} | {err:+.1%} | {'-' if loo is None else f'{loo:+.1%}'} |")
    lines.append("")
    lines.append("Median \\|error\\| " f"{result['median_abs_error']:.1%}, max {result['max_abs_error']:.1%} with the catalog "
                 "constants (fitted on these runs).")
    if "leave_one_out" in result:
        loo = result["leave_one_out"]
        lines.append("Held out (leave-one-out): median \\|error\\| " f"{loo['median_abs_error']:.1%}, "
                     f"max {loo['max_abs_error']:.1%}.")
    return "\n".join(lines)
