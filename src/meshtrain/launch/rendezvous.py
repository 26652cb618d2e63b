"""Multi-node options checked before torchrun's agent starts: ``--rdzv-endpoint`` / ``--nnodes`` /
``--node-rank`` make sense together, and the rendezvous port on this machine is free (or held by another
meshtrain/torchrun launcher whose c10d rendezvous this node joins)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from meshtrain.errors import ConfigError


def check_rendezvous(args: argparse.Namespace, nnodes: int) -> None:
    """The multi-node options make sense together. Raises ConfigError with one line."""
    if args.rdzv_endpoint:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--rdzv-endpoint = {args.rdzv_endpoint!r} is not HOST:PORT with a port in 1..65535, "
                              f"e.g. node0.cluster:29500")
    elif nnodes > 1:
        raise ConfigError(f"--nnodes = {args.nnodes} needs --rdzv-endpoint HOST:PORT, where the nodes meet")
    if args.node_rank is not None:
        if not args.rdzv_endpoint:
            raise ConfigError(f"--node-rank = {args.node_rank} needs --rdzv-endpoint HOST:PORT (one node numbers "
                              f"itself 0 without it)")
        if ":" in str(args.nnodes):
            raise ConfigError(f"--node-rank needs a fixed --nnodes, got {args.nnodes!r}: drop --node-rank for an "
                              f"elastic range")
        if args.node_rank >= nnodes:
            raise ConfigError(f"--node-rank = {args.node_rank} must be below --nnodes = {nnodes}")
    if args.rdzv_endpoint:
        check_port(args.rdzv_endpoint, static_host=args.node_rank == 0)


def check_port(endpoint: str, static_host: bool) -> None:
    """The rendezvous port, where this machine is its host, is free or held by another meshtrain/torchrun
    launcher (the c10d rendezvous of another node started here). A port held by any other program would
    make torchrun's agent wait on it forever (c10d) or fail with a traceback (static, ``--node-rank 0``,
    which must bind it itself). Ports on other machines cannot be inspected and are left to torchrun.

    Raises:
        ConfigError: the port is held by another program, named by pid and command line when readable.
    """
    import socket

    host, port = endpoint.rsplit(":", 1)
    if not _is_this_machine(host):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
        try:
            probe.bind(("", int(port)))
            return
        except OSError:
            pass
    holder = port_holder(int(port))
    if holder and not static_host and _is_launcher(holder[1]):
        return  # another node's launcher on this machine hosts the c10d rendezvous: join it
    held_by = f"pid {holder[0]} ({' '.join(' '.join(holder[1]).split())[:100]})" if holder else "another program"
    raise ConfigError(f"--rdzv-endpoint = {endpoint}: port {port} on this machine is already held by {held_by}; "
                      f"choose a free port")


def _is_launcher(argv: list[str]) -> bool:
    """``meshtrain train`` or torchrun, by the program or module its command line runs."""
    return (any(Path(a).name in ("meshtrain", "torchrun") for a in argv[:2])
            or any(a in ("meshtrain.cli", "torch.distributed.run") for a in argv[1:3]))


def _is_this_machine(host: str) -> bool:
    import socket

    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False  # torchrun reports an unknown host itself
    if address.startswith("127.") or address == "0.0.0.0":
        return True
    try:
        return address in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


def port_holder(port: int) -> tuple[int, list[str]] | None:
    """(pid, argv) of the process listening on TCP ``port`` (``/proc/net/tcp{,6}`` gives the socket's
    inode, ``/proc/PID/fd`` its owner); None when not found or not readable (Linux only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                return int(proc.name), [a for a in argv if a]
        except OSError:
            continue
    return None
