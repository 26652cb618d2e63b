"""``meshtrain plan``: predict memory, step time, MFU and total time of layouts, and pick the best.

Modes: search (default), ``--explain LAYOUT``, ``--validate FILE``, ``--calibrate``. A training config
takes the overrides ``meshtrain train`` takes (``--tp 2``, ``--model.n_layer 8``), so that the plan is of
the run that command line would start. Every user mistake raises :class:`meshtrain.errors.ConfigError`
(one line, exit code 2 from ``meshtrain.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from meshtrain.argtypes import positive_float, positive_int
from meshtrain.axes import SHORT_FLAGS
from meshtrain.batch_math import global_batch_size
from meshtrain.config.load import load_config, parse_overrides
from meshtrain.errors import ConfigError
from meshtrain.fileio import check_new_file
from meshtrain.planner import report, stack
from meshtrain.planner.actual import hardware_for_run
from meshtrain.planner.estimate import Estimate, Job, estimate
from meshtrain.planner.hardware import DEFAULT_PROFILE, get_hardware
from meshtrain.planner.layout import (FRAMEWORKS, Layout, framework_errors, meshtrain_framework, parse_fix, parse_layout,
                                      pinned_model_errors, sequences_per_sample)
from meshtrain.planner.memory import PRECISIONS, fits_budget
from meshtrain.planner.model_specs import from_config, load_model
from meshtrain.planner.report import Context
from meshtrain.planner.search import search
from meshtrain.planner.stack import estimate_ranges, parse_stack
from meshtrain.planner.validate import PUBLISHED_RUNS, validate_file
from meshtrain.resolved import ResolvedRun

EPILOG = """examples:
  meshtrain plan --model llama3-70b --gpu H100-SXM-80GB --num-gpus 512 --global-batch-size 1024 --seq-len 8192
  meshtrain plan --model llama3-405b --gpu H100 --num-gpus 16384 --global-batch-tokens 16777216 --top 5 --json
  meshtrain plan --model gpt2-xl --gpu A100-80GB --num-gpus 16 --global-batch-size 512 --explain zero_stage=2,micro_batch_size=4
  meshtrain plan configs/shakespeare_char.toml            (the trainer's model and layout, on this CPU)
  meshtrain plan configs/llama_tiny.toml --tp 2 --model.n_layer 8     (overrides as meshtrain train takes them)
  meshtrain plan --validate --json
  meshtrain plan --calibrate                              (measure this machine, save a cpu profile)"""


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    """Register ``plan`` on the ``meshtrain`` subparsers (``line``: its line in ``meshtrain --help``), set ``func``."""
    p = sub.add_parser("plan", help=line,
                       description="Enumerate every valid (dp, tp, pp, sp, ep, zero_stage, micro_batch_size, "
                                   "gradient_accumulation_steps, recompute, pp_schedule) layout of a job, drop those "
                                   "that break a divisibility rule or surely do not fit in memory, rank the rest by time "
                                   "per step (a 'tight' one, which may run out of memory, with its memory range and "
                                   "the fastest layout that surely fits). Formulas and their sources: docs/planner.md.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="a training config (TOML): plan its model, layout and batch; any of its "
                                             f"keys can follow as --section.key VALUE (or {'/'.join(f'--{a}' for a in SHORT_FLAGS)} N), "
                                             "as for meshtrain train")
    _add_model_options(p.add_argument_group("model and hardware"))
    _add_job_options(p.add_argument_group("calibration (one measured run fits the stack's speed; docs/planner.md)"),
                     p.add_argument_group("job"))
    _add_output_options(p.add_argument_group("output"))
    p.set_defaults(func=run, accepts_overrides=True)


def _add_model_options(g: argparse._ArgumentGroup) -> None:
    """``plan``'s options of the model, the devices, the precision and the software stack."""
    g.add_argument("--model", help="preset name (gpt2-small..xl, llama3-8b/70b/405b, megatron-1.7b..1t, "
                                   "mixtral-8x7b/8x22b, qwen3-30b-a3b, deepseek-v3, kimi-k2, deepseek-v2(-lite), "
                                   "glm-4.5(-air)) or a TOML file with a [model] table")
    g.add_argument("--seq-len", type=positive_int, help="tokens per sample (overrides the model's)")
    g.add_argument("--gpu", help="device type, e.g. H100-SXM-80GB, A100-80GB, MI300X, cpu (default: cpu for a "
                                 "config, else required)")
    g.add_argument("--hardware", type=Path, help="TOML with extra [[device]] tables and a [network] table")
    g.add_argument("--profile", type=Path, help="calibrated profile to read/write (default "
                                                "$XDG_CACHE_HOME/meshtrain/hardware_profile.toml, "
                                                "~/.cache/... without XDG_CACHE_HOME)")
    g.add_argument("--devices-per-node", type=positive_int, help="override the node size of the device's network")
    g.add_argument("--nics-per-node", type=positive_int,
                   help="NICs a node's devices share (default: one per device; 1 for a typical CPU/Ethernet cluster)")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "bf16-autocast"),
                   help="precision (default: the framework's mixed precision; a config's train.dtype)")
    g.add_argument("--framework", choices=tuple(FRAMEWORKS), default=None,
                   help="software whose overlaps, features and memory to model (default meshtrain; docs/planner.md, "
                        "\"Frameworks\")")
    g.add_argument("--stack", metavar="FRAMEWORK[@VERSION][+OPTION...]",
                   help="the software stack: a --framework, optionally at a version (megatron-core@nemo-24.09: its own "
                        "fitted speed), with options (compile, flash, flash2, flash-triton, "
                        "materialized, tp-comm-overlap, no-tp-comm-overlap, fused-ce), e.g. torchtitan+compile or "
                        "torchtitan+flash2 (FlashAttention-2, slower on Hopper); its speed factor and range are fitted "
                        "on published runs (docs/planner.md, \"Stacks and calibration\")")


