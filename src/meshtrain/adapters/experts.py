"""LoRA on a mixture of experts' routed experts (the stacks of :class:`meshtrain.models.moe.layer.GroupedExperts`), as
peft's ``ParamWrapper`` adapts ``transformers`` 5's 3-D expert tensors (``LoraConfig(target_parameters=[...])``).

``transformers`` 5 holds a Mixtral's or a Qwen3-MoE's experts as ``mlp.experts.gate_up_proj`` (E, 2F, C: the gate's
F rows first) and ``mlp.experts.down_proj`` (E, C, F); peft gives each such parameter one rank-r pair per expert, and
expert e computes with ``W_e + s B_e A_e``, ``A_e`` (r, in), ``B_e`` (out, r) (Hu et al. 2021, arXiv:2106.09685,
Eq. 3, per expert; ``s`` from :func:`meshtrain.adapters.spec.lora_scaling`). An expert's gate and up projections thus
share one ``A_e`` (r, C), and its ``B_e`` (2F, r) is cut into the gate's F rows and the up's F rows. The targets are
peft's names, ``experts.gate_up_proj`` and ``experts.down_proj``.

Stored as per-expert stacks: ``lora_A["gate_up"]`` (E, r, C), ``lora_B["gate_up"]`` (E, 2F, r), ``lora_A["down"]``
(E, r, F), ``lora_B["down"]`` (E, C, r). Under expert parallelism each is a DTensor ``Shard(0)`` over ``ep`` like the
stacks themselves, so a rank holds the adapters of its E/ep experts, and their gradients are scaled and averaged over
the ``"edp"`` ranks as the stacks' are (:mod:`meshtrain.parallel.expert`); the all-to-all is unchanged. Initialised as
peft's (``A`` uniform in ``[-1/sqrt(in), 1/sqrt(in)]``, ``B`` zero).

The update is added to the weights, one batched (out, r) x (r, in) product per expert per forward and backward, as
peft's ``ParamWrapper`` does; so there is no dropout on the adapters' input (peft refuses it too).

Shape legend: E experts (E_local on this rank), C = n_embd, F = the experts' hidden width, r the rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshtrain.adapters.spec import DOWN, GATE_UP
from meshtrain.models.moe.layer import GroupedExperts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LoRAExperts(GroupedExperts):
    """:class:`GroupedExperts` whose stacks carry low-rank updates (module docstring); made by :func:`add_expert_lora`."""

    lora_A: nn.ParameterDict
    lora_B: nn.ParameterDict
    scaling: float

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``W_e + s B_e A_e`` of ``w_gate, w_up`` (E_local, F, C) and ``w_down`` (E_local, C, F)."""
        w_gate, w_up, w_down = super().stacks()
        if GATE_UP in self.lora_A:
            delta = self.delta(GATE_UP)  # (E_local, 2F, C)
            hidden = w_gate.shape[1]
            w_gate, w_up = w_gate + delta[:, :hidden], w_up + delta[:, hidden:]
        if DOWN in self.lora_A:
            w_down = w_down + self.delta(DOWN)  # (E_local, C, F)
        return w_gate, w_up, w_down

    def delta(self, kind: str) -> torch.Tensor:
        """``s B_e A_e`` of every local expert: (E_local, out, r) @ (E_local, r, in) -> (E_local, out, in)."""
        a, b = _local(self.lora_A[kind]), _local(self.lora_B[kind])
        return torch.bmm(b * self.scaling, a)


def add_expert_lora(experts: GroupedExperts, kinds: tuple[str, ...], rank: int, scaling: float,
                    seed: int) -> LoRAExperts:
    """Give ``experts`` (whole, or sharded over ``ep``: DTensor stacks) adapters of rank ``rank`` on ``kinds``
    (:data:`GATE_UP`, :data:`DOWN`), in place; return it. ``A`` of each kind is drawn from a CPU generator seeded with
    ``seed`` (whole, the same on every rank and layout; each rank keeps its experts' part), ``B`` is zero."""
    shapes = {GATE_UP: (experts.w_gate.shape[1] * 2, experts.w_gate.shape[2]),  # (2F, C)
              DOWN: tuple(experts.w_down.shape[1:])}  # (C, F)
    generator = torch.Generator().manual_seed(seed)
    local = _local(experts.w_gate)
    experts.lora_A, experts.lora_B = nn.ParameterDict(), nn.ParameterDict()
    for kind in kinds:
        out_features, in_features = shapes[kind]
        E = experts.w_gate.shape[0]
        bound = 1 / math.sqrt(in_features)  # peft's init of A (nn.Linear's Kaiming-uniform, a = sqrt(5))
        a = (torch.rand(E, rank, in_features, generator=generator) * 2 - 1) * bound  # (E, r, in)
        b = torch.zeros(E, out_features, rank)  # (E, out, r)
        for store, t in ((experts.lora_A, a), (experts.lora_B, b)):
            t = t.to(device=local.device, dtype=local.dtype)
            if isinstance(experts.w_gate, DTensor):  # the experts' ep sharding: whole experts per rank
                t = distribute_tensor(t, experts.w_gate.device_mesh, [Shard(0)], src_data_rank=None)
            store[kind] = nn.Parameter(t)
    experts.scaling = scaling
    experts.__class__ = LoRAExperts
    return experts


@torch.no_grad()
def merge_expert_lora(experts: LoRAExperts) -> None:
    """Fold the adapters into the stacks (one process, plain tensors), ``W_e <- W_e + s B_e A_e``, and make the
    module a plain :class:`GroupedExperts` again."""
    w_gate, w_up, w_down = experts.stacks()
    for param, value in ((experts.w_gate, w_gate), (experts.w_up, w_up), (experts.w_down, w_down)):
        param.copy_(value)
    del experts.lora_A, experts.lora_B, experts.scaling
    experts.__class__ = GroupedExperts


def to_peft(part: str, t: torch.Tensor) -> torch.Tensor:
    """A stack ``t`` of ours as peft's ``ParamWrapper`` stores it: ``A`` (E, r, in) -> ``lora_A.weight`` (E*r, in),
    row ``e*r + j``; ``B`` (E, out, r) -> ``lora_B.weight`` (out, r*E), column ``j*E + e`` (peft's
    ``get_delta_weight`` reshapes ``A`` to (E, r, in) and ``B`` to (out, r, E))."""
    if part == "lora_A":
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)
