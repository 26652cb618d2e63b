"""The device mesh: one validated object owns the parallel degrees and the ``DeviceMesh``.

Axes are ordered outer to inner ``("pp", "dp", "sp", "tp")`` (docs/architecture.md): tp is innermost so its
ranks are neighbours (inside one node), pp outermost so stages cross nodes. Rank ``r`` has the
coordinates ``r = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``. ``ep`` is no axis of its own: it
borrows its ranks from the flattened ``"dp_sp"`` mesh, unflattened into ``("edp", "ep")`` (consecutive ranks split
the experts, the ``edp`` ranks hold the same ones). USP (``sp_mode = "usp"``) splits the sp mesh the same way into
``("sp_ring", "sp_ulysses")`` (:meth:`ParallelDims.split_sp`): ``sp_ulysses`` consecutive sp ranks run Ulysses, and the
ranks at the same place in each such group form the ring, so sp rank ``k = ring_rank * sp_ulysses + ulysses_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain import axes
from meshtrain.axes import (AXES, BATCH_AXES, BATCH_MESH, EXPERT_MESH, EXPERT_REPLICA_MESH, SP_RING_MESH,
                            SP_ULYSSES_MESH, WORKER_MESH, Axis)
from meshtrain.errors import ConfigError
from meshtrain.runtime.distributed import collective_timeout


__all__ = ["AXES", "Axis", "BATCH_MESH", "EXPERT_MESH", "EXPERT_REPLICA_MESH", "SP_RING_MESH", "SP_ULYSSES_MESH",
           "WORKER_MESH", "ParallelDims"]
RunDegrees = axes.degrees_dataclass("RunDegrees", "One resolved degree per axis (no -1).", defaults="none")


@dataclass
class ParallelDims(RunDegrees):
    """Parallel degrees of a run (one field per axis of :data:`meshtrain.axes.AXIS_TABLE`), checked when
    built; ``build_mesh`` makes the ``DeviceMesh``.

    Expert parallelism borrows its ``ep`` ranks from the batch mesh: ``ep`` consecutive ranks of ``"dp_sp"`` split
    the experts (the ``"ep"`` mesh), and the ``dp*sp/ep`` ranks at the same place in each such group hold the same
    experts (the ``"edp"`` mesh): torchtitan's and Megatron-Core's "parallel folding".

    DiLoCo's ``workers`` (:mod:`meshtrain.parallel.diloco`) are a mesh dimension outside all axes (``"diloco"``):
    worker ``w`` is ranks ``w*G .. (w+1)*G - 1`` with ``G = world_size / workers`` (one node each), and every axis,
    ``dp`` included, is this worker's: ``dp`` here is the worker's data-parallel degree, the run's divided by
    ``workers``, so that DDP, FSDP2, tp, pp and sp run inside one worker, unchanged.

    Raises:
        ConfigError: a degree < 1, ``workers*pp*dp*sp*tp != world_size``, or an ``ep`` that does not divide ``dp*sp``.
    """

    world_size: int
    workers: int = 1
    mesh: DeviceMesh | None = field(default=None, repr=False)
    batch_mesh: DeviceMesh | None = field(default=None, repr=False)
    expert_meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    sp_meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if errors := axes.degree_errors(self, "parallel."):
            raise ConfigError(errors[0])
        product = axes.world_size(self) * self.workers
        if product != self.world_size:
            workers = f"{self.workers} workers * " if self.workers > 1 else ""
            raise ConfigError(f"{workers}{axes.product_text(AXES, self)} = {product} must equal world_size = "
                              f"{self.world_size}")
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

    @property
    def worker_size(self) -> int:
        """Ranks of one DiLoCo worker (all of them without DiLoCo)."""
        return self.world_size // self.workers

    def worker_of(self, rank: int) -> int:
        """The DiLoCo worker of a global rank (0 without DiLoCo)."""
        return rank // self.worker_size

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "sp": k, "tp": l}`` of a global rank inside its worker (row-major over AXES)."""
        rank %= self.worker_size
        coords = {}
        for axis in reversed(AXES):
            coords[str(axis)] = rank % self.degree(axis)
            rank //= self.degree(axis)
        return {str(a): coords[str(a)] for a in AXES}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create (once) the 4-D ``DeviceMesh`` over all ranks of the default process group, and the
        derived 1-D ``"dp_sp"`` mesh (dp and sp flattened: the ranks that see different tokens)."""
        if self.mesh is None:
            outer = ((self.workers,), (WORKER_MESH,)) if self.workers > 1 else ((), ())
            self.mesh = init_device_mesh(device_type, (*outer[0], *(self.degree(a) for a in AXES)),
                                         mesh_dim_names=(*outer[1], *(str(a) for a in AXES)))
            self.batch_mesh = self.mesh[tuple(map(str, BATCH_AXES))]._flatten(BATCH_MESH)
            if self.ep_enabled:  # (edp, ep): ep consecutive batch ranks split the experts
                folded = self.batch_mesh._unflatten(0, (self.expert_replicas, self.ep),
                                                    (EXPERT_REPLICA_MESH, EXPERT_MESH))
                self.expert_meshes = {EXPERT_MESH: folded[EXPERT_MESH], EXPERT_REPLICA_MESH: folded[EXPERT_REPLICA_MESH]}
            # DeviceMesh creates its groups with torch's default timeout (30 min for gloo), not the
            # default group's; give them the run's (torchtitan sets its mesh groups' timeouts the same way).
            for group in {*(self.mesh.get_group(name) for name in self.mesh.mesh_dim_names), self.batch_mesh.get_group(),
                          *(m.get_group() for m in self.expert_meshes.values())}:
                dist.distributed_c10d._set_pg_timeout(collective_timeout(), group)
        return self.mesh

    def split_sp(self, ulysses: int) -> None:
        """Split the sp mesh (once) into ``("sp_ring", "sp_ulysses")``: ``ulysses`` consecutive sp ranks (USP's
        Ulysses all-to-all, innermost) times ``sp / ulysses`` of them (its ring); then :meth:`get_mesh` has both.
        Every rank must call it, in the same order (it creates process groups). Needs ``build_mesh``.

        Raises:
            ConfigError: ``ulysses`` is not a divisor of sp (config validation refuses such a layout first).
        """
        if ulysses < 1 or self.sp % ulysses:
            raise ConfigError(f"parallel.sp_ulysses = {ulysses} does not divide parallel.sp = {self.sp}")
        if self.sp_meshes:
            return
        folded = self.get_mesh(Axis.SP)._unflatten(0, (self.sp // ulysses, ulysses), (SP_RING_MESH, SP_ULYSSES_MESH))
        self.sp_meshes = {SP_RING_MESH: folded[SP_RING_MESH], SP_ULYSSES_MESH: folded[SP_ULYSSES_MESH]}
        for group in {m.get_group() for m in self.sp_meshes.values()}:  # the run's timeout, as build_mesh's groups
            dist.distributed_c10d._set_pg_timeout(collective_timeout(), group)

    def get_mesh(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` in this rank's worker (one of AXES, ``"dp_sp"``, with ep > 1 ``"ep"`` and
        ``"edp"``, after :meth:`split_sp` ``"sp_ring"`` and ``"sp_ulysses"``), or with DiLoCo workers ``"diloco"``:
        the ranks at this rank's place in every worker.

        Raises:
            RuntimeError: before ``build_mesh``.
            KeyError: an unknown axis.
        """
        if self.mesh is None:
            raise RuntimeError("build_mesh() must be called before get_mesh()")
        derived = {**self.expert_meshes, **self.sp_meshes}
        if str(axis) in derived:
            return derived[str(axis)]
        if str(axis) not in {*self.mesh.mesh_dim_names, BATCH_MESH}:
            raise KeyError(f"unknown mesh axis {axis!r}; valid: {', '.join(self.mesh.mesh_dim_names)}, {BATCH_MESH}"
                           f"{', ' + ', '.join(derived) if derived else ''}")
        return self.batch_mesh if str(axis) == BATCH_MESH else self.mesh[str(axis)]

    def batch_groups(self) -> list[list[int]]:
        """Global ranks of every ``"dp_sp"`` group of the mesh (one per pp and tp coordinate): the ranks
        that average a gradient together. Needs ``build_mesh``."""
        batch = [AXES.index(a) for a in BATCH_AXES]
        ranks = self.stage_ranks().permute(*[i for i in range(len(AXES)) if i not in batch], *batch)  # (pp, tp, dp, sp)
        return ranks.reshape(-1, self.batch_degree).tolist()

    def stage_ranks(self) -> torch.Tensor:
        """The global ranks of the mesh as (pp, dp, sp, tp), DiLoCo's workers folded into dp. Needs ``build_mesh``."""
        if self.workers == 1:
            return self.mesh.mesh
        return self.mesh.mesh.movedim(0, 1).flatten(1, 2)  # (workers, pp, dp, ...) -> (pp, workers * dp, ...)

    def rank_of(self, axis: Axis | str) -> int:
        """This process's coordinate on ``axis`` (0 without a process group)."""
        if self.mesh is None:
            return self.coordinates(dist.get_rank() if dist.is_initialized() else 0)[str(axis)]
        return self.get_mesh(axis).get_local_rank()