def _add_job_options(c: argparse._ArgumentGroup, j: argparse._ArgumentGroup) -> None:
    """``plan``'s options of a measured run to calibrate on (``c``) and of the job (``j``: devices, batch, length)."""
    c.add_argument("--measured", metavar="LAYOUT,KEY=VALUE",
                   help="a run you measured on this cluster: its layout fields as --fix takes them and one of "
                        "step_time_s, tokens_per_s, tokens_per_s_per_gpu, mfu_percent, e.g. tp=8,pp=4,step_time_s=12.9")
    c.add_argument("--calibrate-from", type=Path, metavar="RUN_DIR",
                   help="the --out folder of a finished meshtrain train run (its plan_vs_actual.json)")
    j.add_argument("--num-gpus", type=positive_int, help="devices in the job (world_size)")
    j.add_argument("--global-batch-size", type=positive_int, help="samples per optimizer step")
    j.add_argument("--global-batch-tokens", type=positive_int, help="tokens per optimizer step (instead of samples)")
    j.add_argument("--dataset-samples", type=positive_int, help="samples in one epoch")
    j.add_argument("--dataset-tokens", type=positive_float, help="tokens in one epoch")
    j.add_argument("--epochs", type=positive_float, help="epochs over the dataset (default 1)")
    j.add_argument("--token-budget", type=positive_float, help="tokens to train on (instead of a dataset)")


