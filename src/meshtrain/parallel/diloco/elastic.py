"""Elastic DiLoCo workers (``diloco.lighthouse``): each worker its own job, free to leave and rejoin.

Under :class:`meshtrain.parallel.diloco.outer.DiLoCo` the workers are rank groups of one torchrun job, and torchrun
restarts a whole job when one rank fails: every worker would stop. Here each worker is a job of its own
(``meshtrain train ... --diloco.worker I``), and the outer all-reduce runs through torchft (PyTorch's
fault-tolerance library, pytorch/torchft): at every outer step the workers alive ask a lighthouse
(``torchft_lighthouse``) for a quorum, the all-reduce runs over a process group re-formed for that quorum, and
each worker commits the step only if its all-reduce succeeded (``Manager.should_commit``). A worker that dies
stops heartbeating and drops out of the next quorum (after the lighthouse's ``--heartbeat_timeout_ms``); the
others go on. When ``--max-restarts`` brings it back, it joins before its first inner step
(:meth:`ElasticDiLoCo.join`): its first quorum is the others' next outer step, where it is behind, so torchft
sends it a living worker's state (the outer weights, the outer momentum, the step, and through the trainer's
callbacks the inner optimizer, the sampler and the LR schedule) and it takes that outer step with them, adding
nothing to the average. From there it is one of them again.

The arithmetic is DiLoCo's (Douillard et al. 2023, arXiv:2311.08105, Algorithm 1) over the workers in the
quorum. Each sends ``[theta_outer - theta_w, 1]`` if it took inner steps since its last outer step and
``[0, 0]`` if it did not (a worker joining, which torchft also zeroes); the sum's last entry counts the
pseudo-gradients, so::

    Delta = sum_w (theta_outer - theta_w) / (workers that took steps)

and an outer step where no worker took inner steps (all joining at once) moves nothing. With every worker
alive and a fresh start this is exactly :class:`~meshtrain.parallel.diloco.outer.DiLoCo` with one fragment
(tests/test_elastic.py). A step whose all-reduce failed (a worker died inside it) is not committed: the outer
weights and momentum stay, each worker keeps its weights, and the next outer step's pseudo-gradient carries
both rounds.

Beside the pseudo-gradient each worker sends fp32 notes, one entry per worker index: its vote to stop (a worker that
diverged: every worker of the quorum stops at that outer step, :meth:`DiLoCo.after_step`), its claim of its index and
its job's start time. Two jobs started together with one ``diloco.worker`` both pass the pre-launch check; the summed
claims show the index twice to every worker alike, and the later job stops in one line
(:meth:`ElasticDiLoCo._check_claim`).

Elastic workers sync the whole model at once and apply it at once (``diloco_fragments = 1``, ``diloco_delay =
0``, ``diloco_alpha = 0``), in fp32 or bf16, and save checkpoints at outer steps only, where each worker's
weights are the outer weights; ``config.checks`` refuses the rest before launch.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.parallel.diloco.outer import DiLoCo, _local

STATE_KEY = "meshtrain"
"""The key of the worker's state in what torchft sends a rejoining worker."""


