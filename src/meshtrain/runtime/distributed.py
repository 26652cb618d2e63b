"""The process group a rank joins: torchrun's (``RANK``/``WORLD_SIZE``), a loopback-only store on one
machine, or a one-rank group without a launcher; and the timeout every collective of the run gets."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


_TIMEOUT = timedelta(minutes=30)
LOOPBACK_ENV = "MESHTRAIN_LOOPBACK_STORE"
"""Set by ``meshtrain train`` on one machine: rank 0 hosts the ranks' store on 127.0.0.1 only."""
STORE_PORT_ENV = "MESHTRAIN_STORE_PORT"
"""Set with :data:`LOOPBACK_ENV`: the port :func:`reserve_loopback_port` holds for the ranks' store, which the
ranks use instead of torchrun's ``MASTER_PORT``."""


def reserve_loopback_port() -> socket.socket:
    """A socket bound (not listening) to a free port of 127.0.0.1, with ``SO_REUSEPORT``, that the launcher keeps
    open for the whole run; its port is the ranks' store port (:data:`STORE_PORT_ENV`).

    torchrun picks ``MASTER_PORT`` by binding port 0 and closing the socket, so until rank 0 binds it (seconds
    later, after importing torch) any other process's ``bind(0)`` or outgoing ``connect()`` may take the port and
    rank 0 fails with ``EADDRINUSE``. The kernel gives neither a port that a socket holds bound, while rank 0 may
    bind it too because both sockets set ``SO_REUSEPORT`` (Linux ``socket(7)``: same user, both with the option).
    Close it when the run ends."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind(("127.0.0.1", 0))
    return reserved


def collective_timeout() -> timedelta:
    """How long a collective of this run may wait for its peers (``train.collective_timeout_s``, set by
    :func:`init_distributed`): every group the run creates is given it."""
    return _TIMEOUT


def loopback_store(rank: int, world: int) -> dist.TCPStore:
    """The ranks' key-value store on 127.0.0.1:``MASTER_PORT``, hosted by rank 0. torch's own (``env://``)
    binds every interface; here rank 0 binds the listening socket itself and hands it over
    (``TCPStore(master_listen_fd=...)``, which then owns it). With :data:`STORE_PORT_ENV` set, that port (which
    the launcher holds, :func:`reserve_loopback_port`) replaces ``MASTER_PORT``, in this rank's environment too,
    so everything after (an elastic worker's manager) finds the same store."""
    if os.environ.get(STORE_PORT_ENV):
        os.environ["MASTER_PORT"] = os.environ[STORE_PORT_ENV]
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_TIMEOUT)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # beside the launcher's reservation
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
