"""``meshtrain train CONFIG [--nproc N] [overrides]``: validate, then start the ranks with torchrun's engine.

Everything that can be checked without a process group is checked here, before any process is
spawned: the config, the layout against ``--nproc``, the corpus, the output folder (never reuse a
folder that holds another run) and the checkpoint to resume. Then ``torch.distributed.run`` starts
``nproc`` ranks of ``python -m meshtrain.train`` (the elastic agent, so ``--max-restarts`` and
multi-node rendezvous work exactly as with ``torchrun``). Ctrl-C or SIGTERM here is forwarded to the
ranks, which stop after a step and save (:mod:`meshtrain.runtime.faults`); the launcher then exits 128 + N.
So is SIGHUP (the terminal or SSH session closed). The launcher holds the output folder's lock
(:mod:`meshtrain.runlock`) from before its checks until it exits: a second run on the same folder is refused.

After a successful run, node rank 0 compares plan and actual (docs/architecture.md, "Layers": the trainer
does not import the planner): it reads ``OUT/summary.json``, which global rank 0 writes at the end of
every run, predicts the same layout with the planner (:func:`meshtrain.planner.actual.report_run`),
prints one ``plan vs actual: ...`` line to stderr and writes ``OUT/plan_vs_actual.json``. Ranks started
by ``torchrun -m meshtrain.train`` directly write ``summary.json`` but no comparison.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from meshtrain.argtypes import nonnegative_int
from meshtrain.axes import SHORT_FLAGS as AXIS_FLAGS
from meshtrain.config.checks import validate
from meshtrain.config.load import init_from_origins, load_config, parse_overrides, set_key
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.launch.checks import check_memory, print_pipeline_split, warn_slow_bf16
from meshtrain.launch.rendezvous import check_rendezvous
from meshtrain.launch.outcome import describe_run_folder, report_plan_vs_actual
from meshtrain import runlock
from meshtrain.preflight import preflight
from meshtrain.resolved import FILE_NAME, ResolvedRun

SHORT = {**AXIS_FLAGS, "steps": "train.steps", "seed": "train.seed"}
"""The short flags of ``meshtrain train`` (one per axis, ``--steps``, ``--seed``) and the keys they set."""


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser(
        "train", allow_abbrev=False, help=line,
        description="Train CONFIG (TOML) on N local ranks, or on several nodes with --nnodes/--rdzv-endpoint. "
                    "Any config key can be overridden as --section.key VALUE, e.g. --parallel.zero_stage 3 "
                    "--train.dtype bfloat16.",
        epilog="Equivalent without meshtrain's checks: torchrun --nproc-per-node N -m meshtrain.train CONFIG [overrides]")
    p.add_argument("config", help="TOML config, e.g. configs/shakespeare_char.toml")
    p.add_argument("--nproc", type=int, help="ranks on this node (default: pp*dp*sp*tp of the config)")
    for name, key in SHORT.items():
        p.add_argument(f"--{name}", type=str, help=f"short for --{key}")
    p.add_argument("--layout", choices=("config", "auto"), default="config",
                   help="config: the config's layout (default); auto: the planner picks dp/tp/pp/sp/ep, zero stage, "
                        "micro-batch size, gradient accumulation, recompute and pipeline schedule for these ranks, "
                        "keeping the config's global batch (layout keys given here are pinned; docs/planner.md)")
    p.add_argument("--calibrate-from", type=Path, metavar="RUN_DIR",
                   help="with --layout auto: rank the layouts at the speed a finished run on this machine measured "
                        "(its --out folder's plan_vs_actual.json; docs/planner.md, \"Stacks and calibration\")")
    p.add_argument("--out", help="output folder (short for --train.out_dir); must not hold another run")
    p.add_argument("--resume", nargs="?", const="@out", metavar="PATH",
                   help="continue from a checkpoint: a step folder or a run folder (its latest); "
                        "without PATH, the latest checkpoint in the output folder")
    p.add_argument("--nnodes", default="1", help="torchrun --nnodes (e.g. 2 or 1:4 for elastic)")
    p.add_argument("--node-rank", type=nonnegative_int, default=None,
                   help="this node's rank, 0..nnodes-1 (static rendezvous at --rdzv-endpoint; without it the c10d "
                        "rendezvous numbers the nodes as they join)")
    p.add_argument("--rdzv-endpoint", default="", help="torchrun --rdzv-endpoint HOST:PORT for multi-node")
    p.add_argument("--max-restarts", type=nonnegative_int, default=0,
                   help="restart all ranks this often after a failure; they resume from the latest checkpoint")
    p.set_defaults(func=run, accepts_overrides=True)


def build_config(args: argparse.Namespace, extra: list[str]) -> Config:
    """The validated config of a ``train`` command line. Raises ConfigError."""
    overrides = _command_line_overrides(args, extra)
    if args.out is not None:
        overrides["train.out_dir"] = args.out
    if args.resume is not None:
        overrides["checkpoint.resume"] = args.resume
    # --layout auto chooses micro_batch_size and the accumulation steps: the config's need not fit a pinned pp yet
    cfg = load_config(args.config, overrides, schedule=args.layout != "auto")
    if cfg.checkpoint.resume == "@out":
        cfg.checkpoint.resume = cfg.train.out_dir
    return cfg


def _command_line_overrides(args: argparse.Namespace, extra: list[str]) -> dict[str, str]:
    """The ``section.key`` overrides of the command line (``--tp 2`` as ``parallel.tp``), not the config file's."""
    overrides = parse_overrides(extra)
    for name, key in SHORT.items():
        if getattr(args, name) is not None:
            overrides[key] = getattr(args, name)
    return overrides


