"""Pipeline parallelism computes what one process computes (DESIGN.md, correctness contract).

Every schedule at pp=2 and pp=4, and pp composed with dp (DDP, FSDP2), tp, dp x tp and sp, against
one process on the same 8-layer model, global batch (8 samples of 32 tokens) and data order:
the loss of every step (1e-5 relative), the step-1 gradients of every parameter gathered from all
stages (1e-5 of the gradient norm; the tied embedding's gradient is the sum over its two copies),
and the final parameters read back from the pipelined run's checkpoint (AdamW's drift bound).
Tolerances are derived in ``conftest.py``. Also: the split, the trace, and bad configs.
"""

from __future__ import annotations

import json

import pytest

from conftest import CONFIG, TINY, check_layout, override_args, run_cli
from layout_worker import launch_layouts, reference_run

# 8 layers so that pp=4 with 2 chunks per rank has a block per chunk; 4 micro-batches so that every
# schedule runs at pp=2 and pp=4 (1F1B needs >= pp, interleaved a multiple of pp).
MODEL = {**TINY, "model.n_layer": "8", "model.n_head": "4", "train.steps": "6", "batch.micro_batch_size": "2",
         "batch.gradient_accumulation_steps": "4"}
SCHEDULES = {"naive": "1", "gpipe": "1", "1f1b": "1", "interleaved-1f1b": "2", "zero-bubble": "2", "zbv": "2"}
LAYOUTS: dict[str, tuple[int, dict[str, str]]] = {
    **{f"pp{pp}-{s}": (pp, {"parallel.pp": str(pp), "parallel.pp_schedule": s, "parallel.virtual_stages": v})
       for pp in (2, 4) for s, v in SCHEDULES.items()},
    "pp2-dp2-ddp": (4, {"parallel.pp": "2", "batch.micro_batch_size": "1"}),
    "pp2-dp2-fsdp2": (4, {"parallel.pp": "2", "parallel.zero_stage": "3", "batch.micro_batch_size": "1",
                          "parallel.pp_schedule": "interleaved-1f1b", "parallel.virtual_stages": "2"}),
    "pp2-tp2-seqpar": (4, {"parallel.pp": "2", "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "pp2-sp2-ring": (4, {"parallel.pp": "2", "parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "pp2-dp2-tp2": (8, {"parallel.pp": "2", "parallel.tp": "2", "batch.micro_batch_size": "1"}),
}
REFERENCE = {"batch.micro_batch_size": "8", "batch.gradient_accumulation_steps": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("ref"), {**MODEL, **REFERENCE})


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(world: int) -> dict[str, tuple]:
        if world not in cache:
            cache[world] = launch_layouts(world, tmp_path_factory.mktemp(f"pp-world{world}"),
                                          {n: {**MODEL, **o} for n, (w, o) in LAYOUTS.items() if w == world})
        return cache[world]
    return get


@pytest.mark.parametrize("name", [n for n, (w, _) in LAYOUTS.items() if w <= 4])
def test_pipeline_layout_matches_single_process(reference, launched, name):
    check_layout(launched(LAYOUTS[name][0])[name], reference, MODEL)


@pytest.mark.slow
def test_pp2_dp2_tp2_matches_single_process(reference, launched):
    """Eight gloo ranks on this 2-core machine."""
    check_layout(launched(8)["pp2-dp2-tp2"], reference, MODEL)
