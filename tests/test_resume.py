"""Resume continues exactly: train 10 steps with a checkpoint at 5, resume from 5, compare steps 6-10,
also at another layout (DCP reshards). Pairs (saved -> resumed), all at global batch 8:

- here: one rank -> dp=2 DDP, one rank -> dp=2 ZeRO-1 and FSDP2 (zero 0 -> 1, 0 -> 3), ZeRO-1 dp=2 -> one
  rank (zero 1 -> 0), dp=2 -> tp=2, dp=2 -> sp=2;
  ``test_pipeline.py``: pp=2 -> pp=1, dp=2 -> pp=2 (interleaved);
- ``make test-slow``: sp=2 -> dp=2, FSDP2 dp=2 -> one rank (zero 3 -> 0), dp=4 -> dp=2 x tp=2,
  tp=2 -> FSDP2 dp=2, ZeRO-1 dp=2 -> FSDP2 dp=2, each from a run of its own saved layout.

The first resumed step's loss is within 1e-6 of the uninterrupted run's, later steps within 1e-5
(:func:`conftest.assert_resumed_losses`)."""

from __future__ import annotations

import pytest

from conftest import (CONFIG, TINY, adamw_drift_bound, assert_close_params, assert_resumed_losses, final_params,
                      losses, override_args, read_records, run_cli, train_cli, train_here)

GLOBAL8 = {"batch.micro_batch_size": "8", "checkpoint.interval": "5", "checkpoint.keep": "3"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    records = train_here(out, **GLOBAL8)
    return out, losses(records), final_params(out)


def test_resume_same_layout_is_exact(uninterrupted, tmp_path):
    full_dir, full_losses, full_params = uninterrupted
    records = train_here(tmp_path, **GLOBAL8, **{"checkpoint.resume": str(full_dir / "checkpoints" / "step_000005")})
    got = losses(records)
    assert sorted(got) == list(range(6, 11))
    assert got == {s: full_losses[s] for s in range(6, 11)}  # same process, same layout: bit-exact
    assert_close_params(final_params(tmp_path), full_params, atol=0)


# ddp and zero1 (~8 s each) in `make test-slow`: the resharding cases below resume ZeRO-1 and DDP checkpoints
@pytest.mark.parametrize("zero_stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(1, marks=pytest.mark.slow),
                                        3], ids=["ddp", "zero1", "fsdp2"])
def test_resume_on_two_ranks_from_one_rank_checkpoint(uninterrupted, tmp_path, zero_stage):
    full_dir, full_losses, full_params = uninterrupted
    records = train_cli(tmp_path, 2, **{"batch.micro_batch_size": "4", "parallel.zero_stage": str(zero_stage),
                                        "checkpoint.interval": "5",
                                        "checkpoint.resume": str(full_dir / "checkpoints" / "step_000005")})
    assert_resumed_losses(losses(records), {s: full_losses[s] for s in range(6, 11)})
    assert_close_params(final_params(tmp_path), full_params, atol=adamw_drift_bound(GLOBAL8))


@pytest.mark.slow  # a 2-rank CLI run and a resume, 16-26 s: `make test` stays under 15 min on AVX2-only machines
def test_resume_zero1_checkpoint_on_one_rank(tmp_path):
    """A zero_stage 1 checkpoint (each rank held half the AdamW states) holds the whole state: one rank
    at zero_stage 0 continues the run."""
    saved = losses(train_cli(tmp_path / "saved", 2, **{**GLOBAL8, "batch.micro_batch_size": "4",
                                                       "parallel.zero_stage": "1"}))
    records = train_here(tmp_path / "resumed", **GLOBAL8, **{
        "checkpoint.resume": str(tmp_path / "saved" / "checkpoints" / "step_000005")})
    assert_resumed_losses(losses(records), {s: saved[s] for s in range(6, 11)})


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """dp=2 (DDP, micro batch 4), 10 steps, checkpoints at 5 and 10."""
    out = tmp_path_factory.mktemp("dp2")
    records = train_cli(out, 2, **{**GLOBAL8, "batch.micro_batch_size": "4"})
    return out, losses(records)


@pytest.mark.parametrize("layout", [{"parallel.tp": "2"}, {"parallel.sp": "2", "parallel.sp_mode": "ring"}],
                         ids=["tp2", "sp2-ring"])
def test_resume_dp2_checkpoint_at_tp2_and_sp2(dp2_run, tmp_path, layout):
    """The dp=2 checkpoint (plain tensors) loads into DTensor tp shards / sp replicas and continues the run."""
    dp2_dir, dp2_losses = dp2_run
    records = train_cli(tmp_path, 2, **{**GLOBAL8, **layout,
                                        "checkpoint.resume": str(dp2_dir / "checkpoints" / "step_000005")})
    assert_resumed_losses(losses(records), {s: dp2_losses[s] for s in range(6, 11)})


def test_resume_into_same_folder_keeps_one_consistent_history(tmp_path):
    """--resume without a path continues the run in --out; metrics.jsonl then holds steps 1..7 once each."""
    first = train_here(tmp_path, **GLOBAL8, **{"train.steps": "5"})
    assert max(losses(first)) == 5
    args = override_args({**TINY, **GLOBAL8, "train.steps": "7"})
    proc = run_cli("train", str(CONFIG), "--nproc", "1", "--out", str(tmp_path), "--resume", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_records(tmp_path) if "loss" in r] == list(range(1, 8))


def _global8(layout: dict[str, str], nproc: int) -> dict[str, str]:
    """``layout`` on ``nproc`` ranks at global batch 8: micro-batch 8 / dp."""
    ranks_per_sample = int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.sp", 1))
    return {**GLOBAL8, **layout, "batch.micro_batch_size": str(8 * ranks_per_sample // nproc)}


RESHARD = [  # (saved layout, its ranks, resumed layout, its ranks)
    ({"parallel.sp": "2", "parallel.sp_mode": "ring"}, 2, {}, 2),
    ({"parallel.zero_stage": "3"}, 2, {}, 1),
    ({}, 4, {"parallel.tp": "2"}, 4),
    ({"parallel.tp": "2"}, 2, {"parallel.zero_stage": "3"}, 2),
    ({"parallel.zero_stage": "1"}, 2, {"parallel.zero_stage": "3"}, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("saved,saved_ranks,resumed,resumed_ranks", RESHARD,
                         ids=["sp2-to-dp2", "fsdp2-dp2-to-1", "dp4-to-dp2xtp2", "tp2-to-fsdp2-dp2",
                              "zero1-dp2-to-fsdp2-dp2"])
def test_reshard_matrix(tmp_path, saved, saved_ranks, resumed, resumed_ranks):
    full = losses(train_cli(tmp_path / "saved", saved_ranks, **_global8(saved, saved_ranks)))
    records = train_cli(tmp_path / "resumed", resumed_ranks, **_global8(resumed, resumed_ranks), **{
        "checkpoint.resume": str(tmp_path / "saved" / "checkpoints" / "step_000005")})
    assert_resumed_losses(losses(records), {s: full[s] for s in range(6, 11)})
