"""Clusters: two hosts over a real network, and jobs submitted to Slurm (``make test-slow``).

Two hosts (:mod:`netns`): two network namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24,
each with its own loopback, hostname and ``/etc/hosts``. One ``meshtrain train --nnodes 2 --node-rank R
--rdzv-endpoint 10.77.0.1:PORT`` per host, 2 ranks each (dp = 4), with ``GLOO_SOCKET_IFNAME`` naming the
hosts' shared interface, as an operator sets it on a cluster. The tests check what the loopback versions
check (``test_hierarchical.py``, ``test_resume.py``) through the real command line:

- the hierarchical all-reduce across the two hosts: every step's loss equals one process's (1e-5
  relative) and so do the final parameters (AdamW's drift bound); the step-1 gradients, which
  ``test_hierarchical.py`` also compares, are not written by ``meshtrain train``;
- a resume across them, from the checkpoint both hosts wrote at step 5: step 6 within 1e-6 of the
  uninterrupted run, later steps within 1e-5;
- DiLoCo with one worker per host over the pair shaped to 100 Mbit/s (``tc tbf``), and again over a link that also
  delays 10 ms each way (``tests/linkem.py``, netem's arithmetic in user space): the loopback run's losses, and at
  least 3x fewer bytes over the link than DDP's (the devices' counters);
- nothing listens beyond the two hosts' addresses: every listening socket seen while the run goes on
  (``ss -ltnp`` in each namespace, polled) is on that host's veth address or its loopback, except
  torchrun's rendezvous store on node 0, which torch binds to every address of that host (inside the
  namespace, just those two); none of the run's processes listens in the machine's own namespace.

Slurm (:mod:`slurm_cluster`): ``scripts/slurm/meshtrain.sbatch`` submitted with ``sbatch --wait`` to a
throw-away cluster on this machine (one node) and on the two hosts (one slurmd each); the run folder
holds every step and the world size.

Without root, iproute2/util-linux or Slurm (or where ``ip netns add`` fails, e.g. in an unprivileged
container) the tests skip and say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (CONFIG, ROOT, TINY, adamw_drift_bound, assert_close_losses, assert_close_params,
                      assert_resumed_losses, final_params, losses, override_args, read_records, train_cli, train_here)
from netns import IFNAME, Host, Unavailable, descendants, link_bytes, listeners, two_hosts
from slurm_cluster import slurm_cluster

pytestmark = pytest.mark.slow

PORT = 29500  # free in a fresh namespace
HIER = {**TINY, "model.n_head": "4", "batch.micro_batch_size": "2", "parallel.hierarchical_allreduce": "true",
        "checkpoint.interval": "5", "checkpoint.keep": "3"}
"""10 steps on 2 hosts x 2 ranks, global batch 8, checkpoints at steps 5 and 10."""


@pytest.fixture(scope="module")
def hosts():
    try:
        with two_hosts(f"mt{os.getpid() % 10000}") as pair:  # unique: other sessions may run this test too
            yield pair
    except Unavailable as e:
        pytest.skip(str(e))


def _env(ifname: str | None = IFNAME) -> dict[str, str]:
    """The launchers' environment: gloo on the hosts' shared interface (one machine: none, the launcher
    picks loopback), ``meshtrain`` of this venv on PATH."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    return {**env, "GLOO_SOCKET_IFNAME": ifname} if ifname else env


def train_two_hosts(pair: list[Host], out: Path, overrides: dict[str, str], log: Path) -> list[tuple]:
    """``meshtrain train`` on both hosts, 2 ranks each, node 0 hosting the rendezvous; returns every
    listening socket seen meanwhile (:func:`netns.listeners`)."""
    nodes = []
    for rank, host in enumerate(pair):
        argv = host.run(sys.executable, "-m", "meshtrain.cli", "train", str(CONFIG), "--nproc", "2", "--nnodes", "2",
                        "--node-rank", str(rank), "--rdzv-endpoint", f"{pair[0].addr}:{PORT}", "--out", str(out),
                        *override_args(overrides))
        with open(f"{log}.node{rank}", "w") as sink:
            nodes.append(subprocess.Popen(argv, env=_env(), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT))
    seen: set[tuple] = set()
    try:
        deadline = time.monotonic() + 600
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            seen |= listeners(pair, descendants({node.pid for node in nodes}))
            time.sleep(0.5)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()  # the launcher; its ranks get SIGTERM when it dies (faults.die_with_parent)
                node.wait()
    for rank, node in enumerate(nodes):
        assert node.returncode == 0, Path(f"{log}.node{rank}").read_text()[-4000:]
    return sorted(seen)


