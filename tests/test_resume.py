"""Resume continues exactly: train 10 steps with a checkpoint at 5, resume from 5, compare steps 6-10,
also at another layout (DCP reshards). Pairs (saved -> resumed), all at global batch 8:

- here: one rank -> one rank (bit-exact), one rank -> FSDP2 dp=2 (zero 0 -> 3), dp=2 -> tp=2, dp=2 -> ring sp=2;
  the 2-rank runs share one torchrun launch (tests/layout_worker.py, in order: the dp=2 run, then the resumes),
  and the launcher's checks (:func:`meshtrain.preflight.preflight`) accept each resume; one rank resumed by
  ``meshtrain train --resume`` into its own folder;
  ``test_pipeline.py``: pp=2 -> pp=1, dp=2 -> pp=2 (interleaved);
- ``make test-slow``: one rank -> dp=2 DDP and ZeRO-1 through ``meshtrain train`` (zero 0 -> 0, 0 -> 1), ZeRO-1
  dp=2 -> one rank (zero 1 -> 0); sp=2 -> dp=2, FSDP2 dp=2 -> one rank (zero 3 -> 0),
  dp=4 -> dp=2 x tp=2, tp=2 -> FSDP2 dp=2, ZeRO-1 dp=2 -> FSDP2 dp=2, each from a run of its own saved layout.

The first resumed step's loss is within 1e-6 of the uninterrupted run's, later steps within 1e-5
(:func:`conftest.assert_resumed_losses`). The runs resumed from the uninterrupted one, and those from the dp=2 one,
train on the first 50,000 characters of the bundled Tiny Shakespeare (:func:`text`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import (CONFIG, TINY, adamw_drift_bound, assert_close_params, assert_resumed_losses, final_params,
                      losses, override_args, read_records, launch_here, train_cli, train_here)
from layout_worker import launch_layouts
from test_train_parallel import shakespeare_prefix

GLOBAL8 = {"batch.micro_batch_size": "8", "checkpoint.interval": "5", "checkpoint.keep": "3"}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> dict[str, str]:
    """The override that trains on a prefix of the bundled text (:func:`test_train_parallel.shakespeare_prefix`: each
    trainer tokenizes all of its text, on every rank); a resume must read the text its checkpoint was trained on."""
    return shakespeare_prefix(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def uninterrupted(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    records = train_here(out, **GLOBAL8, **text)
    return out, losses(records), final_params(out)


def test_resume_same_layout_is_exact(uninterrupted, text, tmp_path):
    full_dir, full_losses, full_params = uninterrupted
    records = train_here(tmp_path, **GLOBAL8, **text,
                         **{"checkpoint.resume": str(full_dir / "checkpoints" / "step_000005")})
    got = losses(records)
    assert sorted(got) == list(range(6, 11))
    assert got == {s: full_losses[s] for s in range(6, 11)}  # same process, same layout: bit-exact
    assert_close_params(final_params(tmp_path), full_params, atol=0)


STEP5 = ("checkpoints", "step_000005")
RESUMED = {  # name: (the run whose step-5 checkpoint it resumes, its overrides); on 2 ranks, global batch 8
    "fsdp2-from-one-rank": ("uninterrupted", {"batch.micro_batch_size": "4", "parallel.zero_stage": "3",
                                              "checkpoint.interval": "5"}),
    "tp2-from-dp2": ("dp2", {**GLOBAL8, "parallel.tp": "2"}),
    "sp2-ring-from-dp2": ("dp2", {**GLOBAL8, "parallel.sp": "2", "parallel.sp_mode": "ring"}),
}


def _resume_overrides(name: str, saved: dict[str, Path], text: dict[str, str]) -> dict[str, str]:
    source, overrides = RESUMED[name]
    return {**TINY, **overrides, **text, "checkpoint.resume": str(saved[source].joinpath(*STEP5))}


@pytest.fixture(scope="module")
def two_ranks(uninterrupted, text, tmp_path_factory) -> Path:
    """One torchrun launch of 2 ranks (a launch costs seconds of process starts on 2 cores), in order: dp=2 (DDP,
    micro batch 4), 10 steps, checkpoints at 5 and 10; then each run of :data:`RESUMED` from its step-5 checkpoint
    (the one-rank run's, or the dp=2 run's just written). Each run in its folder ``root/NAME``."""
    root = tmp_path_factory.mktemp("two_ranks")
    saved = {"uninterrupted": uninterrupted[0], "dp2": root / "dp2"}
    layouts = {"dp2": {**TINY, **GLOBAL8, **text, "batch.micro_batch_size": "4"},
               **{name: _resume_overrides(name, saved, text) for name in RESUMED}}
    launch_layouts(2, root, layouts, results=False)
    return root


def test_the_launcher_accepts_each_resume_at_its_layout(uninterrupted, two_ranks, text, tmp_path):
    """`meshtrain train`'s checks before launch (the checkpoint verified and continuable at the new layout: same
    model, global batch and data) pass for every resume of :data:`RESUMED`, as they must for the CLI to start it."""
    from meshtrain.config.load import load_config
    from meshtrain.preflight import preflight
    from meshtrain.resolved import ResolvedRun

    saved = {"uninterrupted": uninterrupted[0], "dp2": two_ranks / "dp2"}
    for name in RESUMED:
        overrides = {**_resume_overrides(name, saved, text), "train.out_dir": str(tmp_path / name)}
        preflight(ResolvedRun.resolve(load_config(CONFIG, overrides), 2))


def test_resume_on_two_ranks_from_one_rank_checkpoint(uninterrupted, two_ranks):
    """FSDP2 (zero_stage 3) at dp=2 continues the one-rank run: each rank loads its shard of the whole tensors."""
    full_dir, full_losses, full_params = uninterrupted
    out = two_ranks / "fsdp2-from-one-rank"
    assert_resumed_losses(losses(read_records(out)), {s: full_losses[s] for s in range(6, 11)})
    assert_close_params(final_params(out), full_params, atol=adamw_drift_bound(GLOBAL8))


# ddp and zero1 (~8 s each) in `make test-slow`, each through `meshtrain train`: the FSDP2 case above resumes the
# same one-rank checkpoint on 2 ranks in `make test`, and the dp=2 checkpoint below is a DDP one
@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1], ids=["ddp", "zero1"])
def test_resume_on_two_ranks_from_one_rank_checkpoint_through_the_cli(uninterrupted, text, tmp_path, zero_stage):
    full_dir, full_losses, full_params = uninterrupted
    records = train_cli(tmp_path, 2, **text, **{"batch.micro_batch_size": "4", "parallel.zero_stage": str(zero_stage),
                                                "checkpoint.interval": "5",
                                                "checkpoint.resume": str(full_dir.joinpath(*STEP5))})
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


@pytest.mark.parametrize("name", ["tp2-from-dp2", "sp2-ring-from-dp2"])
def test_resume_dp2_checkpoint_at_tp2_and_sp2(two_ranks, name):
    """The dp=2 checkpoint (plain tensors) loads into DTensor tp shards / sp replicas and continues the run."""
    dp2_losses = losses(read_records(two_ranks / "dp2"))
    assert sorted(dp2_losses) == list(range(1, 11))
    assert_resumed_losses(losses(read_records(two_ranks / name)), {s: dp2_losses[s] for s in range(6, 11)})


def test_resume_into_same_folder_keeps_one_consistent_history(tmp_path):
    """--resume without a path continues the run in --out; metrics.jsonl then holds steps 1..7 once each."""
    first = train_here(tmp_path, **GLOBAL8, **{"train.steps": "5"})
    assert max(losses(first)) == 5
    args = override_args({**TINY, **GLOBAL8, "train.steps": "7"})
    assert launch_here("train", str(CONFIG), "--nproc", "1", "--out", str(tmp_path), "--resume", *args) == 0
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
