"""The device mesh: one validated object owns the parallel degrees and the ``DeviceMesh``.

Axes are ordered outer to inner ``("pp", "dp", "sp", "tp")`` (DESIGN.md): tp is innermost so its
ranks are neighbours (inside one node), pp outermost so stages cross nodes. Rank ``r`` has the
coordinates ``r = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshtrain.config import ConfigError


class Axis(StrEnum):
    """Mesh axis names, outer to inner."""

    PP = "pp"
    DP = "dp"
    SP = "sp"
    TP = "tp"


AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.SP, Axis.TP)
BATCH_MESH = "dp_sp"
"""Derived mesh of dp and sp flattened: the gradient all-reduce / reduce-scatter and the loss mean span it."""


@dataclass
class ParallelDims:
    """Parallel degrees of a run, checked when built; ``build_mesh`` makes the ``DeviceMesh``.

    Raises:
        ConfigError: a degree < 1 or ``pp*dp*sp*tp != world_size``.
    """

    pp: int
    dp: int
    sp: int
    tp: int
    world_size: int
    mesh: DeviceMesh | None = field(default=None, repr=False)
    batch_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            if self.degree(axis) < 1:
                raise ConfigError(f"parallel.{axis} = {self.degree(axis)} must be >= 1")
        product = self.pp * self.dp * self.sp * self.tp
        if product != self.world_size:
            raise ConfigError(f"pp*dp*sp*tp = {self.pp}*{self.dp}*{self.sp}*{self.tp} = {product} "
                              f"must equal world_size = {self.world_size}")

    def degree(self, axis: Axis | str) -> int:
        return getattr(self, str(axis))

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

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
        return self.dp * self.sp

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
            self.batch_mesh = self.mesh[(str(Axis.DP), str(Axis.SP))]._flatten(BATCH_MESH)
            # DeviceMesh creates its groups with torch's default timeout (30 min for gloo), not the
            # default group's; give them the run's (torchtitan sets its mesh groups' timeouts the same way).
            for group in {*(self.mesh.get_group(str(a)) for a in AXES), self.batch_mesh.get_group()}:
                dist.distributed_c10d._set_pg_timeout(collective_timeout(), group)
        return self.mesh

    def get_mesh(self, axis: Axis | str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` (one of AXES, or ``"dp_sp"``).

        Raises:
            RuntimeError: before ``build_mesh``.
            KeyError: an unknown axis.
        """
        if self.mesh is None:
            raise RuntimeError("build_mesh() must be called before get_mesh()")
        if str(axis) not in {str(a) for a in AXES} | {BATCH_MESH}:
            raise KeyError(f"unknown mesh axis {axis!r}; valid: {', '.join(map(str, AXES))}, {BATCH_MESH}")
        return self.batch_mesh if str(axis) == BATCH_MESH else self.mesh[str(axis)]

    def batch_groups(self) -> list[list[int]]:
        """Global ranks of every ``"dp_sp"`` group of the mesh (one per pp and tp coordinate): the ranks
        that average a gradient together. Needs ``build_mesh``."""
        ranks = self.mesh.mesh.permute(0, 3, 1, 2)  # (pp, tp, dp, sp)
        return ranks.reshape(-1, self.dp * self.sp).tolist()

    def rank_of(self, axis: Axis | str) -> int:
        """This process's coordinate on ``axis`` (0 without a process group)."""
        if self.mesh is None:
            return self.coordinates(dist.get_rank() if dist.is_initialized() else 0)[str(axis)]
        return self.get_mesh(axis).get_local_rank()


def device_and_backend() -> tuple[torch.device, str]:
    """(device, backend): ``cuda:LOCAL_RANK`` with nccl when CUDA is present, else ``cpu`` with gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def compute_dtype(name: str, device_type: str) -> str:
    """The dtype ``train.dtype = name`` trains in on ``device_type`` ("cpu"/"cuda"): "float32" or "bfloat16".

    "auto" is bfloat16 where matmuls have bf16 hardware: a CUDA GPU with bf16 (Ampere and newer,
    ``torch.cuda.is_bf16_supported()``) or a CPU with AVX512-BF16/AMX (oneDNN's bf16 path,
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); elsewhere float32, because bf16 GEMMs emulated on
    an AVX2-only CPU ran 30-180x slower than fp32 (docs/benchmarks.md)."""
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def autocast(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context a forward runs in for ``dtype`` (a :func:`compute_dtype` result) on ``device_type``:
    bf16 autocast (fp32 master weights, matmuls in bf16) for "bfloat16", nothing for "float32"."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()


_TIMEOUT = timedelta(minutes=30)
LOOPBACK_ENV = "MESHTRAIN_LOOPBACK_STORE"
"""Set by ``meshtrain train`` on one machine: rank 0 hosts the ranks' store on 127.0.0.1 only."""


def collective_timeout() -> timedelta:
    """How long a collective of this run may wait for its peers (``train.collective_timeout_s``, set by
    :func:`init_distributed`): every group the run creates is given it."""
    return _TIMEOUT


def loopback_store(rank: int, world: int) -> dist.TCPStore:
    """The ranks' key-value store on 127.0.0.1:``MASTER_PORT``, hosted by rank 0. torch's own (``env://``)
    binds every interface; here rank 0 binds the listening socket itself and hands it over
    (``TCPStore(master_listen_fd=...)``, which then owns it)."""
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_TIMEOUT)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    return dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=_TIMEOUT,
                         master_listen_fd=listener.detach(), use_libuv=False)


def init_distributed(backend: str, timeout_s: float | None = None) -> tuple[int, int]:
    """Join the process group torchrun set up (``RANK``/``WORLD_SIZE`` env), or make a 1-rank group.

    ``timeout_s`` (seconds; None: torch's default, 30 min) bounds every collective's wait for its peers;
    past it gloo raises ``Timed out waiting ...`` in the waiting rank (NCCL's watchdog aborts it).
    Returns ``(rank, world_size)``. A single process without torchrun gets a world of one through an
    in-memory store, so the same trainer code runs with and without a launcher.
    """
    global _TIMEOUT
    if timeout_s is not None:
        _TIMEOUT = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # nccl: bind the group to this rank's GPU (set by device_and_backend) rather than let torch guess it
        device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        if os.environ.get(LOOPBACK_ENV) == "1" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=loopback_store(rank, world), rank=rank, world_size=world,
                                    timeout=_TIMEOUT, **device)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=_TIMEOUT, **device)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_TIMEOUT,
                                    **device)
    return dist.get_rank(), dist.get_world_size()