def torchrun_argv(args: argparse.Namespace, nproc: int, local_store: str | None, resolved: Path) -> list[str]:
    """torchrun's arguments: ``nproc`` ranks of ``python -m meshtrain.train --resolved RESOLVED`` (the run this
    launcher resolved, :mod:`meshtrain.resolved`). ``local_store`` (a file path; needed without
    ``--rdzv-endpoint``, one machine): the agents' rendezvous goes through that file instead of a TCP server, so
    nothing of the launcher listens on the network (:func:`meshtrain.runtime.distributed.init_distributed` binds
    the ranks' store to 127.0.0.1)."""
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={args.nnodes}", f"--max-restarts={args.max_restarts}"]
    if args.rdzv_endpoint and args.node_rank is not None:  # the user numbered the nodes: static rendezvous
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        argv += [f"--node-rank={args.node_rank}", "--rdzv-backend=static", f"--master-addr={host}",
                 f"--master-port={port}"]
    elif args.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={local_store}", "--rdzv-conf=store_type=file"]
    return argv + ["-m", "meshtrain.train", "--resolved", str(resolved)]


def _nnodes_max(nnodes: str) -> int:
    """The most nodes ``--nnodes`` allows: N, or MAX of torchrun's elastic ``MIN:MAX`` (1 <= MIN <= MAX).

    Raises:
        ConfigError: not N or MIN:MAX of integers, a count below 1, or MIN above MAX.
    """
    try:
        counts = [int(part) for part in str(nnodes).split(":")]
    except ValueError:
        raise ConfigError(f"--nnodes = {nnodes!r} is not valid: use N or MIN:MAX") from None
    if len(counts) > 2 or min(counts) < 1:
        raise ConfigError(f"--nnodes = {nnodes!r} is not valid: use N or MIN:MAX, each >= 1")
    if counts[0] > counts[-1]:
        raise ConfigError(f"--nnodes = {nnodes!r} is not valid: MIN = {counts[0]} exceeds MAX = {counts[-1]}; use "
                          f"MIN:MAX with MIN <= MAX")
    return counts[-1]


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    """``meshtrain train``: resolve the run once (config, command line, ``--layout auto``), check it, start its
    ranks. Returns the exit code."""
    extra = list(extra or [])
    cfg = build_config(args, extra)
    nnodes = _nnodes_max(args.nnodes)
    if args.nproc is None:
        world = ResolvedRun.resolve(cfg, None).world_size
        if world % nnodes:
            raise ConfigError(f"world size {world} is not divisible by --nnodes {nnodes}: give --nproc")
        nproc = world // nnodes
    else:
        nproc = args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be >= 1")
    if cfg.parallel.sync_mode == "diloco" and cfg.diloco.group == 0:
        cfg.diloco.group = nproc  # one worker per node
    if args.calibrate_from is not None and args.layout != "auto":
        raise ConfigError(f"--calibrate-from {args.calibrate_from} goes with --layout auto (it ranks the layouts); "
                          f"the config's layout is run as it is")
    if args.layout == "auto":
        from meshtrain.launch import auto

        chosen = auto.apply(cfg, _command_line_overrides(args, extra), nproc * nnodes, nproc, rank_threads(nproc),
                            args.calibrate_from)
        for key, value in chosen.items():
            set_key(cfg, key, value)
        validate(cfg)
    resolved = ResolvedRun.resolve(cfg, nproc * nnodes, args.layout)
    check_rendezvous(args, nnodes)
    # one run per folder: the lock is this process's until it exits (the kernel drops it if it is killed);
    # with several nodes only node 0's launcher holds it (a shared file system would refuse the others)
    lock = runlock.hold(cfg.train.out_dir) if nnodes == 1 or args.node_rank == 0 else None
    if lock:
        os.environ[runlock.HELD_ENV] = str(os.getpid())  # its ranks do not take it again
    try:
        return _launch(args, resolved, nproc, nnodes)
    finally:
        os.environ.pop(runlock.HELD_ENV, None)
        if lock:
            lock.release()


