"""Two hosts on one machine: two Linux network namespaces joined by a veth pair (root and iproute2 only), or by
a slow link emulated in user space (``tests/linkem.py``: rate and one-way delay, as ``tc netem`` sets them).

Each namespace has its loopback and one end of the pair, named ``IFNAME`` in both (as a cluster's nodes
share an interface name, so one ``GLOO_SOCKET_IFNAME`` serves every node), 10.77.0.1/24 and 10.77.0.2/24.
:meth:`Host.run` runs a command on a host: in its network namespace, with its own hostname (a UTS
namespace) and an ``/etc/hosts`` naming both hosts (bind-mounted in a private mount namespace, which
leaves ``/sys`` and its cgroups as they are, unlike ``ip netns exec``). :func:`two_hosts` removes the
namespaces and the pair (or stops the emulator, whose devices go with it) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

IFNAME = "mtnet"
EMULATED_MTU = 9000
"""The emulated link's MTU: jumbo frames, as cluster networks use; it also keeps the emulator's packets few
(1,400 a second each way at 100 Mbit/s)."""


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


@dataclass(frozen=True)
class Host:
    name: str
    """Its hostname, resolved on both hosts."""
    ns: str
    """The network namespace."""
    addr: str
    hosts_file: str
    """The ``/etc/hosts`` it sees."""

    def run(self, *argv: str) -> list[str]:
        """``argv`` as a command line on this host (each piece execs the next: the pid is ``argv``'s)."""
        enter = 'hostname "$1" && mount --bind "$2" /etc/hosts && n="$3" && shift 3 && exec nsenter --net="$n" "$@"'
        return ["unshare", "--mount", "--uts", "sh", "-c", enter, "sh", self.name, self.hosts_file,
                f"/run/netns/{self.ns}", *argv]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def _emulator(ends: list[str], rate: str, delay: str) -> subprocess.Popen:
    """``tests/linkem.py`` making the TUN devices ``ends``, once it says they exist."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("linkem.py")), *ends, "--rate", rate,
                             "--delay", delay], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise Unavailable(f"the link emulator did not start: {proc.communicate()[1].strip()[-500:]}")
    return proc


@contextlib.contextmanager
def two_hosts(tag: str, emulate: tuple[str, str] | None = None):
    """Yield two :class:`Host` joined by a veth pair, or with ``emulate = (rate, delay)`` (tc's notation, e.g.
    ``("100mbit", "10ms")``) by two TUN devices and ``tests/linkem.py`` between them, which shapes each way as
    ``tc netem rate RATE delay DELAY`` does, on kernels without netem. ``tag`` (a few letters and digits, unique
    among the machine's concurrent users) names the namespaces, the pair and the hosts."""
    if os.geteuid() != 0:
        raise Unavailable(f"network namespaces need root (`ip netns add`); this runs as uid {os.geteuid()}")
    missing = [tool for tool in ("ip", "ss", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"two hosts need iproute2 and util-linux; not installed here: {', '.join(missing)}")
    folder = tempfile.mkdtemp(prefix="meshtrain-hosts-")
    pair = [Host(f"{tag}node{i}", f"{tag}-{i}", f"10.77.0.{i + 1}", f"{folder}/hosts") for i in range(2)]
    Path(folder, "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in pair))
    ends = [f"{tag}v{i}" for i in range(2)]  # names in the machine's namespace, until moved
    made: list[Host] = []
    emulator = None
    try:
        for host in pair:
            _ip("netns", "add", host.ns)
            made.append(host)
        if emulate:
            emulator = _emulator(ends, *emulate)
        else:
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for host, end in zip(pair, ends):
            _ip("link", "set", end, "netns", host.ns)
            _ip("-n", host.ns, "link", "set", end, "name", IFNAME)
            if emulate:
                _ip("-n", host.ns, "link", "set", IFNAME, "mtu", str(EMULATED_MTU))
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "link", "set", IFNAME, "up")
        yield pair
    finally:
        if emulator is not None:
            emulator.terminate()
            emulator.communicate(timeout=30)
        for host in made:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "delete", host.ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", ends[0]], capture_output=True)  # made but never moved
        shutil.rmtree(folder, ignore_errors=True)


def listeners(pair: list[Host], pids: set[int]) -> set[tuple]:
    """Listening TCP sockets in each namespace, and those of ``pids`` in the machine's own namespace:
    (namespace or "machine", local address, port, process)."""
    found = set()
    for where, prefix in [(h.ns, ["ip", "netns", "exec", h.ns]) for h in pair] + [("machine", [])]:
        rows = subprocess.run([*prefix, "ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        for row in rows:
            fields = row.split()
            if where != "machine" or any(f"pid={pid}," in row for pid in pids):
                addr, port = fields[3].rsplit(":", 1)
                found.add((where, addr, int(port), fields[-1] if "users:" in fields[-1] else ""))
    return found


def descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (from /proc)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, grew = set(roots), True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def link_bytes(pair: list[Host]) -> int:
    """Bytes sent so far over the link (the veth pair or the emulated link's TUN devices), both ends together (the
    kernel's counters)."""
    total = 0
    for host in pair:
        out = subprocess.run(["ip", "-n", host.ns, "-s", "-j", "link", "show", IFNAME], check=True, capture_output=True,
                             text=True).stdout
        total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
    return total
