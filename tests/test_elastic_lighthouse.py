"""An elastic DiLoCo worker's lighthouse is checked before any rank starts (``preflight.check_lighthouse``), on 127.0.0.1:

- nothing listening at the address: one line within a bounded time (the check's own wait plus start-up), exit 2;
- an ordinary HTTP server (not a lighthouse) answering there: one line saying it is not a lighthouse, exit 2;
- a lighthouse that already hears a running worker with this job's ``diloco.worker``: the job is refused
  in one line (two jobs of one index would read the same data share, and no job the other one's); another index
  passes the check.

Each refusal writes nothing: the output folder is never created.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest

from conftest import CONFIG, TINY, cli_here, free_port, override_args
from elastic_jobs import Lighthouse

ELASTIC = {**TINY, "parallel.sync_mode": "diloco", "diloco.group": "1", "diloco.inner_steps": "2",
           "train.steps": "4", "diloco.workers": "2"}


def started(lighthouse: Lighthouse) -> Lighthouse:
    """``lighthouse`` once its port accepts connections (torchft's client would otherwise wait out its connect
    timeout)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", lighthouse.port), timeout=1).close()
            return lighthouse
        except OSError:
            assert time.monotonic() < deadline and lighthouse.proc.poll() is None
            time.sleep(0.05)


def refused(url: str, tmp_path, worker: int = 0) -> tuple[str, float]:
    """``meshtrain train`` as worker ``worker`` of 2 at lighthouse ``url``: its one stderr line, and its duration."""
    out = tmp_path / "out"
    start = time.monotonic()
    proc = cli_here("train", str(CONFIG), "--nproc", "1",
                    *override_args({**ELASTIC, "diloco.lighthouse": url, "diloco.worker": str(worker),
                                    "train.out_dir": str(out)}), timeout=120)
    took = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()
    return lines[0], took


def test_nothing_listening_is_said_in_one_line_within_a_bounded_time(tmp_path):
    from meshtrain.preflight import LIGHTHOUSE_WAIT_S

    url = f"http://127.0.0.1:{free_port()}"
    line, took = refused(url, tmp_path)
    assert f"diloco.lighthouse = '{url}': nothing answers there" in line and "torchft_lighthouse" in line
    assert took < LIGHTHOUSE_WAIT_S + 30  # the check's wait plus the interpreter's start-up, not torchft's 200 s


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_an_http_server_that_is_not_a_lighthouse_is_said_in_one_line(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        line, _ = refused(url, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert "something answers there, but not a torchft lighthouse (HTTP 404 for /status)" in line, line


def test_a_second_job_claiming_a_running_workers_index_is_refused(tmp_path):
    """A running worker 0 is what its torchft manager does: heartbeats to the lighthouse under ``worker0:<uuid>``
    every 0.1 s (sent here by torchft's own client, for the length of the test)."""
    torchft = pytest.importorskip("torchft._torchft")
    lighthouse = started(Lighthouse(min_replicas=2))
    stop = threading.Event()

    def beat() -> None:
        client, replica = None, f"worker0:{uuid.uuid4()}"
        while not stop.is_set():
            try:
                client = client or torchft.LighthouseClient(lighthouse.url, timedelta(seconds=5))
                client.heartbeat(replica)
            except Exception:  # the lighthouse may still be binding its port
                client = None
            stop.wait(0.1)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        line, _ = refused(lighthouse.url, tmp_path)
    finally:
        stop.set()
        beater.join()
        lighthouse.close()
    assert line.startswith("meshtrain train: error: diloco.worker = 0 is taken: the lighthouse at "
                           f"{lighthouse.url} hears a running worker 0"), line
    assert "another index in [0, 2)" in line


def test_the_check_passes_a_free_index_at_a_lighthouse():
    """The same lighthouse and heartbeat, checked in this process: worker 1 is free."""
    torchft = pytest.importorskip("torchft._torchft")
    from meshtrain.errors import ConfigError
    from meshtrain.preflight import check_lighthouse

    lighthouse = started(Lighthouse(min_replicas=2))
    try:
        torchft.LighthouseClient(lighthouse.url, timedelta(seconds=5)).heartbeat("worker0:abc")
        check_lighthouse(lighthouse.url, 1, 2)
        with pytest.raises(ConfigError, match="diloco.worker = 0 is taken"):
            check_lighthouse(lighthouse.url, 0, 2)
    finally:
        lighthouse.close()