def _launch(args: argparse.Namespace, resolved: ResolvedRun, nproc: int, nnodes: int) -> int:
    """The pre-launch checks, then the resolved run written to this launcher's temporary folder and its ranks
    under torchrun's engine, then the plan-vs-actual report."""
    cfg = resolved.config
    _check_before_launch(resolved, nproc)

    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torch.distributed.elastic.multiprocessing.api import SignalException

    run_dir = Path(tempfile.mkdtemp(prefix="meshtrain-run-"))  # this launcher's: the resolved run, the local store
    local_store = None if args.rdzv_endpoint else str(run_dir / "store")
    torch_args = get_args_parser().parse_args(torchrun_argv(args, nproc, local_store, resolved.write(run_dir / FILE_NAME)))
    threads = rank_threads(nproc)
    reserved = _set_rank_environment(threads, local_store)
    quiet = _QuietForwarding()
    for name in _FORWARDING_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun(torch_args)
    except SignalException as e:  # Ctrl-C, SIGTERM or SIGHUP here: torchrun forwarded it; rank 0 said where it stopped
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return _failed(e, cfg)
    finally:
        _clear_rank_environment(reserved)
        shutil.rmtree(run_dir, ignore_errors=True)
        for name in _FORWARDING_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    if not args.node_rank:  # None (one node, or c10d) or 0; only the node holding summary.json reports
        report_plan_vs_actual(cfg, threads)
        print(describe_run_folder(Path(cfg.train.out_dir)), file=sys.stderr)
    return 0


def _check_before_launch(resolved: ResolvedRun, nproc: int) -> None:
    """The checks of the resolved run before any rank starts (torch not loaded yet), and what the launcher says about
    it: the memory check, a slow bf16, the training keys a Hugging Face ``config.json`` set, the pipeline split."""
    cfg = resolved.config
    preflight(resolved)
    if cfg.train.check_memory:
        check_memory(resolved, nproc)
    warn_slow_bf16(cfg)
    for line in init_from_origins(cfg.model):  # the training keys a Hugging Face config.json holds: whose value
        print(f"meshtrain train: {line}", file=sys.stderr)
    if cfg.parallel.pp > 1:
        print_pipeline_split(cfg)


def _set_rank_environment(threads: int, local_store: str | None):
    """Set the environment the ranks inherit (their threads, this launcher's pid, the stop signals, and on one machine
    loopback sockets and the reserved store port). Returns the reserved port's socket, or None across machines."""
    from meshtrain.runtime.faults import LAUNCHER_PID_ENV
    from meshtrain.runtime.distributed import LOOPBACK_ENV, STORE_PORT_ENV, reserve_loopback_port

    os.environ["OMP_NUM_THREADS"] = str(threads)  # the ranks inherit it (torchrun would set 1)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # each rank checks it is still this process's child
    # A store of their own for each restart's ranks: on the agent's shared store, gloo's ranks of a later
    # restart can read a dead rank's address from an earlier one and hang connecting (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[SIGNALS_ENV] = stop_signals(os.environ.get(SIGNALS_ENV))  # SIGHUP too: forwarded, not fatal
    reserved = reserve_loopback_port() if local_store else None
    if local_store:  # one machine: every socket of the run listens on 127.0.0.1 only
        os.environ[LOOPBACK_ENV] = "1"
        os.environ[STORE_PORT_ENV] = str(reserved.getsockname()[1])
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
    return reserved


