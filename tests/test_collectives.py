"""The planner's per-layer tp/sp collectives are the ones the trainer issues (docs/architecture.md, "Layers").

For tp=2, tp=2 with sequence parallelism, Ulysses sp=2 and ring sp=2, one training step is profiled
with ``torch.profiler`` at 2 and at 4 layers (one torchrun launch, ``tests/collectives_worker.py``);
half the difference is what one layer issues -- embedding, loss, gradient-norm and data-parallel
collectives cancel out (and the data-parallel gradient all-reduce is off in the profiled step, see
the worker). It must equal :func:`meshtrain.planner.cost.layer_collectives` (per micro-batch; one
here) plus :func:`~meshtrain.planner.cost.layer_step_collectives` (per step), call for call and byte
for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ROOT, TINY

BASE = {**TINY, "model.n_head": "4", "batch.micro_batch_size": "4", "train.out_dir": "unused"}
LAYOUTS = {
    "tp2": {"parallel.tp": "2"},
    "tp2-seqpar": {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"},
    # GPT-2's biases: the LayerNorm shifts' partial gradients are summed too (two more all-reduces of h)
    "tp2-seqpar-bias": {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true", "model.bias": "true"},
    "sp2-ulysses": {"parallel.sp": "2"},
    "sp2-ring": {"parallel.sp": "2", "parallel.sp_mode": "ring"},
}
# How gloo (torch 2.13) shows each kind: its record-function name and the input's share of the
# planner's buffer. reduce_scatter_tensor runs as an all-reduce of the whole input in gloo; an
# all-gather's input is one rank's shard; a send-recv pass is one send and one receive.
GLOO = {"all-reduce": [("gloo:all_reduce", 1)], "reduce-scatter": [("gloo:all_reduce", 1)],
        "all-gather": [("gloo:all_gather", "ranks")], "all-to-all": [("gloo:all_to_all", 1)],
        "send-recv": [("gloo:send", 1), ("gloo:recv", 1)]}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("collectives")
    spec = [{"name": f"{name}@{layers}", "overrides": {**BASE, **layout, "model.n_layer": str(layers),
                                                          "train.out_dir": str(root / f"{name}{layers}")}}
            for name, layout in LAYOUTS.items() for layers in (2, 4)]
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "collectives_worker.py"), str(root / "spec.json"),
                           str(root / "counts.json")], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((root / "counts.json").read_text())


def _per_layer(traced: dict, name: str) -> Counter:
    two, four = Counter(traced[f"{name}@2"]), Counter(traced[f"{name}@4"])
    diff = Counter({key: four[key] - two[key] for key in four | two if four[key] != two[key]})
    assert all(v > 0 and v % 2 == 0 for v in diff.values()), diff  # each layer issues the same calls
    return Counter({key: v // 2 for key, v in diff.items()})


def _planned(name: str) -> Counter:
    from meshtrain.config.load import load_config
    from meshtrain.planner.layout import Layout
    from meshtrain.planner.cost import layer_collectives, layer_step_collectives
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(ROOT / "configs" / "shakespeare_char.toml", {**BASE, **LAYOUTS[name]})
    model, layout = from_config(cfg, 65), Layout.from_config(cfg, 2)
    out = Counter()
    precision = PRECISIONS["fp32"]
    for c in layer_collectives(model, layout, precision) + layer_step_collectives(model, layout, precision):
        for gloo_name, share in GLOO[c.kind]:
            numel = c.nbytes / 4 / (c.ranks if share == "ranks" else share)  # fp32: 4 bytes per element
            out[f"{gloo_name} {int(numel)}"] += c.count
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_counts_the_collectives_the_trainer_issues(traced, name):
    assert _per_layer(traced, name) == _planned(name)
