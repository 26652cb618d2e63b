"""Asynchronous SGD with a parameter server (``parallel.sync_mode = "async"``).

Ranks ``0 .. ps_servers-1`` are servers: each holds a shard of the parameters (whole tensors, balanced
by size) and the AdamW state of that shard. The other ranks are workers: each pulls the parameters,
computes a gradient on its own samples (``micro_batch_size * gradient_accumulation_steps`` of them,
its dp shard of the data stream), pushes it, and pulls again -- never waiting for another worker
(Dean et al. 2012, "Large Scale Distributed Deep Networks", NeurIPS, Sec. 4.1, Downpour SGD; Li et
al. 2014, "Scaling Distributed Machine Learning with the Parameter Server", OSDI, Sec. 3). A server
applies each gradient it accepts at once (one AdamW step per gradient), so a gradient may have been
computed on parameters that are several updates old: its staleness, ``server version - version the
worker pulled``.

``parameter_server.max_staleness`` (s) bounds it, by ``parameter_server.stale_policy``:

- ``"drop"``: workers never wait; the server applies gradients in arrival order and drops (and counts)
  one whose staleness exceeds s.
- ``"wait"``: bounded staleness by waiting (the stale-synchronous-parallel idea of Ho et al. 2013,
  "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NeurIPS): at most
  s+1 workers hold parameters at a time (a worker's pull waits for a free slot), and a gradient is held
  back while applying it could push an earlier-admitted worker past s. Every gradient is applied, none
  staler than s; the oldest admitted worker can always go, so nothing deadlocks. With s = 0 this is
  sequential SGD, each gradient computed on the newest parameters. Needs ``ps_servers = 1``.

``train.steps`` counts gradients the server receives (applied or dropped), each one worker's batch;
the learning rate follows that count (warmup and cosine as in synchronous training).

Messages are ``torch.distributed`` point-to-point sends on the default group (gloo or NCCL), never a
socket protocol of our own. A worker's message is a float64 header ``[kind, version, samples_seen,
loss, worker index]`` (tag 1), then for a push the gradient shard as one fp32 vector (tag 2); a server answers
``[version, stop]`` (tag 1) and, unless it says stop, the parameter shard (tag 2). Sends are ``isend``,
so no rank blocks another while a payload is in flight.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

HEADER_TAG, PAYLOAD_TAG = 1, 2
PULL, PUSH, DONE = 0, 1, 2


def shard_parameters(sizes: list[int], n_servers: int) -> list[list[int]]:
    """Indices of the parameters each server holds: largest first onto the least-loaded server (LPT,
    Graham 1969), ties to the lower server; deterministic, so every rank computes the same split.

    Raises:
        ValueError: more servers than parameters (a server would hold nothing).
    """
    if n_servers > len(sizes):
        raise ValueError(f"parameter_server.servers = {n_servers} exceeds the model's {len(sizes)} parameter tensors")
    load = [0] * n_servers
    shards: list[list[int]] = [[] for _ in range(n_servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(n_servers), key=lambda s: (load[s], s))
        shards[s].append(i)
        load[s] += sizes[i]
    return [sorted(shard) for shard in shards]


def flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients of ``params`` as one fp32 vector (zeros for a parameter without a gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


@dataclass
class ServerStats:
    """What a server saw: gradients received, applied and dropped, and the staleness of each applied one."""

    received: int = 0
    applied: int = 0
    dropped: int = 0
    staleness: list[int] = field(default_factory=list)
    applied_by: dict[int, int] = field(default_factory=dict)
    """Applied gradients per worker index."""


class ParameterServer:
    """Serves one shard of the parameters until every worker said it is done.

    Args:
        params: this server's parameters (its shard of the model).
        optimizer: AdamW over ``params``.
        lr_of: learning rate for the update that receives gradient number ``k`` (0-based).
        workers: global ranks of the workers.
        max_staleness: s, see the module docstring.
        policy: "drop" or "wait".
        total: gradients to receive before telling workers to stop (``train.steps``).
        received: gradients received before this run (a resumed run's step).
        on_gradient: called after each received gradient with (header, applied, staleness).
    """

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, lr_of: Callable[[int], float],
                 workers: list[int], max_staleness: int, policy: str, total: int, received: int = 0,
                 on_gradient: Callable[[torch.Tensor, bool, int], None] | None = None) -> None:
        self.params, self.optimizer, self.lr_of = params, optimizer, lr_of
        self.workers, self.max_staleness, self.policy, self.total = workers, max_staleness, policy, total
        self.stats = ServerStats(received=received)
        self.version = received
        self.on_gradient = on_gradient or (lambda header, applied, staleness: None)
        self.sends: dict[int, list[dist.Work]] = {}
        """Each worker's last reply in flight; waited for before the next (the worker has received it by
        then, having sent its next request), so a server holds one reply's buffers per worker."""
        self.outstanding: list[tuple[int, int]] = []  # "wait": (worker, version pulled), in admission order
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # "wait": pushed, not yet applied
        self.waiting: collections.deque[int] = collections.deque()  # "wait": pulls without a slot yet

    @property
    def finished(self) -> bool:
        return self.stats.received >= self.total

    def serve(self) -> ServerStats:
        """Answer workers until each one sent DONE; return the statistics."""
        active = set(self.workers)
        numel = sum(p.numel() for p in self.params)
        while active:
            header = torch.empty(5, dtype=torch.float64)
            src = dist.recv(header, tag=HEADER_TAG)  # from any worker
            kind = int(header[0])
            if kind == DONE:
                active.discard(src)
                continue
            grad = None
            if kind == PUSH:
                grad = torch.empty(numel)
                dist.recv(grad, src=src, tag=PAYLOAD_TAG)
            if self.policy == "wait":
                self._handle_waiting(src, kind, header, grad)
            else:
                self._handle_dropping(src, kind, header, grad)
        for works in self.sends.values():
            for work in works:
                work.wait()
        return self.stats

    def _handle_dropping(self, src: int, kind: int, header: torch.Tensor, grad: torch.Tensor | None) -> None:
        if kind == PUSH and not self.finished:
            staleness = self.version - int(header[1])
            self._receive(header, grad, applied=staleness <= self.max_staleness, staleness=staleness)
        self._reply(src)

    def _handle_waiting(self, src: int, kind: int, header: torch.Tensor, grad: torch.Tensor | None) -> None:
        if kind == PUSH and not self.finished:
            self.pending[src] = (header, grad)
        else:
            self.waiting.append(src)
        self._apply_ready()
        while self.waiting and (self.finished or len(self.outstanding) <= self.max_staleness):
            worker = self.waiting.popleft()
            self._reply(worker)
            if not self.finished:
                self.outstanding.append((worker, self.version))
        if self.finished:  # answer every held-back push with "stop"
            for worker in list(self.pending):
                del self.pending[worker]
                self._reply(worker)
            self.outstanding.clear()

    def _apply_ready(self) -> None:
        """Apply held-back gradients while one can go without pushing an earlier-admitted worker past s:
        worker ``u`` at admission index ``j`` can absorb ``s - (version - v_u) - j`` more updates, the
        ``j`` being reserved for the workers admitted before it."""
        progress = True
        while progress and not self.finished:
            progress = False
            for i, (worker, pulled) in enumerate(self.outstanding):
                earlier = self.outstanding[:i]
                if worker in self.pending and all(self.max_staleness - (self.version - v) - j >= 1
                                                  for j, (_, v) in enumerate(earlier)):
                    header, grad = self.pending.pop(worker)
                    del self.outstanding[i]
                    self._receive(header, grad, applied=True, staleness=self.version - pulled)
                    self.waiting.append(worker)
                    progress = True
                    break

    def _receive(self, header: torch.Tensor, grad: torch.Tensor, applied: bool, staleness: int) -> None:
        if applied:
            self._apply(grad, self.lr_of(self.stats.received))
            self.stats.applied += 1
            self.stats.staleness.append(staleness)
            worker = int(header[4])
            self.stats.applied_by[worker] = self.stats.applied_by.get(worker, 0) + 1
        else:
            self.stats.dropped += 1
        self.stats.received += 1
        self.on_gradient(header, applied, staleness)

    def _apply(self, grad: torch.Tensor, lr: float) -> None:
        offset = 0
        for p in self.params:
            p.grad = grad[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def _reply(self, worker: int) -> None:
        for work in self.sends.pop(worker, []):
            work.wait()
        header = torch.tensor([self.version, float(self.finished)], dtype=torch.float64)
        works = [dist.isend(header, worker, tag=HEADER_TAG)]
        if not self.finished:
            works.append(dist.isend(parameters_to_vector(self.params).detach().float(), worker, tag=PAYLOAD_TAG))
        self.sends[worker] = works


class Worker:
    """Pulls parameters, computes gradients, pushes them, until a server says stop.

    Args:
        shards: for each server rank, this model's parameters that server holds.
        compute: runs forward and backward on the worker's next batch (gradients left in the
            parameters) and returns ``(loss, samples_seen)``.
        index: this worker's index among the workers (sent with each gradient).
    """

    def __init__(self, shards: dict[int, list[nn.Parameter]], compute: Callable[[], tuple[float, int]],
                 index: int) -> None:
        self.shards, self.compute, self.index = shards, compute, index
        self.versions = {server: 0 for server in shards}
        self.steps = 0
        self.wait_s = 0.0
        """Seconds spent waiting for the servers' answers (pull latency plus, under "wait", held-back time)."""

    def run(self) -> int:
        """Train until stopped; return the number of gradients pushed."""
        sends = [dist.isend(torch.tensor([PULL, 0, 0, 0, 0], dtype=torch.float64), s, tag=HEADER_TAG)
                 for s in self.shards]
        while self._receive(sends):
            loss, samples_seen = self.compute()
            sends = []
            for server, params in self.shards.items():
                header = torch.tensor([PUSH, self.versions[server], samples_seen, loss, self.index],
                                      dtype=torch.float64)
                sends += [dist.isend(header, server, tag=HEADER_TAG),
                          dist.isend(flat_grad(params), server, tag=PAYLOAD_TAG)]
                for p in params:
                    p.grad = None
            self.steps += 1
        for server in self.shards:
            dist.send(torch.tensor([DONE, 0, 0, 0, 0], dtype=torch.float64), server, tag=HEADER_TAG)
        return self.steps

    def _receive(self, sends: list[dist.Work]) -> bool:
        """Every server's answer; load the parameters; False if any said stop."""
        start = time.perf_counter()
        go = True
        for server, params in self.shards.items():
            header = torch.empty(2, dtype=torch.float64)
            dist.recv(header, server, tag=HEADER_TAG)
            if header[1]:
                go = False
                continue
            flat = torch.empty(sum(p.numel() for p in params))
            dist.recv(flat, server, tag=PAYLOAD_TAG)
            with torch.no_grad():
                vector_to_parameters(flat.to(params[0].dtype), params)
            self.versions[server] = int(header[0])
        for work in sends:
            work.wait()
        self.wait_s += time.perf_counter() - start
        return go
