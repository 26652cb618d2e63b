"""Stopping cleanly: preemption signals, a launcher that died, and collectives that fail or hang.

- **SIGTERM / SIGINT / SIGHUP** (a scheduler's preemption, Ctrl-C on the launcher, a closed terminal or
  SSH session; torchrun forwards each to its ranks): the handler only records the signal (:class:`StopRequest`). At the next step boundary the
  ranks agree on it (one all-reduce of the signal number over all ranks, :meth:`StopRequest.agreed`), so
  every rank stops after the same step; the trainer saves a checkpoint there and raises :class:`Stopped`,
  which rank 0 reports in one line. torchrun gives its ranks 30 s after forwarding the signal before it
  SIGKILLs them; a step plus a save longer than that ends in a SIGKILL, which the atomic checkpoint
  commit (:mod:`meshtrain.checkpoint`) survives.
- **The launcher dies** (SIGKILL, OOM killer): each rank asks the kernel for a SIGTERM when its parent
  exits (:func:`die_with_parent`, Linux ``prctl(PR_SET_PDEATHSIG)``), which stops it as above instead of
  leaving it to train on as an orphan.
- **A peer failed or a collective hung**: gloo raises in the ranks still waiting (``Connection closed
  by peer`` when a peer died; ``Timed out waiting ...`` after ``train.collective_timeout_s``).
  :func:`describe_collective_error` turns that into one line naming the phase of the step, the ranks
  it waited for and the cause, so the job's output holds the failed rank's own error once and a line
  from each rank that stopped because of it, not a traceback per rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

LAUNCHER_PID_ENV = "MESHTRAIN_LAUNCHER_PID"
"""Set by ``meshtrain train`` to its own pid: the parent every rank it starts must have."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop a run after a step with a checkpoint; SIGHUP (the terminal or SSH session closed)
would otherwise kill a rank mid-step with nothing saved."""


class Stopped(Exception):
    """The run stopped on a signal after ``step`` (None: at no shared step, the asynchronous trainer);
    ``checkpoint`` is the step folder saved there, or None when nothing was."""

    def __init__(self, signum: int, step: int | None, total_steps: int, checkpoint: object | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if step is None:
            text = f"stopped by {name}; an asynchronous run keeps its newest periodic checkpoint (continue with --resume)"
        elif checkpoint is not None:
            text = (f"stopped by {name} after step {step} of {total_steps}; saved {checkpoint}: continue with "
                    f"the same command plus --resume")
        elif step == 0:
            text = f"stopped by {name} before the first step; nothing was written"
        else:
            text = f"stopped by {name} after step {step} of {total_steps}; nothing saved since the last checkpoint"
        super().__init__(text)

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention for a process ended by a signal (130 for SIGINT)."""
        return 128 + self.signum


class StopRequest:
    """Records SIGTERM/SIGINT/SIGHUP for the training loop to act on at a step boundary.

    ``install()`` (main thread only) replaces the handlers of :data:`STOP_SIGNALS`; ``signum`` is the last signal received
    (0: none). With ``immediate=True`` the handler raises :class:`Stopped` at once instead, for loops
    that have no step all ranks share (the asynchronous trainer).
    """

    def __init__(self) -> None:
        self.signum = 0
        self.immediate = False
        self.installed = False

    def install(self, immediate: bool = False) -> None:
        self.immediate = immediate
        if threading.current_thread() is threading.main_thread():
            self.installed = True
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.signum
        self.signum = signum
        if self.immediate and first:
            raise Stopped(signum, None, 0, None)

    def agreed(self, device: object) -> int:
        """Collective over all ranks: the largest signal number any rank received (0: carry on).

        Every rank calls it at the same point of the same step, so all stop after the same step.
        ``device`` is where the collective's tensor lives (``torch.device``).
        """
        import torch  # here, not at the top: a rank imports this module before torch (meshtrain.train)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


STOP = StopRequest()
"""This process's stop request: installed by the rank's ``main``, read by the trainers."""


def die_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when its parent exits (``prctl(PR_SET_PDEATHSIG)``), and
    exit at once if the parent is already gone (it died before the request; ``MESHTRAIN_LAUNCHER_PID``
    names the launcher ``meshtrain train`` was). A no-op off Linux.

    Raises:
        SystemExit: the launcher that started this rank is no longer its parent.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # here: a rank installs its handlers before anything slow is imported

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):
        raise SystemExit(f"meshtrain train: rank {os.environ.get('RANK', '?')}: its launcher (pid {launcher}) "
                         f"is gone; not starting")


PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "pair closure")
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")


_PHASE: tuple[str, list[int]] = ("setup", [])
"""What this rank is doing and the global ranks it depends on, for the entry point's one-line errors."""


def enter_phase(phase: str, ranks: list[int]) -> None:
    """Record the phase this rank enters (``"step 3: loss all-reduce"``) and the ranks its collectives wait on."""
    global _PHASE
    _PHASE = (phase, ranks)


def current_phase() -> tuple[str, list[int]]:
    """``(phase, ranks)`` last recorded by :func:`enter_phase`."""
    return _PHASE


def describe_collective_error(error: BaseException, rank: int, phase: str, ranks: list[int],
                              timeout_s: float) -> str | None:
    """One line for a collective that failed because of another rank, or None for any other error.

    ``phase`` names what this rank was doing ("step 12: loss all-reduce"), ``ranks`` the global ranks of
    the collective's group. A timeout says which setting bounds it; a closed connection says a peer
    failed (its own error is printed by that rank).
    """
    text = str(error)
    cause = text.split("] ", 1)[-1].split(". ")[0].strip()  # gloo's message without its source location
    group = _ranks_text(ranks)
    if any(m in text for m in PEER_FAILED):
        return (f"rank {rank}: stopped in {phase}: a peer among ranks {group} closed its connection (it failed "
                f"or was killed; its own error is above): {cause}")
    if any(m in text for m in TIMED_OUT):
        return (f"rank {rank}: {phase} waited on ranks {group} longer than train.collective_timeout_s = "
                f"{timeout_s:g} s: {cause}; a rank of that group is stuck or died (see its output), or raise the "
                f"timeout")
    return None


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> "0-3"; a non-contiguous set is listed."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
