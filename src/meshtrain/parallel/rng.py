"""Dropout randomness under tensor and sequence parallelism, reseeded every step.

Megatron's model-parallel RNG tracker (Shoeybi et al. 2019, arXiv:1909.08053, end of Sec. 3): an
activation replicated across the tp group must get the same dropout mask on every tp rank, or the
replicas drift apart; activations split across tp (attention heads; with ``tp_sequence_parallel``
the residual-stream dropouts) need independent masks per shard. So the default generator is seeded
from ``(seed, step, rank without its tp coordinate)`` -- equal on a tp group, different across dp,
sp and pp as different samples/tokens would be in one process -- and the modules whose activations
are split across tp run on a second stream (:class:`TPRegionRNG`) seeded from the full rank.
Seeding every step from the step number means a resumed run draws exactly the masks of the
uninterrupted run, with no RNG state in the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


def step_seed(seed: int, step: int, key: int) -> int:
    """A distinct seed for each ``(seed, step, key)`` (key: a rank, or a rank without its tp coordinate)."""
    return (seed * 1_000_003 + step) * 1_009 + key


class TPRegionRNG:
    """A second random stream for modules whose activations are split across the tp group.

    Forward hooks swap it in for the default generator around each such module and swap the default
    back afterwards, so the default stream (shared by the tp group) advances exactly as it would
    without these modules having drawn anything. :meth:`seed` is called once per step.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.state: torch.Tensor | None = None
        self._saved: torch.Tensor | None = None

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def seed(self, seed: int) -> None:
        """Start the stream from ``seed`` (this tp rank's own) without disturbing the default stream."""
        saved = self._get()
        torch.manual_seed(seed)
        self.state = self._get()
        self._set(saved)

    def attach(self, module: nn.Module) -> None:
        """Run ``module``'s forward on this stream."""
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if self.state is None:
            raise RuntimeError("TPRegionRNG.seed() must be called before the forward pass")
        self._saved = self._get()
        self._set(self.state)

    def _exit(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.state = self._get()
        self._set(self._saved)


def seed_step(model: nn.Module, seed: int, step: int, rank: int, tp: int) -> None:
    """Seed the default stream (shared by a tp group) and ``model.tp_rng`` if present (per rank).

    ``rank // tp`` drops the tp coordinate, the innermost mesh axis (docs/architecture.md, mesh).
    """
    torch.manual_seed(step_seed(seed, step, rank // tp))
    tp_rng = getattr(model, "tp_rng", None)
    if tp_rng is not None:
        tp_rng.seed(step_seed(seed, step, rank) + 7_919)
