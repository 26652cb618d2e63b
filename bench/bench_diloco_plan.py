"""The planner's DiLoCo against DDP and the hierarchical all-reduce, by inter-node bandwidth.

    python bench/bench_diloco_plan.py        # ~1 s

GPT-2 XL (1.6 B), 4 nodes x 8 H100 (one worker per node for DiLoCo), global batch 512 of 1,024 tokens, bf16; each
mode's fastest fitting layout (``--fix``-style pins: tp = pp = sp = 1; zero_stage 3 inside a node for DiLoCo, 0 for
the hierarchical all-reduce; the search's choice of zero stage, micro-batch and recompute otherwise), its predicted step time and the share of it spent on exposed
data-parallel communication, with the nodes' links from 400 Gbit/s (InfiniBand NDR per GPU) down to 1 Gbit/s
shared by the node (a data-centre-to-data-centre link). Writes ``bench/results/diloco_plan.md``/``.json``.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from meshtrain.planner.estimate import Job  # noqa: E402
from meshtrain.planner.hardware import get_hardware  # noqa: E402
from meshtrain.planner.layout import FRAMEWORKS  # noqa: E402
from meshtrain.planner.memory import PRECISIONS  # noqa: E402
from meshtrain.planner.model_specs import preset  # noqa: E402
from meshtrain.planner.search import search  # noqa: E402

NODES, PER_NODE, BATCH, MODEL = 4, 8, 512, "gpt2-xl"
LINKS = {  # name: (bytes/s per NIC, NICs per node)
    "8 x 400 Gbit/s (IB NDR, one NIC per GPU)": (400e9 / 8, 8),
    "1 x 100 Gbit/s per node": (100e9 / 8, 1),
    "1 x 10 Gbit/s per node": (10e9 / 8, 1),
    "1 x 1 Gbit/s per node": (1e9 / 8, 1),
}
DILOCO = {"diloco_group": PER_NODE, "zero_stage": 3}
MODES = {
    "DDP / FSDP (best synchronous)": {},
    "DDP, hierarchical all-reduce": {"hierarchical_allreduce": True, "zero_stage": 0},
    "DiLoCo H=32": {**DILOCO, "diloco_inner_steps": 32},
    "DiLoCo H=128": {**DILOCO, "diloco_inner_steps": 128},
    "DiLoCo H=128 int8": {**DILOCO, "diloco_inner_steps": 128, "diloco_precision": "int8"},
    "Streaming DiLoCo H=128 F=4 tau=2": {**DILOCO, "diloco_inner_steps": 128, "diloco_fragments": 4,
                                          "diloco_delay": 2},
}


def main() -> None:
    model, prec, fw = preset(MODEL), PRECISIONS["bf16"], FRAMEWORKS["meshtrain"]
    base = get_hardware("H100-SXM-80GB")
    job = Job(num_devices=NODES * PER_NODE, global_batch_size=BATCH)
    rows, data = [], []
    for link, (nic, nics) in LINKS.items():
        hw = replace(base, network=replace(base.network, inter_node_bandwidth=nic, nics_per_node=nics))
        for mode, fixed in MODES.items():
            found = [e for e in search(model, hw, prec, fw, job, {"tp": 1, "pp": 1, "sp": 1, **fixed}) if e.fits]
            if not found:
                rows.append([link, mode, "-", "does not fit", "-", "-"])
                continue
            best = found[0]
            share = best.time.dp_comm / best.time.total
            rows.append([link, mode, best.layout.label(), f"{best.time.total:.2f}", f"{share:.0%}",
                         f"{best.memory.total / 2**30:.1f}"])
            data.append({"link": link, "mode": mode, "layout": best.layout.to_dict(), "step_time_s": best.time.total,
                         "dp_comm_s": best.time.dp_comm, "memory_bytes": best.memory.total})
    notes = [f"{NODES} nodes x {PER_NODE} H100-SXM-80GB, {model.name} at {model.seq_len:,} tokens, global batch {BATCH} "
             "per (inner) step, bf16, meshtrain's cost model (docs/planner.md); tp = pp = sp = 1 pinned so that only "
             "data parallelism differs.",
             "DiLoCo: one worker per node, FSDP (zero_stage 3) inside it; its exchange every H steps over the nodes' "
             "link, each rank its shard (cost.diloco_time). The quality per step DiLoCo may cost is not in these "
             "numbers (docs/strategies.md, DiLoCo, measures it on a small model).",
             "Command: python bench/bench_diloco_plan.py"]
    path = write_results("diloco_plan", "Planned step time of DiLoCo vs DDP by inter-node link",
                         ["nodes' link", "mode", "fastest layout", "s/step", "dp comm share", "GiB/device"],
                         rows, notes, {"rows": data})
    print(path.read_text())


if __name__ == "__main__":
    main()