@pytest.fixture(scope="module")
def across(hosts, tmp_path_factory):
    """The hierarchical run on the two hosts: (run folder, losses, listeners seen)."""
    out = tmp_path_factory.mktemp("two-hosts") / "run"
    seen = train_two_hosts(hosts, out, HIER, out.parent / "log")
    return out, losses(read_records(out)), seen


def test_hierarchical_allreduce_across_two_hosts_equals_one_process(across, tmp_path):
    out, got, _ = across
    one = {**HIER, "batch.micro_batch_size": "8", "parallel.hierarchical_allreduce": "false"}
    want = losses(train_here(tmp_path, **one))
    assert sorted(got) == list(range(1, 11))
    assert_close_losses(got, want)
    assert_close_params(final_params(out), final_params(tmp_path), atol=adamw_drift_bound(one))
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4


def test_nothing_listens_beyond_the_two_hosts(across, hosts):
    """gloo listens on the veth address (``GLOO_SOCKET_IFNAME``); the one wildcard is torchrun's rendezvous
    store on node 0 (``--rdzv-endpoint``'s port, bound by torch on every address of its host)."""
    _, _, seen = across
    assert seen, "no listening socket seen during the run: the poll missed it"
    assert not [s for s in seen if s[0] == "machine"], seen
    for ns, addr, port, process in seen:
        host = next(h for h in hosts if h.ns == ns)
        wildcard = addr in ("0.0.0.0", "*", "[::]") and ns == hosts[0].ns and port == PORT
        assert addr in (host.addr, "127.0.0.1", "[::1]") or wildcard, (ns, addr, port, process)
    for host in hosts:  # the ranks' sockets (gloo) are on the network address, not loopback: a real two-host run
        assert any(ns == host.ns and addr == host.addr for ns, addr, _, _ in seen), (host, seen)


def test_resume_across_two_hosts(across, hosts, tmp_path):
    out, whole, _ = across
    resumed = tmp_path / "resumed"
    train_two_hosts(hosts, resumed, {**HIER, "checkpoint.resume": str(out / "checkpoints" / "step_000005")},
                    tmp_path / "log")
    assert_resumed_losses(losses(read_records(resumed)), {s: whole[s] for s in range(6, 11)})
    assert_close_params(final_params(resumed), final_params(out), atol=adamw_drift_bound(HIER))


@contextlib.contextmanager
def shaped(pair: list[Host], rate: str = "100mbit"):
    """The pair limited to ``rate`` each way (``tc tbf``: a token bucket; netem, which also delays, is not in every
    kernel), as long as the block runs."""
    for host in pair:
        proc = subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf",
                               "rate", rate, "burst", "128kb", "latency", "200ms"], capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"tc cannot shape the link here: {proc.stderr.strip()}")
    try:
        yield
    finally:
        for host in pair:
            subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "del", "dev", IFNAME, "root"],
                           capture_output=True)


DILOCO = {**TINY, "model.n_head": "4", "batch.micro_batch_size": "2", "train.steps": "8", "parallel.sync_mode": "diloco",
          "diloco.inner_steps": "4", "checkpoint.interval": "0"}


def test_diloco_across_two_hosts_over_a_shaped_link(hosts, tmp_path):
    """One DiLoCo worker per host (``diloco_group`` 0 = the host's 2 ranks) over the pair shaped to 100 Mbit/s:
    every step's loss is the same run's on this machine's loopback (4 ranks in groups of 2), and the pair carries
    at least 3x fewer bytes than DDP's run of the same steps on it. Theory: DDP's ring of 4 ranks, 2 per host,
    crosses the pair twice per all-reduce, 1.5 S each (S: the gradients' bytes), 3 S per step; DiLoCo's two
    workers exchange S each way every H = 4 steps, 0.5 S per step: 6x; the per-step scalars (the stop check, the
    loss) are a few hundred bytes."""
    with shaped(hosts):
        diloco_bytes, ddp_bytes = diloco_and_ddp_bytes(hosts, tmp_path)
    check_diloco_against_ddp(tmp_path, diloco_bytes, ddp_bytes)