def _add_output_options(o: argparse._ArgumentGroup) -> None:
    """``plan``'s options of what it prints, writes, pins, explains, validates or calibrates."""
    o.add_argument("--top", type=positive_int, default=10, help="layouts to show (default 10)")
    o.add_argument("--fix", default="", help="pin layout fields in the search, e.g. tp=8,pp=4,recompute=full")
    o.add_argument("--explain", metavar="LAYOUT", help="explain one layout, e.g. tp=8,pp=4,zero_stage=1,"
                                                       "micro_batch_size=2,recompute=selective")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--markdown", action="store_true", help="with --validate: print the Markdown table of docs/planner.md")
    o.add_argument("--plot", type=Path, metavar="PNG", help="write memory and step-time breakdowns of the top layouts")
    o.add_argument("--validate", type=Path, nargs="?", const=PUBLISHED_RUNS, metavar="FILE",
                   help="predict published runs and report the errors (default: the runs shipped with meshtrain, "
                        "planner/data/published_runs.toml)")
    o.add_argument("--calibrate", nargs="?", const="machine", choices=("machine", "one-per-source"),
                   help="alone: measure this machine and save a cpu profile; with --validate, one-per-source: "
                        "calibrate on each source's first run and report the error on its others")


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    """Dispatch the ``plan`` modes; ``extra`` are the config overrides after the known options.
    Raises ConfigError for any user mistake."""
    args.overrides = _config_overrides(args.config, extra or [])
    _check_modes(args)
    if args.calibrate == "machine":
        from meshtrain.planner.calibrate import calibrate
        path = calibrate(args.profile)
        print(json.dumps({"profile": str(path)}) if args.json else f"saved hardware profile to {path}")
        return 0
    if args.validate is not None:
        result = validate_file(args.validate, args.profile, calibrate=args.calibrate == "one-per-source")
        if args.json:
            print(json.dumps(result, indent=1))
        elif args.markdown:
            print(report.validation_markdown(result))
        else:
            report.print_validation(result)
        return 0
    if args.plot is not None:
        check_new_file(args.plot, "--plot")
    ctx = build_context(args)
    if args.explain is not None:
        layout = parse_layout(args.explain, ctx.job.num_devices, ctx.job.global_batch_size)
        return report.explain(ctx, layout, as_json=args.json)
    fixed = parse_fix(args.fix)
    pinned_model_errors(fixed, ctx.model)
    mine = report.config_estimate(ctx)  # ranked among all: the search predicts every layout that may be faster
    fitting = search(ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job, fixed=fixed, top=args.top,
                     through=mine.time.total if mine is not None else None, tight=True)  # tight layouts ranked too
    smallest = None
    if not fitting:
        unfit = search(ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job, fixed=fixed, keep_unfit=True)
        if not unfit:
            _raise_for_unavailable(ctx.framework, fixed, ctx.model)
            raise ConfigError(f"no layout of {ctx.model.name} on {ctx.job.num_devices} devices meets the divisibility "
                              f"rules with global_batch_size = {ctx.job.global_batch_size}: try another batch or --fix")
        smallest = min(unfit, key=lambda e: e.memory.total)
    if args.plot is not None:
        from meshtrain.planner.plot import plot_breakdowns
        plot_breakdowns(fitting[: args.top] or [smallest], args.plot, ctx.hw.device.memory_bytes)
    if args.json:
        # the memory range is the estimate's own (memory.memory_range: widened on an unvalidated device)
        print(json.dumps([r.to_dict() | {k: v for k, v in estimate_ranges(r, ctx.speed).items()
                                         if k != "memory_range_bytes"} | ctx.speed.to_dict()
                          for r in fitting[: args.top]], indent=1))
    else:
        sure = surely_fitting(ctx, fixed) if fitting and fitting[0].verdict == "tight" else None
        report.print_search(ctx, fitting, smallest, args.top, args.plot, mine, sure)
    return 0


MACHINE_ONLY = ("profile", "json", "calibrate")
"""The options ``--calibrate`` (machine) takes: where to save the profile and how to print its path."""
VALIDATE_ONLY = ("profile", "json", "markdown", "validate", "calibrate")
"""The options ``--validate`` takes; every other plan option would be ignored by it."""


NOT_OPTIONS = ("command", "func", "accepts_overrides", "overrides")
"""What ``args`` holds besides plan's options (the subcommand, its function, the config overrides)."""