class ElasticDiLoCo(DiLoCo):
    """DiLoCo's outer loop with its workers in separate jobs, joined through a torchft lighthouse.

    Args:
        model: this rank's part of the model (one worker's layout: DDP, FSDP2, tp, pp, sp inside).
        n_layer, d, replica_group: as :class:`~meshtrain.parallel.diloco.outer.DiLoCo`'s (one fragment, no delay, no
            mixing, precision "fp32" or "bf16"), and of ``d``: ``lighthouse``, the lighthouse's ``http://HOST:PORT``;
            ``worker``, this job's worker index (torchft's replica id ``worker{I}``); ``workers``, the run's.
        timeout_s: how long a quorum, an all-reduce or a state transfer may wait (seconds); a joining worker
            waits for the others' next outer step, so it must exceed H inner steps.
        loopback: the job's store is on 127.0.0.1 (one machine): the manager advertises 127.0.0.1 too.

    Raises:
        ImportError: torchft is not installed (``pip install torchft``).
    """

    def __init__(self, model: nn.Module, n_layer: int, d: Any, replica_group: dist.ProcessGroup | None,
                 timeout_s: float, loopback: bool) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO (2 lines a step)
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        logging.getLogger("torchft.manager").addFilter(_no_flight_recorder)

        super().__init__(model, None, n_layer, d, replica_group=replica_group)
        lighthouse, worker = d.lighthouse, d.worker
        self.worker, self.shares = worker, d.workers
        timeout = timedelta(seconds=timeout_s)
        # the same backend as the job's own group (gloo on CPUs, NCCL on GPUs: meshtrain.runtime.device)
        pg = ProcessGroupGloo(timeout=timeout) if dist.get_backend() == "gloo" else ProcessGroupNCCL(timeout=timeout)
        host = "127.0.0.1" if loopback else os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
                               timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                               rank=dist.get_rank(), world_size=dist.get_world_size(),
                               store_addr=host, store_port=int(os.environ.get("MASTER_PORT", "29500")),
                               lighthouse_addr=lighthouse, replica_id=f"worker{worker}",
                               hostname="127.0.0.1" if loopback else os.uname().nodename,
                               init_sync=False)  # every worker builds the same weights from train.seed
        self.manager.register_state_dict_fn(STATE_KEY, self._load_state, self._state)
        self.lighthouse = lighthouse
        self.ticket = _start_ticket(self.device)
        self._trainer: tuple[torch.optim.Optimizer, Any, Any] | None = None
        self.step = 0
        """The inner step of the outer step in progress (what a rejoining worker continues from)."""
        self.healed_at: int | None = None
        """The step a rejoining worker took over from a living one, or None."""
        self.failed_commits = 0
        self.participants = 0
        """Workers in the last quorum."""

    def data_share(self, dims: Any, rank: int) -> tuple[int, int]:
        """This job reads share ``diloco.worker`` of ``diloco.workers``."""
        return self.shares, self.worker

    def start(self, step: int, optimizer: Any = None, sampler: Any = None, scheduler: Any = None) -> int:
        """Join the workers before inner step ``step + 1`` (``step``: 0, or the step a checkpoint resumed), with the
        trainer's part of the state a rejoining worker takes over: the inner optimizer (this rank's shards), the
        sampler's position and the LR schedule (each with ``state_dict``/``load_state_dict``). Return the step to
        continue after: a living worker's when this one was behind and took over its state, else ``step``. Blocks
        until the others reach their next outer step (or all start together)."""
        super().start(step)
        self._trainer = (optimizer, sampler, scheduler)
        self._sync(step)
        if self.step != step and dist.get_rank() == 0:
            print(f"DiLoCo worker {self.worker} joined the others at step {self.step} (took over a living worker's "
                  f"state; it was at step {step})", file=sys.stderr, flush=True)
        return self.step

    def after_step(self, step: int, diverged: bool = False) -> str | None:
        """After inner step ``step``: the outer step when ``step`` is a multiple of H, which carries this worker's vote
        to stop (``diverged``, :meth:`DiLoCo.after_step`); who diverged once an outer step carried a vote, else None."""
        self.voted = self.voted or diverged
        if step % self.H == 0:
            self._sync(step)
        return self.stopped

    def consolidate(self, step: int) -> None:
        """Nothing: elastic workers save at outer steps only (``config.checks``), where weights are outer."""

    def can_save(self, step: int) -> bool:
        """Whether a checkpoint of ``step`` holds the outer model: ``step`` is an outer step."""
        return step == self.fragments[0].last_sync

    @torch.no_grad()
    def _sync(self, step: int) -> None:
        """One outer step with the workers of a new quorum (see the module's docstring for the arithmetic), and the
        workers' notes beside it (:meth:`_notes`): their votes to stop and their claims of a worker index."""
        frag = self.fragments[0]
        self.step = step
        self.manager.start_quorum()
        took = step > frag.last_sync
        count = torch.full((1,), float(took), device=self.device)  # 1 if this worker sends a pseudo-gradient
        buffer = torch.cat([self._pseudo_gradient(frag, zero=not took), count])
        if self.precision == "bf16":
            buffer = buffer.bfloat16()  # the count (<= 256 workers) is exact in bf16
        self.manager.wait_quorum()
        counted = self.manager.is_participating()  # else torchft zeroes what this worker sends (it is behind)
        notes = self._notes()
        works = [self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM) for t in (buffer, notes)]
        for work in works:
            work.wait()
        committed = self.manager.should_commit()  # a rejoining worker's new state is loaded in here
        self.participants = self.manager.num_participants()
        sent = buffer.numel() * buffer.element_size() + notes.numel() * notes.element_size()
        self.sent_bytes += sent
        self.largest_exchange = max(self.largest_exchange, sent)
        if not committed:
            self.failed_commits += 1
            return
        n = self.shares
        self._check_claim(notes[n:2 * n], notes[2 * n:], counted, took)
        if self.count_votes(notes[:n]):  # a worker diverged: every worker stops here, with no outer step
            return
        frag.last_sync = self.step
        count = float(buffer[-1])
        if count == 0:
            return
        self._outer_step(frag, buffer[:-1].float() / count, alpha=0.0)

    def _notes(self) -> torch.Tensor:
        """What this worker adds beside its pseudo-gradient, fp32 (3 x ``diloco.workers``): its vote to stop, its claim
        of index ``diloco.worker`` (1 there), and its start ticket there (:func:`_start_ticket`)."""
        claim = torch.zeros(self.shares, device=self.device)
        claim[self.worker] = 1.0
        return torch.cat([self.vote_flags(self.shares, self.worker), claim, claim * self.ticket])

    def _check_claim(self, claims: torch.Tensor, tickets: torch.Tensor, counted: bool, took: bool) -> None:
        """Stop this job when another job of the quorum claims its ``diloco.worker`` (two jobs started within the same
        few seconds both pass the pre-launch check; both would read one data share, and none the other's). The sums
        are the same on every worker: a job behind the others (torchft zeroed its claim) stops when anyone else claims
        its index; of two jobs level with each other, the one that started later (the larger ticket) stops; of more,
        all do.

        Raises:
            ConfigError: one line naming the index and what to do (exit 2, said by the job's rank 0).
        """
        mine = float(counted)
        others = float(claims[self.worker]) - mine
        if others < 0.5:
            return
        other_ticket = float(tickets[self.worker]) - mine * self.ticket
        if mine and others < 1.5 and other_ticket > self.ticket:
            return  # the other job started later: it stops
        from meshtrain.errors import ConfigError

        self.manager.shutdown(wait=False)
        raise ConfigError(f"diloco.worker = {self.worker} is taken: another job at the lighthouse {self.lighthouse} "
                          f"runs as worker {self.worker} too ({'ahead of this one' if not mine else 'started no later than this one'}: "
                          f"both would read one data share, and none the other's), so this job stopped "
                          f"{'before its first step' if not took else f'at step {self.step}'}: give it another index "
                          f"in [0, {self.shares}) (diloco.workers), or stop the other job first")

    def _state(self) -> dict[str, Any]:
        """What a rejoining worker takes over: the step, the outer weights and momentum (this rank's shards), and
        the trainer's part. Read by torchft's transfer while this worker is inside an outer step."""
        frag = self.fragments[0]
        momentum = [frag.optimizer.state.get(o, {}).get("momentum_buffer") for o in frag.outer]
        return {"step": self.step, "outer": [o.clone() for o in frag.outer],
                "momentum": [None if m is None else m.clone() for m in momentum],
                "trainer": None if self._trainer is None else {
                    "optimizer": optimizer_state(self._trainer[0]), "sampler": self._trainer[1].state_dict(),
                    "scheduler": self._trainer[2].state_dict()}}

    @torch.no_grad()
    def _load_state(self, state: dict[str, Any]) -> None:
        """Take over a living worker's state (:meth:`_state`): this worker's weights become the outer weights."""
        frag = self.fragments[0]
        for outer, value, p in zip(frag.outer, state["outer"], frag.params):
            outer.copy_(value)
            _local(p).copy_(outer)
        for outer, value in zip(frag.outer, state["momentum"]):
            if value is not None:
                frag.optimizer.state[outer]["momentum_buffer"] = value.to(outer.device).clone()
        if self._trainer is not None and state["trainer"] is not None:
            optimizer, sampler, scheduler = self._trainer
            load_optimizer_state(optimizer, state["trainer"]["optimizer"])
            sampler.load_state_dict(state["trainer"]["sampler"])
            scheduler.load_state_dict(state["trainer"]["scheduler"])
        self.step = self.healed_at = int(state["step"])

    def report(self) -> dict[str, Any]:
        """DiLoCo's summary entry (:meth:`DiLoCo.report`, this worker's bytes) plus the elastic facts: workers in the
        last quorum, outer steps not committed, the step this worker took over (None if it never rejoined)."""
        entry = self.entry()
        entry.update(workers=self.participants, elastic=True, failed_commits=self.failed_commits,
                     healed_at=self.healed_at)
        return {"diloco": entry}

    def close(self) -> None:
        """Leave: stop this worker's manager server (its heartbeats) and checkpoint transport."""
        self.manager.shutdown(wait=False)


