"""Muon trains every layout as one process does (docs/optimizers.md; the correctness contract of
docs/architecture.md): the loss of every step (1e-5 relative), the gradients after step 1 (1e-5 of their norm) and
the parameters after the last step (Muon's drift bound, :func:`muon_drift_bound`), with Newton-Schulz in fp32 (the
contract's arithmetic; bf16 Newton-Schulz is checked bit for bit against whole matrices in tests/test_muon.py).

Each world size is one torchrun launch (``tests/layout_worker.py``); the references train in this process.
"""

from __future__ import annotations

import pytest

from conftest import CONFIG, TINY, assert_close_grads, assert_close_losses, assert_close_params
from layout_worker import layout_launcher, reference_run
from test_train_parallel import shakespeare_prefix

MUON = {"optim.name": "muon", "optim.muon_ns_dtype": "float32"}
MODEL = {**TINY, **MUON, "model.n_head": "4", "train.steps": "6", "batch.micro_batch_size": "8"}
MOE = {"model.type": "mixtral", "model.n_kv_head": "2", "model.num_experts": "4", "model.ffn_hidden": "24"}
LAYOUTS = {  # name: (world_size, overrides); every one has global batch 8
    "ddp": (2, {"batch.micro_batch_size": "4"}),
    "zero1-dp2": (2, {"parallel.zero_stage": "1", "batch.micro_batch_size": "4"}),
    "fsdp2-dp2": (2, {"parallel.zero_stage": "3", "batch.micro_batch_size": "4"}),
    "fsdp2-dp2-gather": (2, {"parallel.zero_stage": "3", "batch.micro_batch_size": "4", "optim.muon_exchange": "gather"}),
    "tp2-seqpar": (2, {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "pp2": (2, {"parallel.pp": "2", "batch.micro_batch_size": "4", "batch.gradient_accumulation_steps": "2"}),
    "sp2-ulysses": (2, {"parallel.sp": "2"}),
    "fsdp2-dp4": (4, {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"}),
    "fsdp2-dp2-tp2": (4, {"parallel.zero_stage": "3", "parallel.tp": "2", "batch.micro_batch_size": "4"}),
    "mixtral-ep2": (2, {**MOE, "parallel.ep": "2", "batch.micro_batch_size": "4"}),
}
SLOW = {"fsdp2-dp4", "fsdp2-dp2-tp2", "pp2", "sp2-ulysses", "zero1-dp2", "fsdp2-dp2-gather", "mixtral-ep2"}
"""In `make test-slow`: the 4-rank launch (~25 s here), pp and Ulysses sp (which change nothing Muon sees: whole
matrices per stage, replicated ones per sp rank), ZeRO-1, the gather exchange and ep (whole experts per rank); the
shards of FSDP2 x tp, of dp4, of experts and the gather exchange are also checked bit for bit against whole matrices
by tests/test_muon.py in `make test`, which keeps DDP, FSDP2 dp2 and tp2 with sequence parallelism here."""


def muon_step_bound(cfg) -> float:
    """``max(1, 1.21 * r)``: the most one Muon step moves an element, in units of its learning rate (1.21: the
    largest singular value Newton-Schulz leaves, :func:`muon_drift_bound`; r: the largest learning-rate ratio of
    ``cfg``'s model's Muon matrices), or AdamW's step on the rest (1)."""
    from meshtrain.models.build import build_model
    from meshtrain.optim.table import muon_lr_ratio, takes_muon

    ratio = max(muon_lr_ratio(cfg.optim.muon_lr_adjust, tuple(p.shape))
                for n, p in build_model(cfg.model, 128).named_parameters() if takes_muon(n, tuple(p.shape)))
    return max(1.0, 1.21 * ratio)


def muon_drift_bound(overrides: dict[str, str]) -> float:
    """Largest parameter difference two runs that agree up to rounding can reach: ``2 * sum_t lr_t * max(1, 1.21 *
    r)``. Muon moves a matrix by ``lr_t * r * O`` with O's singular values <= 1.21 (Newton-Schulz's polynomial never
    exceeds p(0.5545) = 1.2025 on [0, 1.21]), so each element by at most 1.21 * r * lr_t, with r the largest
    learning-rate ratio (:func:`meshtrain.optim.table.muon_lr_ratio`) of the model's matrices; AdamW's rest by at
    most lr_t (tests/conftest.py's ``adamw_drift_bound``). Two runs can move in opposite directions: twice that. Loose
    by design, as AdamW's: the losses of every step and the step-1 gradients carry the tight checks."""
    from meshtrain.config.load import load_config
    from meshtrain.optim.schedule import lr_at

    cfg = load_config(CONFIG, {**TINY, **overrides})
    return 2 * muon_step_bound(cfg) * sum(lr_at(step, cfg.optim, cfg.train.steps) for step in range(cfg.train.steps))


def _check(got: tuple, want: tuple, overrides: dict[str, str]) -> None:
    assert len(got[0]) == int(MODEL["train.steps"])
    assert_close_losses(got[0], want[0])
    assert_close_grads(got[1], want[1])
    assert_close_params(got[2], want[2], atol=muon_drift_bound(overrides))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict[str, str]:
    return {**MODEL, **shakespeare_prefix(tmp_path_factory.mktemp("text"))}


@pytest.fixture(scope="module")
def references(model, tmp_path_factory):
    """One process, micro batch 8: the dense GPT and the Mixtral, each trained once when first asked."""
    cache = {}

    def get(moe: bool):
        if moe not in cache:
            cache[moe] = reference_run(tmp_path_factory.mktemp("ref"), {**model, **(MOE if moe else {})})
        return cache[moe]
    return get


@pytest.fixture(scope="module")
def launched(model, tmp_path_factory):
    return layout_launcher(tmp_path_factory, model, {n: v for n, v in LAYOUTS.items() if n not in SLOW}, "muon")


@pytest.fixture(scope="module")
def launched_slow(model, tmp_path_factory):
    return layout_launcher(tmp_path_factory, model, {n: v for n, v in LAYOUTS.items() if n in SLOW}, "muon-slow")


def _layout(references, launched, name: str) -> None:
    world, overrides = LAYOUTS[name]
    _check(launched(world)[name], references(name.startswith("mixtral")), {**MODEL, **overrides})


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in SLOW])
def test_muon_layout_matches_single_process(references, launched, name):
    _layout(references, launched, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_muon_layout_matches_single_process(references, launched_slow, name):
    _layout(references, launched_slow, name)


def test_the_contract_catches_a_muon_that_skips_newton_schulz(model, references, tmp_path):
    """A Muon whose update is not orthogonalized (one Newton-Schulz step instead of five: a different update of the
    same direction) fails the per-step loss check, so the checks above cannot pass vacuously."""
    got = reference_run(tmp_path, {**model, "optim.muon_ns_steps": "1"})
    with pytest.raises(AssertionError):
        assert_close_losses(got[0], references(False)[0])


# --- checkpoints ---------------------------------------------------------------------------------------------------

SAVE5 = {"batch.micro_batch_size": "8", "train.steps": "10", "checkpoint.interval": "5", "checkpoint.keep": "3"}


@pytest.fixture(scope="module")
def uninterrupted(model, tmp_path_factory):
    """10 Muon steps in this process, checkpoints at 5 and 10."""
    from conftest import final_params, losses, train_here

    out = tmp_path_factory.mktemp("muon-full")
    return out, losses(train_here(out, **{**model, **SAVE5})), final_params(out)


def test_muon_resume_same_layout_is_exact(model, uninterrupted, tmp_path):
    """The momentum buffers and AdamW's states come back as saved: the resumed steps are the uninterrupted ones."""
    from conftest import final_params, losses, train_here

    full, want, params = uninterrupted
    got = losses(train_here(tmp_path, **{**model, **SAVE5, "checkpoint.resume": str(full / "checkpoints" / "step_000005")}))
    assert got == {s: want[s] for s in range(6, 11)}  # same process, same layout: bit-exact
    assert_close_params(final_params(tmp_path), params, atol=0)


@pytest.mark.slow
def test_muon_checkpoint_reshards_to_fsdp2_and_tp2(model, uninterrupted, tmp_path):
    """The one-process checkpoint resumes at FSDP2 dp2 (momentum sharded by rows) and tp2 with sequence parallelism
    (by columns and rows): step 6 from the same bytes (1e-6, :func:`conftest.assert_resumed_losses`), then the
    contract's 1e-5."""
    from conftest import assert_resumed_losses, losses, read_records
    from layout_worker import launch_layouts

    full, want, _ = uninterrupted
    resume = {**model, **SAVE5, "checkpoint.resume": str(full / "checkpoints" / "step_000005")}
    layouts = {"fsdp2": {**resume, "parallel.zero_stage": "3", "batch.micro_batch_size": "4"},
               "tp2": {**resume, "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}}
    launch_layouts(2, tmp_path, layouts, results=False)
    for name in layouts:
        assert_resumed_losses(losses(read_records(tmp_path / name)), {s: want[s] for s in range(6, 11)})


def test_another_optimizers_checkpoint_is_refused_unless_fresh(model, uninterrupted, tmp_path):
    """A Muon checkpoint resumed as AdamW: one line and exit code 2 before any rank starts; with
    ``checkpoint.fresh_optimizer`` the weights load (step 6's loss, computed before any update, is the Muon run's
    bit for bit) and AdamW starts from zero states."""
    from conftest import cli_here, losses, override_args, train_here

    full, want, _ = uninterrupted
    resume = {**model, **SAVE5, "checkpoint.resume": str(full / "checkpoints" / "step_000005"), "optim.name": "adamw"}
    proc = cli_here("train", str(CONFIG), "--nproc", "1",
                    *override_args({**resume, "train.out_dir": str(tmp_path / "a")}))
    assert proc.returncode == 2 and "optim.name = 'muon'" in proc.stderr and "fresh_optimizer" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "a" / "metrics.jsonl").exists()
    got = losses(train_here(tmp_path / "b", **{**resume, "checkpoint.fresh_optimizer": "true"}))
    assert got[6] == want[6] and got[7] != want[7]  # the same weights, then another optimizer's step
