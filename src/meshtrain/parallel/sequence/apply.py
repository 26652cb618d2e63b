"""Swap sequence-parallel attention into a model: :func:`apply_sp`."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.parallel.sequence.ring import RingAttention
from meshtrain.parallel.sequence.shard import SP_MODES
from meshtrain.parallel.sequence.ulysses import UlyssesAttention
from meshtrain.parallel.sequence.usp import USPAttention


def apply_sp(model: nn.Module, sp_mesh: DeviceMesh, sp_mode: str, ulysses_mesh: DeviceMesh | None = None,
             ring_mesh: DeviceMesh | None = None) -> nn.Module:
    """Replace every ``inner_attention`` submodule of ``model`` by the ``sp_mode`` module on the 1-D ``sp_mesh``
    ("usp": on ``ulysses_mesh`` and ``ring_mesh``, the sp mesh split by
    :meth:`meshtrain.mesh.ParallelDims.split_sp`).

    The model's inputs must then be this rank's tokens
    (:func:`~meshtrain.parallel.sequence.shard.shard_sequence` along T, positions from
    :func:`~meshtrain.parallel.sequence.shard.sequence_positions`). Ulysses keeps the replaced module's
    ``dropout`` (0 if it has none); ring attention and USP have no attention dropout. Returns ``model``, changed
    in place.

    Raises:
        ValueError: ``sp_mode`` is not "ulysses", "ring" or "usp", or "usp" without both sub-meshes.
    """
    if sp_mode not in SP_MODES:
        raise ValueError(f"sequence-parallel mode = {sp_mode!r} is not known: use one of {SP_MODES}")
    if sp_mode == "usp" and (ulysses_mesh is None or ring_mesh is None):
        raise ValueError("sp_mode = 'usp' needs the sp mesh's Ulysses and ring sub-meshes (ParallelDims.split_sp)")
    group = sp_mesh.get_group()
    for parent in [m for m in model.modules() if hasattr(m, "inner_attention")]:
        dropout = getattr(parent.inner_attention, "dropout", 0.0)
        if sp_mode == "usp":
            parent.inner_attention = USPAttention(ulysses_mesh.get_group(), ring_mesh.get_group())
        else:
            parent.inner_attention = UlyssesAttention(group, dropout) if sp_mode == "ulysses" else RingAttention(group)
    return model