def _given(args: argparse.Namespace, keep: tuple[str, ...]) -> list[str]:
    """The options of ``args`` other than ``keep`` given a value (not their default), as flags; the config and its
    overrides as CONFIG."""
    defaults = {"top": 10}
    return [("CONFIG" if key == "config" else f"--{key.replace('_', '-')}") for key, value in vars(args).items()
            if key not in (*NOT_OPTIONS, *keep) and value not in (None, False, "", defaults.get(key))]


def _check_modes(args: argparse.Namespace) -> None:
    """Raise ConfigError for options the mode given would silently drop: ``--calibrate`` (measure this machine) takes
    only ``--profile`` and ``--json``; ``--validate`` only ``--profile``, ``--json``, ``--markdown`` and
    ``--calibrate one-per-source``; ``--markdown`` and ``--calibrate one-per-source`` go with ``--validate``."""
    if args.calibrate == "machine":
        extra = _given(args, MACHINE_ONLY)
        if extra:
            hint = (" (--calibrate one-per-source calibrates the --validate runs)" if "--validate" in extra else "")
            raise ConfigError(f"--calibrate measures this machine and saves its profile; it takes --profile and --json "
                              f"only, not {', '.join(extra)}{hint}: run the calibration alone, then plan")
    elif args.validate is not None:
        extra = _given(args, VALIDATE_ONLY)
        if extra:
            raise ConfigError(f"--validate predicts the runs of its file and takes --profile, --json, --markdown and "
                              f"--calibrate one-per-source only, not {', '.join(extra)}: plan your job without "
                              f"--validate")
    elif args.calibrate == "one-per-source":
        raise ConfigError("--calibrate one-per-source goes with --validate [FILE]; --calibrate alone measures this machine")
    elif args.markdown:
        raise ConfigError("--markdown prints the table of --validate: give --validate [FILE], or --json for a plan")


def _config_overrides(config: str | None, extra: list[str]) -> dict[str, str]:
    """``meshtrain train``'s overrides (``--tp 2``, ``--model.n_layer 8``) after a training config.

    Raises:
        ConfigError: arguments without a config file before them, or not of the form ``--section.key VALUE``.
    """
    if not extra:
        return {}
    hint = "overrides such as --tp 2 follow a training config: meshtrain plan CONFIG --tp 2"
    if not config:
        raise ConfigError(f"unrecognized arguments: {' '.join(extra)} ({hint})")
    if not Path(config).is_file():  # argparse gives CONFIG the value after an unknown flag: --model X --tp 2
        raise ConfigError(f"config file '{config}' does not exist, or '{config}' is the value of {extra[0]}, which is "
                          f"not an option of plan; {hint}")
    return parse_overrides(extra)


def _config_precision(dtype: str, gpu: str) -> str:
    """The precision a config's ``train.dtype`` trains in on ``gpu``: ``auto`` is bf16 autocast on a GPU
    (every GPU in the catalogue has bf16 matmul) and, for ``cpu``, what this machine's CPU resolves it to."""
    if dtype == "auto":
        from meshtrain.runtime.device import compute_dtype

        dtype = compute_dtype(dtype, "cpu") if gpu == "cpu" else "bfloat16"
    return "bf16-autocast" if dtype == "bfloat16" else "fp32"


def surely_fitting(ctx: Context, fixed: dict) -> Estimate | None:
    """The fastest layout whose memory verdict is "fits" (its whole range within the device), or None: a search on
    the device shrunk to :func:`meshtrain.planner.memory.fits_budget`, estimated again on the real one."""
    device = ctx.hw.device
    shrunk = replace(ctx.hw, device=replace(device, memory_bytes=fits_budget(device)))
    found = search(ctx.model, shrunk, ctx.precision, ctx.framework, ctx.job, fixed=fixed, top=1)
    return estimate(ctx.model, found[0].layout, ctx.hw, ctx.precision, ctx.framework, ctx.job) if found else None


