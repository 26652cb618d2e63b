"""DiLoCo and Streaming DiLoCo (``parallel.sync_mode = "diloco"``, ``[diloco]``): workers that talk every H steps.

The ranks form ``workers`` groups of ``diloco.group`` ranks (one node each by default); inside a
worker any synchronous layout runs unchanged (DDP, FSDP2, tp, pp, sp: :class:`meshtrain.mesh.ParallelDims`
puts the workers outside every axis). Each worker takes ``H = diloco.inner_steps`` steps of its own inner
optimizer (AdamW, its states never leave the worker); then every worker computes the pseudo-gradient of its
parameters, the outer weights minus its own, the workers average it, and an outer SGD with Nesterov momentum
moves the outer weights (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1)::

    Delta = (1/W) * sum_w (theta_outer - theta_w)          # the averaged pseudo-gradient
    theta_outer = OuterOpt(theta_outer, Delta)            # SGD, lr = outer_lr (0.7), Nesterov momentum 0.9
    theta_w = theta_outer                                 # every worker starts the next round from it

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv:2501.18512,
Algorithm 2, Sec. 2.2-2.4) syncs one fragment of the model at a time, overlaps the exchange with inner steps and
mixes the result in:

- fragments: ``F = diloco.fragments`` contiguous groups of blocks (the embedding, final norm and head join the
  first group); fragment ``p`` has its outer step after inner steps ``t`` with ``t mod H = ((p + 1) * H / F) mod H``,
  so a fragment still syncs every H steps and an exchange carries about 1/F of the model (the peak bandwidth
  falls by F);
- delay ``tau = diloco.delay``: the fragment's pseudo-gradient is taken after step ``t`` and its all-reduce
  runs in the background during steps ``t+1 .. t+tau``; it is applied after step ``t + tau``;
- mixing ``alpha = diloco.alpha``: then ``theta_w = alpha * theta_w + (1 - alpha) * theta_outer`` (Eq. 3), which
  keeps part of the ``tau`` steps each worker took meanwhile (0 = replace, DiLoCo's rule);
- precision ``diloco.precision``: the pseudo-gradient crosses as fp32, as bf16 (all-reduced in bf16, Sec. 2.4's
  lower-precision communication), or as int8 (each block of :data:`INT8_BLOCK` values scaled by its absolute
  maximum / 127 and rounded, the workers' codes and fp32 scales all-gathered and averaged in fp32; error
  <= scale / 2 per value and worker).

Each worker counts its own non-finite steps (its loss is its own). Every exchange also carries one fp32 flag per
worker (beside int8's scales), 1 where that worker has had ``train.max_nonfinite_steps`` in a row: every worker
learns of a divergence at the same step, where the exchange lands, takes no outer step on it and stops
(:meth:`DiLoCo.after_step`), instead of waiting for the stopped one at the next exchange.

With one fragment, no delay, ``alpha = 0``, outer lr 1 and no momentum, an outer step is the average of the
workers' weights; with inner SGD and H = 1 that is synchronous data parallelism (tests/test_diloco.py).

A checkpoint (:meth:`DiLoCo.consolidate`) lands every pending exchange and takes an outer step of every fragment
that took inner steps since its last one, then sets every worker's weights to the outer weights: the saved model
is the outer model, the same on every worker, and the outer momentum is saved beside it
(:meth:`DiLoCo.state_dict`). When a checkpoint falls on an outer step (the interval a multiple of H, one
fragment, no delay, alpha = 0) this changes nothing. Each worker's inner optimizer state stays its own; the
checkpoint holds one copy of it (as local SGD's), which every worker resumes from.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshtrain.sync_mode import SyncMode

INT8_BLOCK = 256
"""Values that share one fp32 scale in the int8 exchange (4 bytes of scale per 256 bytes of codes)."""

_BLOCK_INDEX = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
_WRAPPERS = re.compile(r"(?:^|(?<=\.))(?:module|_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' segments (DDP's ``module.``, compile's ``_orig_mod.``,
    recomputation's ``_checkpoint_wrapped_module.``): the model's own, the same in every layout."""
    return _WRAPPERS.sub("", name)