TICKET_UNIT_S = 0.01
"""A start ticket's unit: two jobs that start within it are level (both stop, :meth:`ElasticDiLoCo._check_claim`)."""


def _start_ticket(device: torch.device) -> float:
    """When this job started, in :data:`TICKET_UNIT_S` since the epoch modulo 2**22 (about 11.6 hours; a sum of two is
    exact in fp32), the same on each of its ranks (rank 0's, broadcast): the later of two jobs claiming one index is
    the one to stop."""
    ticket = torch.tensor([float(int(time.time() / TICKET_UNIT_S) % 2**22)], device=device)
    dist.broadcast(ticket, src=0)
    return float(ticket)


def _no_flight_recorder(record: logging.LogRecord) -> bool:
    """Drop torchft's warning at every new quorum that NCCL's flight recorder cannot be reset (it has none to reset
    under gloo, and nothing is wrong under NCCL either: its traces are simply not split by quorum)."""
    return "flight recorder" not in record.getMessage()


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor as this rank's local tensor (picklable without a mesh)."""
    state = optimizer.state_dict()
    state["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """The inverse of :func:`optimizer_state`: local tensors placed as their parameters (DTensors) again."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    placed = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        placed[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                     if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v
                     for k, v in s.items()}
    optimizer.load_state_dict({**state, "state": placed})