def _raise_for_unavailable(framework, fixed: dict, model) -> None:
    """Raise ConfigError naming the pinned ``--fix`` fields ``framework`` cannot run (if any)."""
    pinned = Layout(**{"dp": 1, **fixed})
    errors = framework_errors(framework, pinned, model)
    if errors:
        raise ConfigError(f"--fix asks for what {framework.name} cannot run: {'; '.join(errors)}")


MAX_DEVICES = 2**24
"""Most devices the search takes (16.8 M, far past any cluster): it factors the device count and the batch
(:func:`meshtrain.planner.search.divisors`, O(sqrt n)), which for 2**64 would not end."""
MAX_BATCH = 2**40
"""Most samples per optimizer step the search takes (1.1 T), for the same reason."""


def build_context(args: argparse.Namespace):
    """Resolve model, hardware, precision, framework and job from the arguments (and a config)."""
    cfg = None
    if args.config:
        cfg = load_config(args.config, getattr(args, "overrides", None))
    model = _model(args, cfg)
    stack_name, framework, gpu = _framework(args, cfg)
    run, hw = _hardware(args, cfg, gpu)
    dtype = args.dtype or (_config_precision(cfg.train.dtype, gpu) if cfg is not None else framework.mixed_precision)
    config_layout = None
    if cfg is not None:
        run = run or ResolvedRun.resolve(cfg, args.num_gpus)
        config_layout = Layout.from_config(cfg, run.world_size)
    job = _job(args, cfg, run, model)
    ctx = Context(model, hw, PRECISIONS[dtype], framework, job, config_layout)
    return _calibrated(ctx, args, stack_name)


def _model(args: argparse.Namespace, cfg):
    """The planner's model of ``--model`` (a preset or a TOML file), else of the config's ``[model]``."""
    if args.model:
        return load_model(args.model, args.seq_len)
    if cfg is None:
        raise ConfigError("give --model (a preset or a TOML file) or a training config")
    model = from_config(cfg)
    if args.seq_len:
        raise ConfigError("--seq-len cannot change a config's model: set model.block_size in the config")
    return model


def _framework(args: argparse.Namespace, cfg):
    """(stack name, framework, device): ``--stack`` or ``--framework`` (:func:`_stack`), under meshtrain with the
    config's FSDP2 unit size and compiled blocks, and ``--gpu`` (``cpu`` for a config without one)."""
    stack_name, framework = _stack(args)
    gpu = args.gpu or ("cpu" if cfg is not None else None)
    if cfg is not None and framework.name == "meshtrain":  # the config's FSDP2 unit size, compiled blocks or not
        framework = meshtrain_framework(cfg, "cpu" if gpu == "cpu" else "cuda")
        stack_name = framework.name  # meshtrain+compile where the config compiles its blocks: that stack's speed
    if gpu is None:
        raise ConfigError("give --gpu, e.g. --gpu H100-SXM-80GB (or cpu)")
    return stack_name, framework, gpu


def _hardware(args: argparse.Namespace, cfg, gpu: str):
    """(the config's resolved run or None, the hardware): a config without ``--gpu`` runs on this machine's CPU (its
    resolved run's threads, :func:`meshtrain.planner.actual.hardware_for_run`), anything else on ``--gpu``'s."""
    if cfg is not None and args.gpu is None:
        run = ResolvedRun.resolve(cfg, args.num_gpus)
        hw, _ = hardware_for_run("cpu", args.profile or DEFAULT_PROFILE, (os.cpu_count() or 1) if run.world_size == 1 else 1)
        return run, hw
    return None, get_hardware(gpu, args.hardware, args.profile, args.devices_per_node, args.nics_per_node)