def fragment_of(name: str, n_layer: int, fragments: int) -> int:
    """Fragment of parameter ``name``: block ``i`` (``...blocks.i...``) is in fragment ``i * F // n_layer``
    (contiguous groups, the first ones one block larger when F does not divide n_layer), anything else
    (embedding, final norm, head: a tied pair on both pipeline ends) in fragment 0."""
    match = _BLOCK_INDEX.search(name)
    return int(match.group(1)) * fragments // n_layer if match else 0


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p`` (a DTensor's shard), writable in place."""
    return p._local_tensor if isinstance(p, DTensor) else p.data


@dataclass
class _Exchange:
    """A fragment's pseudo-gradient on its way between workers."""

    apply_after: int
    """The inner step after which it is applied (the step it was taken at + tau)."""
    work: list[Any]
    """The collectives' handles (waited on before it is applied)."""
    buffers: tuple[torch.Tensor, ...]
    """What the collectives fill: the summed flat pseudo-gradient, or (int8) every worker's codes and scales."""


@dataclass
class Fragment:
    """One group of parameters synced together: this rank's shards of them, their outer copies and momentum."""

    index: int
    offset: int
    """Outer steps after inner steps t with t mod H == offset."""
    names: list[str]
    params: list[torch.Tensor]
    """This rank's shards of the parameters (the tensors the inner optimizer updates)."""
    outer: list[torch.Tensor] = field(default_factory=list)
    """The outer weights, fp32 (a copy of each shard)."""
    optimizer: torch.optim.Optimizer | None = None
    last_sync: int = 0
    """The inner step of its last outer step (or of the start)."""
    pending: _Exchange | None = None


class DiLoCo(SyncMode):
    """The outer loop of DiLoCo on this rank: the loop's hooks (:class:`meshtrain.sync_mode.SyncMode`), the outer
    steps after every inner step (:meth:`after_step`).

    Args:
        model: this rank's part of the model (its pipeline chunks, tp/FSDP2 shards, wrapped as dp needs).
        group: the ``"diloco"`` mesh's group: this rank and the ranks at its place in the other workers (None:
            the workers are other jobs, :class:`meshtrain.parallel.diloco.elastic.ElasticDiLoCo`).
        n_layer: the model's blocks (for the fragments).
        d: the ``[diloco]`` section (:class:`meshtrain.config.sections.DiLoCoConfig`): ``inner_steps`` H,
            ``fragments`` F (divides H), ``delay`` tau < H/F, ``alpha`` the mixing in [0, 1), ``outer_lr`` and
            ``outer_momentum`` the outer SGD's (Nesterov when the momentum is > 0), ``precision`` "fp32", "bf16" or
            "int8".
        replica_group: the ranks of this worker that hold the same parameters (its dp x sp ranks under DDP), or
            None: each sends 1/n of the pseudo-gradient to the other workers and they all-gather the average
            inside the worker, so one copy of the model crosses between workers, not n.
    """

    phase = "DiLoCo's outer step"

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None, n_layer: int, d: Any,
                 replica_group: dist.ProcessGroup | None = None) -> None:
        inner_steps, fragments, outer_lr, outer_momentum = d.inner_steps, d.fragments, d.outer_lr, d.outer_momentum
        delay, alpha, precision = d.delay, d.alpha, d.precision
        self.group, self.workers = group, dist.get_world_size(group) if group is not None else 1
        self.replica_group = replica_group
        self.replicas = dist.get_world_size(replica_group) if replica_group is not None else 1
        self.replica_rank = dist.get_rank(replica_group) if replica_group is not None else 0
        self.H, self.delay, self.alpha, self.precision = inner_steps, delay, alpha, precision
        every = inner_steps // fragments
        named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = named[0][1].device
        self.fragments = []
        for index in range(fragments):
            mine = [(n, p) for n, p in named if fragment_of(n, n_layer, fragments) == index]
            frag = Fragment(index, ((index + 1) * every) % inner_steps, [n for n, _ in mine], [p for _, p in mine])
            frag.outer = [_local(p).detach().float().clone() for p in frag.params]
            momentum = {"momentum": outer_momentum, "nesterov": True} if outer_momentum > 0 else {}
            frag.optimizer = torch.optim.SGD(frag.outer, lr=outer_lr, **momentum) if frag.outer else None
            self.fragments.append(frag)
        self.worker_index = dist.get_rank(group) if group is not None else 0
        self.voted = False
        """This rank's worker diverged (``train.max_nonfinite_steps`` non-finite steps in a row): its vote to stop
        goes with every exchange from now on."""
        self.stopped: str | None = None
        """Who diverged, once an exchange carried a vote (the same on every rank): the run stops."""
        self.outer_steps = 0
        self.sent_bytes = 0
        """Bytes this rank put into outer exchanges (the payload: a ring all-reduce moves 2(W-1)/W of it)."""
        self.largest_exchange = 0
        """This rank's largest payload of one exchange, bytes."""

    def checkpointed(self) -> DiLoCo:
        """The outer momentum is saved beside the model (:meth:`state_dict`)."""
        return self

    def start(self, step: int, optimizer: Any = None, sampler: Any = None, scheduler: Any = None) -> int:
        """Set the round to start after inner step ``step`` (a resumed run's first step - 1): every fragment's
        outer weights are the current ones (a resumed checkpoint holds the outer model); return ``step``."""
        for frag in self.fragments:
            frag.last_sync = step
            frag.pending = None
            for outer, p in zip(frag.outer, frag.params):
                outer.copy_(_local(p))
        return step

    def after_step(self, step: int, diverged: bool = False) -> str | None:
        """After inner step ``step`` (1-based, every rank of every worker calls it): land the exchanges due now,
        then start those of the fragments whose turn it is (applied at once when tau = 0). ``diverged``: this worker's
        vote to stop, which every exchange carries from now on (each worker counts its own non-finite steps); returns
        who diverged once an exchange that carried a vote has landed (on every rank at the same step), else None."""
        self.voted = self.voted or diverged
        for frag in self.fragments:
            if frag.pending is not None and frag.pending.apply_after <= step:
                self._apply(frag, self.alpha)
        for frag in self.fragments:
            if step % self.H == frag.offset and step > frag.last_sync:
                self._send(frag, step)
                if self.delay == 0:
                    self._apply(frag, self.alpha)
        return self.stopped

    def vote_flags(self, workers: int, index: int) -> torch.Tensor:
        """This worker's vote to stop among ``workers`` (fp32, one flag each): 1 at ``index`` if it diverged. Summed
        with the exchange, the flags name every worker that diverged (0 and 1 are exact in bf16 too)."""
        flags = torch.zeros(workers, device=self.device)
        flags[index] = float(self.voted)
        return flags

    def count_votes(self, flags: torch.Tensor) -> bool:
        """Record who diverged from the exchange's summed ``flags`` (:meth:`vote_flags`); whether anyone did."""
        diverged = [w for w, v in enumerate(flags.tolist()) if v > 0]
        if diverged and self.stopped is None:
            self.stopped = f"DiLoCo worker{'s' if len(diverged) > 1 else ''} {', '.join(map(str, diverged))} of {len(flags)}"
        return self.stopped is not None

    def consolidate(self, step: int) -> None:
        """Make every worker hold the outer weights after inner step ``step``: land pending exchanges, take an
        outer step of each fragment that took inner steps since its last one, and copy the outer weights in
        (no mixing). Collective over every rank."""
        for frag in self.fragments:
            self._apply(frag, 0.0)
            if step > frag.last_sync:
                self._send(frag, step)
                self._apply(frag, 0.0)
            with torch.no_grad():
                for outer, p in zip(frag.outer, frag.params):
                    _local(p).copy_(outer)

    @torch.no_grad()
    def _send(self, frag: Fragment, step: int) -> None:
        """Start the exchange of ``frag``'s pseudo-gradient, outer minus local (flat, fp32). A fragment with no
        parameters on this rank (a pipeline stage without its blocks) has none on its peers either: its exchange is
        the votes alone. Every exchange carries the workers' votes to stop (:meth:`vote_flags`)."""
        frag.last_sync = step
        delta = self._pseudo_gradient(frag) if frag.params else torch.zeros(0, device=self.device)
        flags = self.vote_flags(self.workers, self.worker_index)
        background = self.delay > 0
        if self.precision == "int8" and frag.params:
            codes, scales = quantize_int8(delta)
            scales = torch.cat([scales, flags])  # fp32 beside the scales: row w is worker w's scales and vote
            # flat outputs (gloo's all-gather checks each worker's slice against the input's shape: a (W, n)
            # buffer's slices are (1, n)); row w is worker w's
            all_codes = torch.empty(self.workers * codes.numel(), dtype=torch.int8, device=codes.device)
            all_scales = torch.empty(self.workers * scales.numel(), dtype=scales.dtype, device=scales.device)
            work = [dist.all_gather_into_tensor(all_codes, codes, group=self.group, async_op=background),
                    dist.all_gather_into_tensor(all_scales, scales, group=self.group, async_op=background)]
            buffers: tuple[torch.Tensor, ...] = (all_codes, all_scales, torch.tensor(delta.numel()))  # n: CPU
            payload = codes.numel() + 4 * scales.numel()
        else:
            buffer = torch.cat([delta, flags])
            buffer = buffer.bfloat16() if self.precision == "bf16" else buffer
            work = [dist.all_reduce(buffer, group=self.group, async_op=background)]
            buffers = (buffer,)
            payload = buffer.numel() * buffer.element_size()
        frag.pending = _Exchange(step + self.delay, [w for w in work if w is not None], buffers)
        self.sent_bytes += payload
        self.largest_exchange = max(self.largest_exchange, payload)

    @torch.no_grad()
    def _apply(self, frag: Fragment, alpha: float) -> None:
        """Wait for ``frag``'s exchange, take the outer step on the average, and mix the outer weights in."""
        exchange, frag.pending = frag.pending, None
        if exchange is None:
            return
        for work in exchange.work:
            work.wait()
        W = self.workers
        if len(exchange.buffers) == 3:  # int8: every worker's codes, and its scales with its vote
            codes, scales, n = exchange.buffers
            rows = scales.view(W, -1)
            votes, rows = rows[:, -W:].sum(dim=0), rows[:, :-W]
            average = sum(dequantize_int8(c, s, int(n)) for c, s in zip(codes.view(W, -1), rows)) / W
        else:
            summed = exchange.buffers[0].float()
            votes, average = summed[-W:], summed[:-W] / W
        if self.count_votes(votes) or not frag.params:  # a worker diverged: no outer step on its pseudo-gradient
            return
        self._outer_step(frag, average, alpha)

    def _pseudo_gradient(self, frag: Fragment, zero: bool = False) -> torch.Tensor:
        """``frag``'s pseudo-gradient on this rank, outer minus local weights, flat fp32 (``zero``: zeros shaped so);
        with replicas inside the worker, which hold the same one, this rank's 1/n share of it (zero-padded)."""
        n = sum(outer.numel() for outer in frag.outer)
        delta = (torch.zeros(n, device=self.device) if zero else
                 torch.cat([(outer - _local(p).float()).flatten() for outer, p in zip(frag.outer, frag.params)]))
        if self.replicas > 1:  # replicas inside the worker hold the same delta: each sends its share
            share = -(-n // self.replicas)
            delta = torch.nn.functional.pad(delta, (0, share * self.replicas - n))
            delta = delta[self.replica_rank * share:(self.replica_rank + 1) * share].clone()
        return delta

    @torch.no_grad()
    def _outer_step(self, frag: Fragment, average: torch.Tensor, alpha: float) -> None:
        """The outer SGD step of ``frag`` on the workers' ``average`` pseudo-gradient (this rank's share of it with
        replicas inside the worker), then the local weights mixed with the outer ones (``alpha = 0``: replaced)."""
        if self.replicas > 1:  # every share of the average, from the worker's replicas (inside the node)
            shares = torch.empty(self.replicas * average.numel(), dtype=average.dtype, device=average.device)
            dist.all_gather_into_tensor(shares, average.contiguous(), group=self.replica_group)
            average = shares
        for outer, piece in zip(frag.outer, _split(average, frag.outer)):
            outer.grad = piece
        frag.optimizer.step()
        frag.optimizer.zero_grad(set_to_none=True)
        for outer, p in zip(frag.outer, frag.params):
            local = _local(p)
            if alpha == 0:
                local.copy_(outer)
            else:
                local.copy_(alpha * local.float() + (1 - alpha) * outer)
        self.outer_steps += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The outer momentum of every parameter by its :func:`canonical_name`, shaped and placed as the parameter
        (a DTensor's resharded by DCP like the model), zeros before the first outer step (the same next step:
        torch's SGD starts its buffer at the first gradient, and mu * 0 + g = g)."""
        state = {}
        for frag in self.fragments:
            for name, p, outer in zip(frag.names, frag.params, frag.outer):
                buffer = frag.optimizer.state.get(outer, {}).get("momentum_buffer") if frag.optimizer else None
                local = torch.zeros_like(outer) if buffer is None else buffer
                state[name] = (DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                               if isinstance(p, DTensor) else local)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the outer momentum from :meth:`state_dict`'s form (names missing from ``state`` keep none)."""
        for frag in self.fragments:
            for name, outer in zip(frag.names, frag.outer):
                if name in state and frag.optimizer is not None and frag.optimizer.defaults["momentum"] > 0:
                    value = state[name]
                    frag.optimizer.state[outer]["momentum_buffer"] = (
                        value.to_local() if isinstance(value, DTensor) else value).detach().float().clone()

    def report(self) -> dict[str, Any]:
        """The summary's ``diloco`` entry: workers, H, F, tau, precision, this rank's outer steps (a fragment's
        count), and the bytes one worker sent to the others: in all (``sent_bytes``) and in its largest exchange
        (``largest_exchange_bytes``), summed over its ranks. Collective over all ranks (an all-reduce)."""
        return {"diloco": self.entry()}

    def entry(self) -> dict[str, Any]:
        """:meth:`report`'s ``diloco`` entry."""
        sent = torch.tensor([float(self.sent_bytes), float(self.largest_exchange)], dtype=torch.float64,
                            device=self.device)
        dist.all_reduce(sent)  # every worker sends the same: the sum over all ranks / workers
        return {"workers": self.workers, "inner_steps": self.H, "fragments": len(self.fragments),
                "delay": self.delay, "alpha": self.alpha, "precision": self.precision, "outer_steps": self.outer_steps,
                "sent_bytes": int(sent[0]) // self.workers, "largest_exchange_bytes": int(sent[1]) // self.workers}


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """``flat`` cut into tensors shaped as ``like``."""
    start = 0
    for t in like:
        yield flat[start:start + t.numel()].view_as(t)
        start += t.numel()


def quantize_int8(x: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (n,) fp32 -> int8 codes (ceil(n / block) * block,) and fp32 scales (ceil(n / block),): each block
    scaled by its absolute maximum / 127 and rounded to nearest (absmax quantization, Dettmers et al. 2022,
    "LLM.int8()", arXiv:2208.07339, Eq. 1, blockwise as in Dettmers et al. 2022, arXiv:2110.02861). The error
    of a value is at most its block's scale / 2."""
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    scales = padded.abs().amax(dim=1) / 127
    codes = torch.round(padded / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return codes.to(torch.int8).flatten(), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`quantize_int8`: (n,) fp32."""
    return (codes.view(scales.numel(), -1).float() * scales[:, None]).flatten()[:n]