def _clear_rank_environment(reserved) -> None:
    """Undo what :func:`_set_rank_environment` set for this run only, and release the reserved port."""
    from meshtrain.runtime.faults import LAUNCHER_PID_ENV
    from meshtrain.runtime.distributed import LOOPBACK_ENV, STORE_PORT_ENV

    os.environ.pop(LAUNCHER_PID_ENV, None)
    os.environ.pop(LOOPBACK_ENV, None)
    os.environ.pop(STORE_PORT_ENV, None)
    if reserved is not None:
        reserved.close()


def _failed(e, cfg: Config) -> int:
    """The launcher's exit code when ranks failed (``e``: torchrun's ``ChildFailedError``): 2 when they said why in
    one line (a user's mistake), :data:`DIVERGED` when rank 0 stopped a diverging run, else 1 after the resume hint."""
    codes = [f.exitcode for f in e.failures.values()]
    if said_in_one_line(codes):
        return 2
    if said_in_one_line(codes, DIVERGED):  # train.max_nonfinite_steps: rank 0 said at which step
        return DIVERGED
    from meshtrain.checkpoint.store import resume_hint

    hint = resume_hint(Path(cfg.train.out_dir))
    print(f"meshtrain train: error: {len(e.failures)} rank(s) failed; see their output above. "
          f"{hint[0].upper()}{hint[1:]}.", file=sys.stderr)
    return 1


DIVERGED = 3
"""A rank's exit code when ``train.max_nonfinite_steps`` stopped the run (:mod:`meshtrain.train.entry`), which the
launcher passes on."""


def said_in_one_line(exit_codes: list[int], code: int = 2) -> bool:
    """Whether failed ranks' exit codes (negative: the signal that ended a rank) are an ending a rank said in one line,
    ``code``: 2, a config or data error, or :data:`DIVERGED`: one rank at least exited ``code``, and each other one
    exited ``code`` too or was stopped by a signal (torchrun terminates the others once one fails, often before they
    say their own line)."""
    return code in exit_codes and all(c == code or c < 0 for c in exit_codes)


SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""The signals torchrun's engine catches in the launcher and forwards to its ranks (its default includes ours)."""


def stop_signals(configured: str | None) -> str:
    """``TORCHELASTIC_SIGNALS_TO_HANDLE`` with the ranks' stop signals (SIGTERM, SIGINT, SIGHUP) added, so a
    closed terminal reaches the ranks, which save, instead of killing the launcher alone."""
    names = [n.strip() for n in (configured or "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",") if n.strip()]
    return ",".join(names + [n for n in ("SIGTERM", "SIGINT", "SIGHUP") if n not in names])


_FORWARDING_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class _QuietForwarding(logging.Filter):
    """Drops torchrun's warnings that it received a signal and forwards it to each rank (the ranks stop
    after a step, save, and rank 0 says so in one line, :mod:`meshtrain.runtime.faults`), and its report of
    ranks that exited 2 (a config error rank 0 said in one line) or 3 (the non-finite stop, said likewise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage()
                       for text in ("death signal", "closing signal", "(exitcode: 2)", "(exitcode: 3)"))


def rank_threads(nproc: int) -> int:
    """Torch threads of each of the ``nproc`` ranks on this node: ``OMP_NUM_THREADS`` if set, else the
    cores this process may run on shared out (``cores // nproc``, at least 1; torchrun alone would give
    every rank 1 thread and leave the other cores idle), and torch's default (one per core) for one rank."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) >= 1:
        return int(value)
    if nproc > 1:
        return max(1, len(os.sched_getaffinity(0)) // nproc)
    import torch
    return torch.get_num_threads()
