"""Where the trainer's checkpoints go: written inline, or in the background (``checkpoint.async_save``).

Blocking (the default), a save is :func:`meshtrain.checkpoint.store.save`: every rank waits until its shards are
on disk and rank 0 has committed the step. Asynchronous, :meth:`Checkpoints.save` copies the state to CPU
memory (DCP's ``async_save`` stages it: the one part training waits for) and a background thread of each
rank writes that copy to ``step_N.tmp`` while training goes on. The guarantees are those of a blocking save:

- A step becomes visible only when complete: ``step_N.tmp`` is renamed to ``step_N`` (with ``meta.json``
  and its files manifest, :func:`meshtrain.checkpoint.store.commit`) only after every rank's write finished.
  Ranks learn that together: :meth:`Checkpoints.commit_if_written` (an all-reduce over all ranks, once a
  step while a write is in flight) commits as soon as every rank's write is done, and
  :meth:`Checkpoints.wait` blocks for it; either ends with an all-reduce of "did my write fail" over the
  checkpoint group, then the rename, then a barrier. A kill during the background write leaves
  ``step_N.tmp`` behind, never read, and the previous checkpoint committed.
- One save in flight at most: a save first waits for the previous one and commits it; ``checkpoint.keep``
  pruning runs at commit, over committed checkpoints only. The final save, the save on a stop signal
  and a stop from divergence wait for the write and commit it before the run ends.

The background thread runs DCP's collectives (plan exchange, the gather of write results) while the
training thread runs its own on the default group. Two threads issuing collectives on one group could
pair rank 0's gradient all-reduce with rank 1's plan gather, so the background write gets a process group
of its own (gloo, as DCP's ``async_save`` needs a CPU backend; also under NCCL). The writer is DCP's
thread executor (``AsyncCheckpointerType.THREAD``): the process executor would start a second process
per rank, with its own import of torch and its own rendezvous, which outlives a SIGKILL of its rank. Rank 0
computes the files manifest (a SHA-256 of every shard) in the background too, after the write.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from meshtrain.checkpoint import store as ckpt


@dataclass
class _Pending:
    step: int
    meta: dict[str, Any]
    files: Future
    """This rank's write, then (rank 0) the manifest of every rank's files; {} on the other ranks."""


class Checkpoints:
    """The trainer's checkpoint writer: blocking, or (``asynchronous``) DCP ``async_save`` in the background.

    Build it on every rank at the same point (asynchronous: a collective that makes the writer's gloo
    group, whose collectives time out after ``timeout_s`` seconds). Every method is collective: all ranks
    call it at the same point of the same step. ``device`` is where the default group's tensors live.
    """

    def __init__(self, out_dir: Path, keep: int, asynchronous: bool, timeout_s: float, device: torch.device) -> None:
        self.out_dir, self.keep, self.device = Path(out_dir), keep, device
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if asynchronous else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-manifest") if asynchronous else None
        self.pending: _Pending | None = None

    @property
    def in_flight(self) -> int | None:
        """The step whose background write is not committed yet, or None."""
        return self.pending.step if self.pending else None

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any],
             extra: Any = None) -> Path | None:
        """Checkpoint model + optimizer state (and ``extra``'s, :func:`meshtrain.checkpoint.store.state_to_save`)
        with ``meta`` (``meta.json`` without ``step`` and ``files``).

        Blocking: returns the committed step folder. Asynchronous: first waits for the save in flight and
        commits it, then stages this step's state to CPU memory and returns None while the background
        write runs (:meth:`commit_if_written`, :meth:`wait`).

        Raises:
            FileExistsError: that step is already committed (nothing is overwritten).
            OSError, RuntimeError: the previous background write failed (:meth:`wait`).
        """
        if self.group is None:
            return ckpt.save(self.out_dir, step, model, optimizer, meta, keep=self.keep, extra=extra)
        self.wait()
        tmp = ckpt.begin_save(self.out_dir, step)
        written = dcp.async_save(ckpt.state_to_save(model, optimizer, extra), checkpoint_id=str(tmp),
                                 process_group=self.group)
        self.pending = _Pending(step, meta, self.pool.submit(_manifest, written, tmp, dist.get_rank() == 0))
        return None

    def commit_if_written(self) -> Path | None:
        """Commit the save in flight if every rank's background write has finished; return the committed
        step folder, or None (nothing in flight, or a write still running). Collective over all ranks
        while a save is in flight (one all-reduce of one integer); free otherwise."""
        if self.pending is None:
            return None
        running = torch.tensor([0 if self.pending.files.done() else 1], device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(running, op=dist.ReduceOp.MAX)
        return None if running.item() else self.wait()

    def wait(self) -> Path | None:
        """Block until the save in flight is written on every rank, commit it and return its step folder
        (None: nothing in flight).

        Raises:
            OSError, RuntimeError: the write failed on this rank (its own error) or on another rank
                (RuntimeError); the step stays uncommitted under ``step_N.tmp``.
        """
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        try:
            files, failed = pending.files.result(), None
        except BaseException as e:  # DCP's CheckpointException is a BaseException; every rank must reach the
            files, failed = {}, e  # agreement below, whatever the error
        any_failed = torch.tensor([int(failed is not None)])
        dist.all_reduce(any_failed, op=dist.ReduceOp.MAX, group=self.group)  # every rank's write has ended
        if failed is not None:
            raise failed
        if any_failed.item():
            raise RuntimeError(f"the checkpoint of step {pending.step} was not committed: its background write "
                               f"failed on another rank (that rank says why)")
        final = ckpt.commit(self.out_dir, pending.step, pending.meta, files, self.keep)
        dist.barrier(group=self.group)  # committed for every rank when this returns
        return final


def _manifest(written: Future, tmp: Path, rank0: bool) -> dict[str, dict[str, Any]]:
    """Wait for this rank's DCP write; rank 0 (whose write ends after every rank's: DCP gathers their
    write results before it writes ``.metadata``) then records every file's size and SHA-256."""
    written.result()
    return ckpt.file_digests(tmp) if rank0 else {}
