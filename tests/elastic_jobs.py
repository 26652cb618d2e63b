"""Elastic DiLoCo worker jobs on this machine, for tests/test_elastic.py and bench/bench_elastic.py: torchft's
lighthouse on 127.0.0.1, one ``meshtrain train`` job per worker, and the rank process under a job's launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE = Path(sys.executable).with_name("torchft_lighthouse")


class Lighthouse:
    """``torchft_lighthouse`` on 127.0.0.1: a quorum needs ``min_replicas`` workers; a worker silent for
    ``heartbeat_ms`` has left (torchft's default 5,000)."""

    def __init__(self, min_replicas: int, heartbeat_ms: int = 5000) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind",
                                      f"127.0.0.1:{self.port}", "--heartbeat_timeout_ms", str(heartbeat_ms)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_worker(config: Path | str, lighthouse: Lighthouse, worker: int, workers: int, out: Path,
                 overrides: dict[str, str], *extra: str, ranks: int = 1) -> subprocess.Popen:
    """``meshtrain train CONFIG`` as worker ``worker`` of ``workers`` on ``ranks`` ranks (dp inside), output in ``out``,
    its console in ``out``.log; ``extra``: more launcher flags (``--max-restarts 1``)."""
    args = {**overrides, "parallel.sync_mode": "diloco", "diloco.lighthouse": lighthouse.url,
            "diloco.workers": str(workers), "diloco.worker": str(worker),
            "diloco.group": str(ranks), "train.out_dir": str(out)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", "meshtrain.cli", "train", str(config), "--nproc", str(ranks),
                                 *extra, *[tok for k, v in args.items() for tok in (f"--{k}", str(v))]],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def rank_pid(launcher: int) -> int | None:
    """The pid of the rank (``python -m meshtrain.train``) under ``launcher``, or None while there is none."""
    pending = [launcher]
    while pending:
        pid = pending.pop()
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"meshtrain.train" in cmdline:
            return pid
        pending += map(int, children)
    return None


def logged_steps(out: Path) -> list[int]:
    """The training steps a worker has logged so far (none before its metrics file exists)."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in records if "loss" in r]
