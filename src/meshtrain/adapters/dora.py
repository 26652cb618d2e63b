"""Weight-decomposed low-rank adaptation (DoRA; Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation",
arXiv:2402.09353): a LoRA adapter plus a trained magnitude per output feature, as peft's ``use_dora`` computes it.

Eq. 5 of the paper, in torch's (out, in) layout: ``W' = m * (W + s B A) / ||W + s B A||_row``, with ``m`` (out,) the
magnitude (initialised to ``||W||_row``, so the adapted model starts as the base) and ``||.||_row`` the norm of each
output feature's row (the paper's column norm of its (in, out) matrix). As Sec. 4.3 suggests and peft does, the norm
is treated as a constant: computed without gradient, so only ``m``, ``A`` and ``B`` get gradients through ``m / norm``
and the LoRA term. The output is peft's (``DoraLinearLayer.forward`` and ``DoraLinearVariant.forward``)::

    y = W x + b + (m / n - 1) * W x' + (m / n) * s * B A x'      (n = ||W + s B A||_row, detached)

with ``x' = dropout(x)`` while training with dropout (else ``x``, and ``W x'`` is the base's own output): with no
dropout that is ``(m / n) (W + s B A) x + b``, Eq. 5's layer.

Tensor parallelism (Megatron-LM's layout, as the LoRA adapters, :mod:`meshtrain.adapters.lora`): the ops run on the
DTensors the tp plan made. A column-parallel base holds whole rows (out/tp of them): its norms, its ``m`` (sharded
like ``B``, by rows) and its outputs are local, no communication. A row-parallel base holds in/tp columns of every
row: each rank's ``||W_i + s B A_i||^2`` is a partial sum, and DTensor's norm adds the squares over the tp ranks (one
all-reduce of ``out`` numbers per forward, without gradient); ``m`` is replicated, and ``(m / n)`` times each rank's
partial output is a partial sum that the base's own all-reduce (reduce-scatter with sequence parallelism) completes.

Shape legend: in, out the base's features (global), r the rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshtrain.adapters.lora import LoRALinear


class DoRALinear(LoRALinear):
    """A :class:`LoRALinear` with DoRA's magnitude ``lora_magnitude_vector`` (out,) (module docstring)."""

    lora_magnitude_vector: nn.Parameter

    def weight_norm(self) -> torch.Tensor:
        """``||W + s B A||`` of each output row (out,), without gradient (DoRA, Sec. 4.3); a DTensor under tp (module
        docstring: summed over the shards of a row-parallel base)."""
        with torch.no_grad():
            merged = self.weight + self.scaling * (self.lora_B.weight @ self.lora_A.weight)  # (out, in)
            return torch.linalg.vector_norm(merged, dim=1)  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., in) -> (..., out): peft's DoRA output (module docstring)."""
        dropped = self.lora_dropout(x)
        base = self.base_output(x)  # (..., out): W x + b
        if dropped is x or not self.training:
            plain = base if self.bias is None else base - self.bias  # W x
        else:
            plain = F.linear(dropped, self.weight)  # W x'
        factor = self.lora_magnitude_vector / self.weight_norm()  # (out,): m / n
        lora = F.linear(self.lora_A(dropped), self.lora_B.weight * self.scaling)  # (..., out): s B A x'
        return base + (factor - 1) * plain + factor * lora


def add_dora(module: LoRALinear) -> DoRALinear:
    """Give ``module`` (a :class:`LoRALinear`, plain or tensor-parallel) DoRA's magnitude, ``m = ||W + s B A||_row``
    (``B`` is zero at initialisation: ``||W||_row``, peft's ``DoraLinearLayer.update_layer``), in place; return it.
    Under tp ``m`` follows ``B``'s rows: sharded by rows for a column-parallel base, replicated for a row-parallel one."""
    module.__class__ = DoRALinear
    magnitude = module.weight_norm()  # (out,)
    if isinstance(magnitude, DTensor):
        rows = module.lora_B.weight.placements[0]
        magnitude = magnitude.redistribute(magnitude.device_mesh, [rows if isinstance(rows, Shard) else Replicate()])
    module.lora_magnitude_vector = nn.Parameter(magnitude)
    return module


@torch.no_grad()
def merge_dora(module: DoRALinear) -> None:
    """Fold the adapter into the base weight, ``W <- (m / n) (W + s B A)`` (peft's ``DoraLinearVariant.merge_safe``;
    the bias is unchanged), one process, plain tensors, and make the module a plain ``nn.Linear`` again."""
    factor = (module.lora_magnitude_vector / module.weight_norm())[:, None]  # (out, 1)
    module.weight.copy_(factor * (module.weight + module.scaling * (module.lora_B.weight @ module.lora_A.weight)))
    del module.lora_magnitude_vector, module.lora_A, module.lora_B, module.lora_dropout, module.scaling
    module.__class__ = nn.Linear