def _job(args: argparse.Namespace, cfg, run, model):
    """The job: its devices and global batch (in sequences: the planner's unit), from the arguments or the config's
    resolved run, and its length (dataset, epochs, token budget, else the config's steps), each checked."""
    world = args.num_gpus
    gbs = args.global_batch_size
    if cfg is not None:
        world = run.world_size
        gbs = gbs or global_batch_size(cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps,
                                       run.dp) * sequences_per_sample(cfg)  # the planner counts sequences
    if args.global_batch_tokens:
        if args.global_batch_tokens % model.seq_len:
            raise ConfigError(f"--global-batch-tokens = {args.global_batch_tokens} is not a multiple of "
                              f"seq_len = {model.seq_len}")
        gbs = args.global_batch_tokens // model.seq_len
    if not world or world < 1:
        raise ConfigError("give --num-gpus N (>= 1)")
    if not gbs or gbs < 1:
        raise ConfigError("give --global-batch-size N or --global-batch-tokens N (>= 1)")
    if world > MAX_DEVICES:
        raise ConfigError(f"{world:,} devices (--num-gpus or the config's layout) is more than the planner searches: "
                          f"give at most {MAX_DEVICES:,}")
    if gbs > MAX_BATCH:
        raise ConfigError(f"a global batch of {gbs:,} samples is more than the planner searches: give at most "
                          f"{MAX_BATCH:,} (--global-batch-size, --global-batch-tokens / seq_len, or the config's batch)")
    samples = args.dataset_samples
    if args.dataset_tokens:
        samples = int(args.dataset_tokens // model.seq_len)
        if samples < 1:
            raise ConfigError(f"--dataset-tokens = {args.dataset_tokens:g} is less than one sample of seq_len = "
                              f"{model.seq_len} tokens: give at least {model.seq_len}")
    steps = cfg.train.steps if cfg is not None and not (samples or args.token_budget) else None
    return Job(world, gbs, num_samples=samples, epochs=args.epochs, token_budget=args.token_budget, total_steps=steps)


def _stack(args: argparse.Namespace):
    """(stack name, framework) of ``--stack`` or ``--framework`` (default meshtrain). Raises ConfigError for both."""
    if args.stack and args.framework:
        raise ConfigError(f"give --stack {args.stack} or --framework {args.framework}, not both (a stack is a framework "
                          f"with options)")
    return parse_stack(args.stack or args.framework or "meshtrain")


def _calibrated(ctx, args: argparse.Namespace, stack_name: str):
    """``ctx`` at the speed of its stack (:func:`meshtrain.planner.stack.speed_for`), or of the run given by
    ``--measured`` or ``--calibrate-from`` (:func:`meshtrain.planner.stack.fit_speed`), with the range that goes
    with it. Raises ConfigError for both, or a measurement no layout of this job reaches."""
    if args.measured and args.calibrate_from:
        raise ConfigError("give --measured or --calibrate-from, not both: one run calibrates the plan")
    if args.calibrate_from:
        factor, what = stack.run_dir_speed(args.calibrate_from, ctx.hw.device.name)
        speed = stack.calibrated_speed(factor, what, ctx.hw.device.name)
    elif args.measured:
        fixed, key, value = stack.parse_measured(args.measured)
        pinned_model_errors(fixed, ctx.model, "--measured")
        found = search(ctx.model, ctx.hw, ctx.precision, ctx.framework, ctx.job, fixed=fixed, keep_unfit=True)
        if not found:
            raise ConfigError(f"--measured {args.measured!r}: no valid layout of {ctx.model.name} on "
                              f"{ctx.job.num_devices} devices with global_batch_size {ctx.job.global_batch_size} "
                              f"has those fields")
        best = ([e for e in found if e.fits] or found)[0]  # a measured run trained: the layout that surely fits
        factor, seconds = stack.measured_speed(key, value, best, ctx.model, ctx.hw, ctx.precision, ctx.framework)
        speed = stack.calibrated_speed(factor, f"{best.layout.label()} at {seconds:.4g} s/step", ctx.hw.device.name)
    else:
        speed = stack.speed_for(stack_name, ctx.hw.device.name, peak_source=ctx.hw.device.peak_source)
    return replace(ctx, hw=stack.scaled(ctx.hw, speed.factor), speed=speed)
