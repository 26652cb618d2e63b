"""Hierarchical all-reduce on two simulated nodes: ``torchrun --nnodes 2`` started twice on 127.0.0.1,
two ranks each (dp = 4). The hierarchical run equals the flat one and one process: every step's loss
(1e-5 relative), the step-1 gradients (1e-5 of the norm: the sum is only grouped differently, see
``conftest.assert_close_grads``) and the final parameters. Also the split into node groups and the
byte formula."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, assert_close_grads, check_layout, free_port
from layout_worker import load_result, reference_run

MODEL = {**TINY, "model.n_head": "4", "train.steps": "6", "batch.micro_batch_size": "8"}
LAYOUTS = {"flat": {"batch.micro_batch_size": "2"},
           "hierarchical": {"batch.micro_batch_size": "2", "parallel.hierarchical_allreduce": "true"}}


def launch_two_nodes(root, layouts: dict[str, dict[str, str]]) -> dict[str, tuple]:
    """Train ``layouts`` on 2 nodes x 2 ranks: two torchrun agents meeting at a c10d rendezvous."""
    root.mkdir(parents=True, exist_ok=True)
    spec = [{"out": str(root / name), "overrides": {**MODEL, **o}} for name, o in layouts.items()]
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                               "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                               str(ROOT / "tests/layout_worker.py"), str(root / "spec.json")],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    return {name: load_result(root / name) for name in layouts}


@pytest.mark.slow  # two 2-node launches, ~25 s; tests/test_clusters.py runs it over a real network: `make test-slow` keeps `make test` under 15 min
def test_hierarchical_equals_flat_and_one_process(tmp_path):
    got = launch_two_nodes(tmp_path / "nodes", LAYOUTS)
    want = reference_run(tmp_path / "ref", MODEL)
    check_layout(got["flat"], want, MODEL)
    check_layout(got["hierarchical"], want, MODEL)
    assert_close_grads(got["hierarchical"][1], got["flat"][1])


def test_dp_groups_split_by_node():
    from meshtrain.parallel.hierarchical import split_by_node

    node_of = [0, 0, 0, 0, 1, 1, 1, 1]
    intra, leaders = split_by_node([[0, 2, 4, 6], [1, 3, 5, 7]], node_of)  # two dp groups (tp = 2)
    assert intra == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert leaders == [[0, 4], [1, 5]]


def test_inter_node_bytes():
    from meshtrain.parallel.hierarchical import inter_node_bytes

    S = 1000.0
    assert inter_node_bytes(S, 4, 2, hierarchical=False) == 2 * 2 * 3 / 4 * S  # 2 crossing links of 2(N-1)/N * S
    assert inter_node_bytes(S, 4, 2, hierarchical=True) == 2 * S  # the leaders' ring: 2 links of 2(L-1)/L * S
    assert inter_node_bytes(S, 4, 1, hierarchical=True) == inter_node_bytes(S, 4, 1, hierarchical=False) == 0