def diloco_and_ddp_bytes(pair: list[Host], tmp_path: Path) -> tuple[int, int]:
    """:data:`DILOCO` and then the same run as DDP across ``pair``: the bytes the link carried for each."""
    sent = []
    for name, overrides in (("diloco", DILOCO), ("ddp", {k: v for k, v in DILOCO.items()
                                                         if not k.startswith("parallel.")})):
        before = link_bytes(pair)
        train_two_hosts(pair, tmp_path / name, overrides, tmp_path / f"log-{name}")
        sent.append(link_bytes(pair) - before)
    return sent[0], sent[1]


def check_diloco_against_ddp(tmp_path: Path, diloco_bytes: int, ddp_bytes: int) -> None:
    """The two-host DiLoCo run's losses are the loopback run's, it had 2 workers, and the link carried > 3x more for
    DDP (the theory of :func:`test_diloco_across_two_hosts_over_a_shaped_link`)."""
    here = train_cli(tmp_path / "here", 4, **{**DILOCO, "diloco.group": "2"})
    assert_close_losses(losses(read_records(tmp_path / "diloco")), losses(here))
    assert json.loads((tmp_path / "diloco" / "summary.json").read_text())["diloco"]["workers"] == 2
    assert ddp_bytes > 3 * diloco_bytes, (ddp_bytes, diloco_bytes)


def test_diloco_across_two_hosts_over_a_delayed_link(tmp_path):
    """The same over a link with netem's delay too: 100 Mbit/s and 10 ms each way, emulated in user space
    (``tests/linkem.py``, for kernels without netem) between two TUN devices. Gloo's connections, the rendezvous and
    every collective cross a 20 ms round trip; the losses and the byte ratio hold as on the undelayed pair."""
    try:
        with two_hosts(f"md{os.getpid() % 10000}", emulate=("100mbit", "10ms")) as pair:
            diloco_bytes, ddp_bytes = diloco_and_ddp_bytes(pair, tmp_path)
    except Unavailable as e:
        pytest.skip(str(e))
    check_diloco_against_ddp(tmp_path, diloco_bytes, ddp_bytes)


SBATCH = ROOT / "scripts" / "slurm" / "meshtrain.sbatch"
SMALL = {"model.n_layer": "2", "model.n_embd": "32", "model.block_size": "32", "train.steps": "5",
         "train.dtype": "float32", "checkpoint.interval": "0", "train.eval_interval": "0", "train.log_interval": "1"}


def submit(run: list[str], env: dict[str, str], out: Path, nodes: int) -> str:
    """``sbatch --wait`` of the script on ``nodes`` nodes, 2 ranks each (``--ntasks-per-node 2``); returns
    the job's output (the script's line and meshtrain's)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([*run, "sbatch", "--wait", f"--chdir={ROOT}", f"--output={out.parent}/slurm-%j.out",
                           f"--nodes={nodes}", "--ntasks-per-node=2", "--time=10", str(SBATCH), str(CONFIG),
                           "--out", str(out), *override_args(SMALL)],
                          env=env, capture_output=True, text=True, timeout=600)
    log = "".join(p.read_text(errors="replace") for p in out.parent.glob("slurm-*.out"))
    assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{log[-4000:]}"
    return log


def check_run(out: Path, world: int) -> None:
    assert [r["step"] for r in read_records(out) if "loss" in r] == list(range(1, 6))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["dp"]) == (world, world)


def test_sbatch_on_one_node(tmp_path):
    try:
        with slurm_cluster([("localhost", "127.0.0.1", [])], _env(None)) as env:
            log = submit([], env, tmp_path / "job" / "run", nodes=1)
    except Unavailable as e:
        pytest.skip(str(e))
    assert "1 node(s) of localhost" in log and "--nproc 2" in log and "--rdzv-endpoint" not in log
    check_run(tmp_path / "job" / "run", world=2)


def test_sbatch_on_two_hosts(hosts, tmp_path):
    """Two slurmd, one per namespace; the job's launchers meet at the first host's name (its /etc/hosts)."""
    try:
        with slurm_cluster([(h.name, h.addr, h.run()) for h in hosts], _env()) as env:
            log = submit(hosts[0].run(), env, tmp_path / "job" / "run", nodes=2)
    except Unavailable as e:
        pytest.skip(str(e))
    assert f"--nproc 2 --nnodes 2 --rdzv-endpoint {hosts[0].name}:" in log, log[-3000:]
    check_run(tmp_path / "job" / "run", world=4)
