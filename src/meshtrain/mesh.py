"""The device mesh: one validated object owns the parallel degrees and the ``DeviceMesh``.

Axes are ordered outer to inner ``("pp", "dp", "sp", "tp")`` (docs/architecture.md): tp is innermost so its
ranks are neighbours (inside one node), pp outermost so stages cross nodes. Rank ``r`` has the
coordinates ``r = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain import axes
from meshtrain.axes import AXES, BATCH_AXES, BATCH_MESH, EXPERT_MESH, EXPERT_REPLICA_MESH, Axis
from meshtrain.config import ConfigError
from meshtrain.runtime.distributed import collective_timeout


__all__ = ["AXES", "Axis", "BATCH_MESH", "EXPERT_MESH", "EXPERT_REPLICA_MESH", "ParallelDims"]
RunDegrees = axes.degrees_dataclass("RunDegrees", "One resolved degree per axis (no -1).", defaults="none")


@dataclass
class ParallelDims(RunDegrees):
    """Parallel degrees of a run (one field per axis of :data:`meshtrain.axes.AXIS_TABLE`), checked when
    built; ``build_mesh`` makes the ``DeviceMesh``.

    Expert parallelism borrows its ``ep`` ranks from the batch mesh: ``ep`` consecutive ranks of ``"dp_sp"`` split
    the experts (the ``"ep"`` mesh), and the ``dp*sp/ep`` ranks at the same place in each such group hold the same
    experts (the ``"edp"`` mesh): torchtitan's and Megatron-Core's "parallel folding".

    Raises:
        ConfigError: a degree < 1, ``pp*dp*sp*tp != world_size``, or an ``ep`` that does not divide ``dp*sp``.
    """

    world_size: int
    mesh: DeviceMesh | None = field(default=None, repr=False)
    batch_mesh: DeviceMesh | None = field(default=None, repr=False)
    expert_meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if errors := axes.degree_errors(self, "parallel."):
            raise ConfigError(errors[0])
        product = axes.world_size(self)
        if product != self.world_size:
            raise ConfigError(f"{axes.product_text(AXES, self)} = {product} must equal world_size = {self.world_size}")
        if self.batch_degree % self.ep:
            raise ConfigError(axes.expert_degree_error(self.ep, self.dp, self.sp))

    def degree(self, axis: Axis | str) -> int:
        return getattr(self, str(axis))

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def batch_degree(self) -> int:
        """Ranks that hold different tokens of the global batch, ``dp * sp``: the gradient and the
        loss are averaged over them (the ``"dp_sp"`` mesh)."""
        return axes.batch_degree(self)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same experts, ``dp * sp / ep`` (the ``"edp"`` mesh)."""
        return self.batch_degree // self.ep

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "sp": k, "tp": l}`` of a global rank (row-major over AXES)."""
        coords = {}
        for axis in reversed(AXES):
            coords[str(axis)] = rank % self.degree(axis)
            rank //= self.degree(axis)
        return {str(a): coords[str(a)] for a in AXES}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create (once) the 4-D ``DeviceMesh`` over all ranks of the default process group, and the
        derived 1-D ``"dp_sp"`` mesh (dp and sp flattened: the ranks that see different tokens)."""
        if self.mesh is None:
            self.mesh = init_device_mesh(device_type, tuple(self.degree(a) for a in AXES),
                                         mesh_dim_names=tuple(str(a) for a in AXES))
            self.batch_mesh = self.mesh[tuple(map(str, BATCH_AXES))]._flatten(BATCH_MESH)
            if self.ep_enabled:  # (edp, ep): ep consecutive batch ranks split the experts
                folded = self.batch_mesh._unflatten(0, (self.expert_replicas, self.ep),
                                                    (EXPERT_REPLICA_MESH, EXPERT_MESH))
                self.expert_meshes = {EXPERT_MESH: folded[EXPERT_MESH], EXPERT_REPLICA_MESH: folded[EXPERT_REPLICA_MESH]}
            # DeviceMesh creates its groups with torch's default timeout (30 min for gloo), not the
            # default group's; give them the run's (torchtitan sets its mesh groups' timeouts the same way).
            for group in {*(self.mesh.get_group(str(a)) for a in AXES), self.batch_mesh.get_group(),
                          *(m.get_group() for m in self.expert_meshes.values())}:
                dist.distributed_c10d._set_pg_timeout(collective_timeout(), group)
        return self.mesh

    def get_mesh(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` (one of AXES, ``"dp_sp"``, or with ep > 1 ``"ep"`` and ``"edp"``).

        Raises:
            RuntimeError: before ``build_mesh``.
            KeyError: an unknown axis.
        """
        if self.mesh is None:
            raise RuntimeError("build_mesh() must be called before get_mesh()")
        if str(axis) in self.expert_meshes:
            return self.expert_meshes[str(axis)]
        if str(axis) not in {str(a) for a in AXES} | {BATCH_MESH}:
            raise KeyError(f"unknown mesh axis {axis!r}; valid: {', '.join(map(str, AXES))}, {BATCH_MESH}"
                           f"{', ' + ', '.join(self.expert_meshes) if self.expert_meshes else ''}")
        return self.batch_mesh if str(axis) == BATCH_MESH else self.mesh[str(axis)]

    def batch_groups(self) -> list[list[int]]:
        """Global ranks of every ``"dp_sp"`` group of the mesh (one per pp and tp coordinate): the ranks
        that average a gradient together. Needs ``build_mesh``."""
        batch = [AXES.index(a) for a in BATCH_AXES]
        ranks = self.mesh.mesh.permute(*[i for i in range(len(AXES)) if i not in batch], *batch)  # (pp, tp, dp, sp)
        return ranks.reshape(-1, self.batch_degree).tolist()

    def rank_of(self, axis: Axis | str) -> int:
        """This process's coordinate on ``axis`` (0 without a process group)."""
        if self.mesh is None:
            return self.coordinates(dist.get_rank() if dist.is_initialized() else 0)[str(axis)]
        return self.get_mesh(axis).get_local_rank()

