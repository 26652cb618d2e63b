"""A slow link in user space, for kernels without ``tc netem``: two TUN devices and one process between them.

    python tests/linkem.py NAME0 NAME1 --rate 100mbit --delay 10ms

Makes the TUN devices ``NAME0`` and ``NAME1`` (layer 3, no packet information), prints ``ready`` and then
carries every packet one device's host sends to the other device, each way on its own:

- **rate**: a packet leaves when the link has finished sending the ones before it, ``8 * len / rate`` seconds
  after (serialization: a packet of 9,000 bytes takes 0.72 ms at 100 Mbit/s);
- **delay**: it arrives ``delay`` after it left (one way; a round trip takes twice that, plus serialization).

That is ``tc qdisc ... netem rate R delay D`` with netem's defaults otherwise: first in, first out, no loss, no
jitter, a queue of any length (netem's ``limit`` of 100,000 packets is never reached here). The devices are
moved into network namespaces by whoever started this (:func:`netns.two_hosts`); a device keeps its file
descriptor there. Stops on SIGTERM or when its standard input closes (its parent gone), and the devices go with it.

Linux only (``/dev/net/tun``), root. Our own because a user-space emulator of a link is not a library on PyPI:
the packages there drive ``tc``, which is exactly what this kernel lacks.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import re
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
"""tc's rate units (tc(8), "RATES"): bit/s, or bytes/s for the *bps forms."""
TIMES = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(text: str) -> float:
    """``"100mbit"`` -> 1e8 bit/s, tc's notation. Raises ValueError naming the text and the units."""
    found = re.fullmatch(r"([0-9.]+)\s*([a-z]+)", text.strip().lower())
    if not found or found[2] not in UNITS or float(found[1]) <= 0:
        raise ValueError(f"rate {text!r}: expected a positive number and one of {', '.join(UNITS)}, e.g. 100mbit")
    return float(found[1]) * UNITS[found[2]]


def parse_time(text: str) -> float:
    """``"10ms"`` -> 0.01 s, tc's notation. Raises ValueError naming the text and the units."""
    found = re.fullmatch(r"([0-9.]+)\s*([a-z]+)", text.strip().lower())
    if not found or found[2] not in TIMES:
        raise ValueError(f"time {text!r}: expected a number >= 0 and one of {', '.join(TIMES)}, e.g. 10ms")
    return float(found[1]) * TIMES[found[2]]


def open_tun(name: str) -> int:
    """A new TUN device ``name`` (layer 3, no packet information); its file descriptor, non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class Direction:
    """One way of the link: packets read from ``src``, written to ``dst`` when due.

    A packet of n bytes read at time t leaves at ``free = max(t, free) + 8 n / rate`` (the link sends one packet
    at a time, in order) and is written at ``free + delay``. Arrival times grow with the queue, so a FIFO keeps
    them in order."""

    def __init__(self, src: int, dst: int, rate: float, delay: float):
        self.src, self.dst, self.rate, self.delay = src, dst, rate, delay
        self.free = 0.0
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()

    def take(self, now: float) -> None:
        """Read every packet waiting on ``src`` and queue it with its arrival time."""
        while True:
            try:
                packet = os.read(self.src, 65536)
            except BlockingIOError:
                return
            self.free = max(now, self.free) + 8 * len(packet) / self.rate
            self.queue.append((self.free + self.delay, packet))

    def deliver(self, now: float) -> float | None:
        """Write every packet due by ``now``; the arrival time of the next one, or None."""
        while self.queue and self.queue[0][0] <= now:
            packet = self.queue.popleft()[1]
            try:
                os.write(self.dst, packet)
            except OSError:  # the receiving device is down or full: the packet is lost
                pass
        return self.queue[0][0] if self.queue else None


def serve(fds: list[int], rate: float, delay: float) -> None:
    """Carry packets between the two devices until SIGTERM or standard input closes."""
    ways = [Direction(fds[0], fds[1], rate, delay), Direction(fds[1], fds[0], rate, delay)]
    by_src = {way.src: way for way in ways}
    watch = [*fds, sys.stdin.fileno()]
    while True:
        now = time.monotonic()
        due = [t for t in (way.deliver(now) for way in ways) if t is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        readable, _, _ = select.select(watch, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == watch[-1]:
                if not os.read(fd, 4096):
                    return
                continue
            by_src[fd].take(now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs=2, help="the two TUN devices to make (at most 15 characters each)")
    parser.add_argument("--rate", default="100mbit", help="each way, tc's notation (default 100mbit)")
    parser.add_argument("--delay", default="10ms", help="one way, tc's notation (default 10ms)")
    args = parser.parse_args()
    try:
        rate, delay = parse_rate(args.rate), parse_time(args.delay)
    except ValueError as error:
        parser.error(str(error))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fds = [open_tun(name) for name in args.names]
    print("ready", flush=True)
    serve(fds, rate, delay)


if __name__ == "__main__":
    main()
