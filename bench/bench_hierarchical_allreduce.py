"""Bytes crossing the node boundary, flat vs hierarchical all-reduce, on two simulated nodes.

    python bench/bench_hierarchical_allreduce.py [--ranks-per-node 2] [--steps 5]     # ~1 min

Two ``torchrun --nnodes 2`` agents on 127.0.0.1 (a c10d rendezvous), each starting R ranks: dp = 2R
data-parallel replicas of the main job's GPT (``configs/shakespeare_char.toml``, DDP). Each rank runs
``--steps`` forward/backward passes with the gradient sync of the layout (the trainer's own
``Trainer.forward_backward``), once with ``parallel.hierarchical_allreduce = false`` and once true.

Bytes are counted by the kernel: before and after the measured passes global rank 0 reads every TCP
socket of the machine (``ss -tinp``: owning process and ``bytes_sent``), pairs the two ends of each
connection by port, and sums the bytes sent on connections whose two processes sit on different
"nodes" (torchrun's ``GROUP_RANK`` of each rank's process). The same count over a stretch with only
the barriers that bracket the measurement is subtracted. Also reported: the ring formula of
``meshtrain.parallel.hierarchical.inter_node_bytes`` for the gradient bytes, and the seconds per pass.
Writes ``bench/results/hierarchical_allreduce.md``/``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_results  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"
SOCKET = re.compile(r"(\S+):(\d+)\s+(\S+):(\d+)\s+users:\(\(\"[^\"]*\",pid=(\d+)")


def socket_bytes() -> dict[tuple[int, int], tuple[int, int]]:
    """{(local port, peer port): (pid, bytes_sent)} of every established TCP socket on 127.0.0.1."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True).stdout
    found, last = {}, None
    for line in out.splitlines():
        m = SOCKET.search(line)
        if m:
            last = (int(m.group(2)), int(m.group(4))), int(m.group(5))
            found[last[0]] = (last[1], 0)
        elif last is not None:
            sent = re.search(r"bytes_sent:(\d+)", line)
            found[last[0]] = (last[1], int(sent.group(1)) if sent else 0)
            last = None
    return found


def cross_node_bytes(before: dict, after: dict, node_of_pid: dict[int, int]) -> int:
    """Bytes sent between the snapshots on connections joining processes of different nodes."""
    pid_of_port = {local: pid for (local, _), (pid, _) in after.items()}
    total = 0
    for (local, peer), (pid, sent) in after.items():
        peer_pid = pid_of_port.get(peer)
        if pid in node_of_pid and peer_pid in node_of_pid and node_of_pid[pid] != node_of_pid[peer_pid]:
            total += sent - before.get((local, peer), (pid, 0))[1]
    return total


def worker(spec: dict) -> None:
    """One rank: measure the bytes and time of ``steps`` gradient syncs of one layout (rank 0 writes).
    One layout per launch: sockets of an earlier layout's groups would close (and their ports be
    reused) in the middle of a later measurement."""
    import torch.distributed as dist

    from meshtrain.config.load import load_config
    from meshtrain.train.loop import Trainer

    results = {}
    for name, hierarchical in ((spec["mode"], spec["mode"] == "hierarchical"),):
        cfg = load_config(CONFIG, {"parallel.hierarchical_allreduce": str(hierarchical).lower(),
                                   "train.out_dir": spec["out"] + "/" + name})
        trainer = Trainer(cfg)
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, (os.getpid(), int(os.environ["GROUP_RANK"])))
        node_of_pid = dict(nodes)
        trainer.forward_backward(trainer.sampler.next_step())  # connections and buckets set up
        counts = {}
        for phase, passes in (("barriers", 0), ("syncs", spec["steps"])):
            dist.barrier()
            before = socket_bytes() if dist.get_rank() == 0 else None
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(passes):
                trainer.forward_backward(trainer.sampler.next_step())
            seconds = time.perf_counter() - t0
            dist.barrier()
            if dist.get_rank() == 0:
                counts[phase] = cross_node_bytes(before, socket_bytes(), node_of_pid)
            dist.barrier()
        if dist.get_rank() == 0:
            grads = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
            results[name] = {"bytes_per_sync": (counts["syncs"] - counts["barriers"]) / spec["steps"],
                             "seconds_per_pass": seconds / spec["steps"], "gradient_bytes": grads}
        del trainer
    if dist.get_rank() == 0:
        Path(spec["out"], "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks_per_node: int, steps: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="meshtrain-hier-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"out": tmp, "steps": steps, "mode": mode}))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        port = 29400 + os.getpid() % 1000
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                                   f"--nproc-per-node={ranks_per_node}", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint=127.0.0.1:{port}", __file__, "--worker", str(spec)],
                                  env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in range(2)]
        for node in nodes:
            _, err = node.communicate(timeout=900)
            if node.returncode:
                raise SystemExit(err[-3000:])
        return json.loads((Path(tmp) / "result.json").read_text())


def main() -> None:
    from meshtrain.parallel.hierarchical import inter_node_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-node", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    rows, data = [], []
    for per_node in args.ranks_per_node:
        result = {mode: measure(per_node, args.steps, mode)[mode] for mode in ("flat", "hierarchical")}
        ranks = 2 * per_node
        for name, r in result.items():
            formula = inter_node_bytes(r["gradient_bytes"], ranks, 2, name == "hierarchical")
            rows.append([f"2 x {per_node}", name, f"{r['gradient_bytes'] / 2**20:.2f}",
                         f"{r['bytes_per_sync'] / 2**20:.2f}", f"{formula / 2**20:.2f}",
                         f"{r['bytes_per_sync'] / r['gradient_bytes']:.2f}", f"{r['seconds_per_pass'] * 1e3:.0f}"])
            data.append({"nodes": 2, "ranks_per_node": per_node, "mode": name, **r, "ring_formula_bytes": formula})
    notes = ["Two nodes simulated on one machine: every byte goes through the loopback device, so the times "
             "show the extra steps of the hierarchical scheme, not a slow network. The bytes are what would "
             "cross a real node boundary.",
             "gloo picks its own all-reduce algorithm for the flat case (not necessarily a ring), which is "
             "why the measured flat bytes may differ from the ring formula.",
             f"Command: python bench/bench_hierarchical_allreduce.py --ranks-per-node "
             f"{' '.join(map(str, args.ranks_per_node))} --steps {args.steps}"]
    path = write_results("hierarchical_allreduce", "Flat vs hierarchical gradient all-reduce: bytes between nodes",
                         ["nodes x ranks", "all-reduce", "gradient MiB", "measured MiB crossing nodes / sync",
                          "ring formula MiB", "measured / gradient", "ms per pass"], rows, notes, {"runs": data})
    print(path.read_text())


if __name__ == "__main__":
    main()
