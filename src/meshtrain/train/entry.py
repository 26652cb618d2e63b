"""The entry point of a rank: ``python -m meshtrain.train --resolved PATH`` (started by ``meshtrain train``) or
``python -m meshtrain.train CONFIG [--section.key VALUE ...]`` (under torchrun directly).

:func:`main` reads the resolved run the launcher wrote (:mod:`meshtrain.resolved`), or loads and resolves the
config for this world, runs the pre-launch checks where no launcher ran them, picks the run (the
synchronous loop, or the parameter server where the parallel layer says so) and turns its ending into one
line and an exit code.
"""

from __future__ import annotations

import errno
import gc
import os
import sys
from typing import Any

import torch.distributed as dist

from torch.distributed.checkpoint.api import CheckpointException

from meshtrain.checkpoint.store import elastic_restart, resume_hint
from meshtrain.config.load import load_config, parse_overrides
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError, DataError
from meshtrain.resolved import ResolvedRun, config_of
from meshtrain.rules.support import uses_parameter_server
from meshtrain import runlock
from meshtrain.preflight import preflight
from meshtrain.runtime.faults import (LAUNCHER_PID_ENV, STOP, Stopped, current_phase, describe_collective_error,
                                      die_with_parent)
from meshtrain.train.async_run import AsyncRun
from meshtrain.train.loop import Trainer, TrainingDiverged


def train(run: ResolvedRun | Config) -> dict[str, Any]:
    """Run ``run`` (a bare Config is resolved for the process group's world) on this process's rank (joins torchrun's group, or a 1-rank group without torchrun).

    On success, and on a stop all ranks agreed on (:class:`meshtrain.runtime.faults.Stopped`), every rank
    meets at a barrier before the process group is destroyed, so that no rank tears down gloo's worker
    threads while a peer still has collectives in flight (a rank that exits early can otherwise abort
    with "terminate called without an active exception").

    Raises:
        Stopped: SIGTERM/SIGINT/SIGHUP; the synchronous trainer saved a checkpoint after the step all ranks stopped at.
        TrainingDiverged: too many non-finite steps in a row.
    """
    finished, trainer = False, None
    try:
        cfg = config_of(run)
        trainer = AsyncRun(run) if uses_parameter_server(cfg.parallel.sync_mode) else Trainer(run)
        summary = trainer.run()
        finished = True
        return summary
    except Stopped:
        finished = not STOP.immediate  # the synchronous trainer's ranks all stopped after the same step
        raise
    finally:
        # FSDP/DDP state forms reference cycles that hold the process groups; free it while the
        # interpreter is whole rather than at exit.
        del trainer
        gc.collect()
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()


USAGE = "usage: python -m meshtrain.train (--resolved PATH | CONFIG [--section.key VALUE ...])"


def read_run(argv: list[str]) -> ResolvedRun:
    """The run of a rank's command line: ``--resolved PATH`` (the launcher's file), or ``CONFIG [overrides]``
    resolved for ``WORLD_SIZE`` ranks.

    Raises:
        ConfigError: a file or key that is not valid, or ranks that do not suit the config.
    """
    if argv[0] == "--resolved":
        if len(argv) != 2:
            raise ConfigError(f"--resolved takes one path and nothing after it: {USAGE}")
        return ResolvedRun.read(argv[1])
    cfg = load_config(argv[0], parse_overrides(argv[1:]))
    return ResolvedRun.resolve(cfg, int(os.environ.get("WORLD_SIZE", "1")))


def main(argv: list[str] | None = None) -> int:
    """``python -m meshtrain.train (--resolved PATH | CONFIG [--section.key VALUE ...])`` on every rank (under torchrun).

    Exit codes: 0 done; 1 a collective failed because of another rank (one line; the failed rank prints
    its own error); 2 a bad config; 3 training diverged; 128 + N stopped by signal N after saving.
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0].startswith("-") and argv[0] != "--resolved"):
        print(USAGE, file=sys.stderr)
        return 2
    if "LOCAL_RANK" in os.environ and not STOP.installed:  # a rank started by torchrun: stop with the
        die_with_parent()  # launcher, never train on as an orphan (done on import when run as __main__)
    STOP.install()
    rank = int(os.environ.get("RANK", "0"))
    lock = None
    try:
        run = read_run(argv)
        cfg = run.config
        if rank == 0 and runlock.HELD_ENV not in os.environ:  # no launcher holds the output folder: rank 0 does
            lock = runlock.hold(cfg.train.out_dir)
        if not elastic_restart() and LAUNCHER_PID_ENV not in os.environ:  # the checks of `meshtrain train`
            # (which ran them once, before starting the ranks) for ranks started by torchrun itself; every rank
            # runs them before joining the group, so none can see another rank's new files
            preflight(run)
    except ConfigError as e:
        if lock:
            lock.release()
        print(f"meshtrain train: error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(run, rank)
    finally:
        if lock:
            lock.release()


def _run(run: ResolvedRun, rank: int) -> int:
    """Train ``run`` on this rank: its ending as an exit code and at most one line (see :func:`main`)."""
    cfg = run.config
    STOP.install(immediate=uses_parameter_server(cfg.parallel.sync_mode))  # no step boundary the async ranks share
    try:
        if STOP.signum:  # while starting: every rank got it (torchrun signals each), none joins the group
            raise Stopped(STOP.signum, 0, cfg.train.steps, None)
        train(run)
    except TrainingDiverged as e:
        if rank == 0:  # every rank stops at the same step; one says why
            print(f"meshtrain train: error: {e}", file=sys.stderr)
        return 3
    except DataError as e:  # damaged data only this rank read: it says so, the others stop at the next collective
        print(f"meshtrain train: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except ConfigError as e:  # found while setting up (a file that changed since the checks): every rank
        if rank == 0:  # reads the same files, so every rank stops here; one says why
            print(f"meshtrain train: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        if rank == 0:
            print(f"meshtrain train: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except (OSError, CheckpointException) as e:  # a write that failed: a full disk, a read-only folder, ...
        error = write_error(e)
        if error is None:
            raise
        print(f"meshtrain train: error: rank {rank}: stopped in {current_phase()[0]}: {error}; nothing committed "
              f"was changed: after freeing space (or fixing the folder), {resume_hint(cfg.train.out_dir)}",
              file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:  # gloo's errors (DistBackendError is one) when a peer died or a wait timed out
        line = describe_collective_error(e, rank, *current_phase(), cfg.train.collective_timeout_s)
        if line is None:
            raise
        if not STOP.signum:  # after a stop signal, a peer that went first is expected, not news
            print(f"meshtrain train: error: {line}", file=sys.stderr, flush=True)
        return 128 + STOP.signum if STOP.signum else 1
    return 0


_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}
"""A file write's errors that may come without a file name (a full disk on ``write()`` of an open file)."""


def write_error(error: BaseException) -> str | None:
    """What failed, in a few words, for an ``OSError`` of a file write (or DCP's ``CheckpointException``
    wrapping one from any rank): ``"could not write PATH: No space left on device"``; None for other errors."""
    if isinstance(error, CheckpointException):
        wrapped = [exc for exc, _ in error.failures.values() if isinstance(exc, OSError)]
        if not wrapped:
            return None
        error = wrapped[0]
    if not isinstance(error, OSError) or error.errno is None:
        return None
    if error.filename is None and error.errno not in _WRITE_ERRNOS:  # a socket's (EADDRINUSE), not a file's
        return None
    where = f" {error.filename}" if error.filename else ""
    return f"could not write{where}: {error.strerror or error}"
