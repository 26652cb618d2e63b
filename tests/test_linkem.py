"""The user-space slow link (``tests/linkem.py``) that stands in for ``tc netem`` on kernels without it.

Its arithmetic, on datagram socket pairs (which keep packet boundaries, as a TUN device does): a packet of n bytes
read at t leaves at max(t, the previous departure) + 8n / rate and arrives its delay later. Then the real link
between two network namespaces (root only): a round trip takes at least twice the delay, and a transfer of N bytes at
least 8N / rate, the bounds netem guarantees.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from linkem import Direction, parse_rate, parse_time  # noqa: E402


def pipes():
    """(the end a host writes into, the end the link reads) for the source; (the end the link writes, the end the
    other host reads) for the destination; non-blocking reads, as the TUN devices are."""
    src_host, src_link = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    dst_link, dst_host = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for end in (src_link, dst_host):
        end.setblocking(False)
    return src_host, src_link, dst_link, dst_host


def test_a_packet_leaves_after_the_ones_before_it_and_arrives_its_delay_later():
    src_host, src_link, dst_link, dst_host = pipes()
    way = Direction(src_link.fileno(), dst_link.fileno(), rate=8000.0, delay=0.5)  # 1,000 bytes/s
    src_host.send(b"a" * 100)
    src_host.send(b"b" * 200)
    way.take(10.0)
    # departures 10 + 0.1 and 10.1 + 0.2; arrivals half a second later
    assert [t for t, _ in way.queue] == pytest.approx([10.6, 10.8], abs=1e-12)
    assert way.deliver(10.59) == pytest.approx(10.6)  # nothing due yet
    with pytest.raises(BlockingIOError):
        dst_host.recv(1000)
    assert way.deliver(10.6) == pytest.approx(10.8)
    assert dst_host.recv(1000) == b"a" * 100
    assert way.deliver(11.0) is None
    assert dst_host.recv(1000) == b"b" * 200
    src_host.send(b"c" * 50)  # after an idle link: sent at once, no credit saved from the idle time
    way.take(20.0)
    assert way.queue[0][0] == pytest.approx(20.0 + 0.05 + 0.5, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(packets=st.lists(st.tuples(st.integers(1, 9000), st.floats(0, 0.05)), min_size=1, max_size=40),
       rate=st.sampled_from([1e6, 1e8, 1e9]), delay=st.sampled_from([0.0, 1e-3, 0.01]))
def test_the_link_never_carries_more_than_its_rate_and_never_sooner_than_its_delay(packets, rate, delay):
    """Packets of any size read at any times (the gaps drawn): in order, each arrives at least its delay plus its own
    serialization after it was read, and between any two packets i <= j the link needed 8 * (bytes of i..j) / rate
    of sending time: arrival_j - delay - read_i >= that."""
    src_host, src_link, dst_link, dst_host = pipes()
    way = Direction(src_link.fileno(), dst_link.fileno(), rate, delay)
    reads, sizes, now = [], [], 0.0
    for size, gap in packets:
        now += gap
        src_host.send(bytes([len(sizes) % 256]) * size)
        way.take(now)
        reads.append(now)
        sizes.append(size)
    arrivals = [t for t, _ in way.queue]
    slack = 1e-9 * (1 + max(arrivals))  # float rounding of the running sum of departures
    assert arrivals == sorted(arrivals)
    for i in range(len(sizes)):
        assert arrivals[i] - reads[i] >= delay + 8 * sizes[i] / rate - slack
        for j in range(i, len(sizes)):
            assert arrivals[j] - delay - reads[i] >= 8 * sum(sizes[i:j + 1]) / rate - slack
    way.deliver(arrivals[-1])
    assert [len(dst_host.recv(9000)) for _ in sizes] == sizes  # every packet, whole, in order


@pytest.mark.parametrize("text, value", [("100mbit", 1e8), ("1gbit", 1e9), ("500kbit", 5e5), ("10mbps", 8e7)])
def test_rates_read_as_tc_writes_them(text, value):
    assert parse_rate(text) == value


@pytest.mark.parametrize("text, value", [("10ms", 0.01), ("1s", 1.0), ("250us", 2.5e-4), ("0ms", 0.0)])
def test_times_read_as_tc_writes_them(text, value):
    assert parse_time(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["fast", "100", "-1mbit", "0mbit", "100 furlongs"])
def test_a_rate_tc_would_not_take_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=f"rate {text!r}"):
        parse_rate(text)


PROBE = textwrap.dedent("""
    import socket, sys, time
    host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for _ in range(100):  # the server on the other host may not listen yet
        try:
            conn = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            time.sleep(0.1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(5):
        start = time.perf_counter()
        conn.sendall(b"p")
        conn.recv(1)
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    conn.sendall(b"x" * nbytes)
    conn.recv(1)  # the server's byte once it has them all
    print(min(rtts), time.perf_counter() - start)
""")
SERVER = textwrap.dedent("""
    import socket, sys
    listener = socket.create_server(("0.0.0.0", int(sys.argv[1])))
    conn, _ = listener.accept()
    for _ in range(5):
        conn.sendall(conn.recv(1))
    left = int(sys.argv[2])
    while left:
        left -= len(conn.recv(min(left, 1 << 20)))
    conn.sendall(b"k")
""")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root")
def test_two_hosts_over_the_emulated_link_see_its_delay_and_rate():
    """10 ms each way and 50 Mbit/s: the shortest of 5 round trips is at least 20 ms, and 2 MB take at least
    2e6 * 8 / 5e7 = 0.32 s (TCP's headers only add to it). These are the link's guarantees, not speeds of this machine."""
    from netns import Unavailable, two_hosts

    nbytes, rate, delay = 2_000_000, 5e7, 0.010
    try:
        hosts = two_hosts(f"le{os.getpid() % 10000}", emulate=("50mbit", "10ms"))
        pair = hosts.__enter__()
    except Unavailable as why:
        pytest.skip(str(why))
    try:
        server = subprocess.Popen(pair[1].run(sys.executable, "-c", SERVER, "5301", str(nbytes)),
                                  stderr=subprocess.PIPE, text=True)
        probe = subprocess.run(pair[0].run(sys.executable, "-c", PROBE, pair[1].addr, "5301", str(nbytes)),
                               capture_output=True, text=True, timeout=120)
        server_error = server.communicate(timeout=60)[1]
    finally:
        hosts.__exit__(None, None, None)
    if probe.returncode and any(why in probe.stderr for why in ("unshare:", "nsenter:", "mount:")):
        pytest.skip(f"a host's process cannot enter its namespaces here: {probe.stderr.strip()[-200:]}")
    assert server.returncode == 0, server_error
    assert probe.returncode == 0, probe.stderr
    rtt, transfer = map(float, probe.stdout.split())
    assert rtt >= 2 * delay
    assert transfer >= nbytes * 8 / rate
