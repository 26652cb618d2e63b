"""Tensor parallelism (``tp``): split each block's matrices across the ranks of the "tp" mesh axis.

Megatron-LM's scheme (Shoeybi et al. 2019, arXiv:1909.08053, Sec. 3) built on DTensor
``parallelize_module``: the model supplies the plan (which submodule is column-, row- or
sequence-parallel, :mod:`meshtrain.models.tp_plan`), this module applies it and keeps the
model-agnostic part: re-tying shared weights. Dropout under tp is in :mod:`meshtrain.parallel.rng`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Shard ``model`` in place across the 1-D ``tp_mesh`` with the plan ``model.tp_plan(sequence_parallel)``.

    Parameters become ``DTensor`` shards (``Shard(0)`` for column-parallel weights and the vocab-split
    embedding, ``Shard(1)`` for row-parallel weights, ``Replicate()`` for sequence-parallel norms).
    The model's ``tie_weights()`` is called afterwards (``parallelize_module`` distributes each module's
    parameter separately, which would untie a shared embedding/head weight).
    """
    parallelize_module(model, tp_mesh, model.tp_plan(sequence_parallel))
    model.tie_weights()
    return model
