"""Every data-parallel layout computes what one process computes (DESIGN.md, correctness contract).

Multi-rank runs go through the real ``meshtrain train`` CLI (torchrun engine, gloo, CPU); the
reference runs in this process on one rank. fp32, same seed, same global batch and data order:
losses of every step and the final parameters agree within 1e-5 relative.
"""

from __future__ import annotations

import pytest

from conftest import (CONFIG, assert_close_losses, assert_close_params, final_params, losses, read_records, run_cli,
                      train_cli, train_here)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, micro batch 8, no accumulation: global batch 8."""
    out = tmp_path_factory.mktemp("ref")
    records = train_here(out, **{"batch.micro_batch_size": "8", "batch.gradient_accumulation_steps": "1"})
    return losses(records), final_params(out)


def test_gradient_accumulation_matches_one_big_micro_batch(reference, tmp_path):
    ref_losses, ref_params = reference
    records = train_here(tmp_path, **{"batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"})
    assert_close_losses(losses(records), ref_losses)
    assert_close_params(final_params(tmp_path), ref_params)


@pytest.mark.parametrize("zero_stage,mbs,ga", [(0, 4, 1), (3, 2, 2), (2, 4, 1)],
                         ids=["ddp", "fsdp2-zero3-ga2", "fsdp2-zero2"])
def test_dp2_matches_single_process(reference, tmp_path, zero_stage, mbs, ga):
    ref_losses, ref_params = reference
    records = train_cli(tmp_path, 2, **{"parallel.zero_stage": str(zero_stage), "batch.micro_batch_size": str(mbs),
                                        "batch.gradient_accumulation_steps": str(ga)})
    assert len(losses(records)) == 10
    assert_close_losses(losses(records), ref_losses)
    assert_close_params(final_params(tmp_path), ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,mbs,ga", [(0, 1, 2), (3, 2, 1)], ids=["ddp-ga2", "fsdp2-zero3"])
def test_dp4_matches_single_process(reference, tmp_path, zero_stage, mbs, ga):
    """Four gloo ranks on this 2-core machine (the contract holds up to world_size 8)."""
    ref_losses, ref_params = reference
    records = train_cli(tmp_path, 4, **{"parallel.zero_stage": str(zero_stage), "batch.micro_batch_size": str(mbs),
                                        "batch.gradient_accumulation_steps": str(ga)})
    assert_close_losses(losses(records), ref_losses)
    assert_close_params(final_params(tmp_path), ref_params)


@pytest.mark.slow
def test_main_job_reaches_its_target_val_loss(tmp_path):
    """`make demo`'s run: configs/shakespeare_char.toml on 2 ranks, 2000 steps, val loss <= 1.95 at the end."""
    proc = run_cli("train", str(CONFIG), "--nproc", "2", "--out", str(tmp_path / "run"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [r for r in read_records(tmp_path / "run") if "val_loss" in r]
    assert evals[-1]["step"] == 2000 and evals[-1]["val_loss"] <= 1.95
