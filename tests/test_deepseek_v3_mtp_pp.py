"""DeepSeek-V3's multi-token prediction under pipeline parallelism, against one process.

The modules run on the last stage with the head (``models/deepseek_v3/mtp.py``); the last stage embeds the tokens ahead
with its own copy of the (untied) embedding, whose gradient is summed with stage 0's over the embedding group (under
ZBV's V placement, where rank 0 holds both ends, with a copy refreshed from the embedding each step). The tiny
DeepSeek-V3 of ``test_deepseek_v3_layouts.py`` (:data:`test_deepseek_v3_layouts.MODEL`: 8 routed experts in 2 groups,
1 shared, the first layer dense, MLA with q's low-rank path, routing biases that move after every step, fp32) with one
MTP layer at weight 1 trains at each layout of :data:`LAYOUTS` and at one process with the same global batch and
micro-batches. The contract (:func:`conftest.check_layout`): every step's loss within 1e-5 relative, the step-1
gradients within 1e-5 of their norm, the final parameters within AdamW's drift bound; the routing biases bit for bit
(integer counts, :func:`test_deepseek_v3_layouts.test_layout_equals_one_process`); every step's ``mtp_loss`` within the
loss's 1e-5 (the same sums, reduced alike).

- ``make test-slow``, one 2-rank launch: pp2 1F1B (saving at step 2) and a sabotage (:data:`SABOTAGES`: the embedding
  copies' gradients left unsummed) that must fail the gradient comparison;
- ``make test-slow``, the rest: ZBV (4 layers, the V placement), gpipe, naive, interleaved 1F1B and zero-bubble (4 layers, 2 chunks
  per rank); at 4 ranks pp2 x tp2, pp2 x Ulysses and ring sp2 (the tokens ahead shifted on the whole window, then
  cut as the tokens are), ep2 x pp2, and ZBV under tp2 and under FSDP2 dp2 (the last chunk's refreshed copy sharded
  as the embedding); and pp2 1F1B's step-2 checkpoint resumed at tp2 and on one process (resharding).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from test_deepseek_v3_layouts import MODEL, MTP, PIPE, SAVE, ZBV, one_process

PP2 = {"parallel.pp": "2", **PIPE, **MTP}
"""pp2 1F1B with 2 micro-batches of 2 samples (:data:`MODEL`'s global batch of 4) and one MTP layer."""
CHUNKED = {**PP2, "parallel.virtual_stages": "2", "model.n_layer": "4"}
"""2 chunks per rank over 4 layers (the dense one in the first chunk)."""
ZBV_MTP = {**ZBV, **PP2}
"""ZBV over 4 layers: rank 0 holds the first and the last chunk, whose embedding is a copy refreshed every step."""
NO_AUX = {"model.router_aux_loss_coef": "0"}
"""dp2 x GA2 micro-steps hold other samples than one process's (dp rank r takes samples 2r and 2r+1 of the step):
without the load-balancing loss, whose counts are per micro-step, the rest must be equal
(``test_deepseek_v3_layouts.LAYOUTS``' ep2-pp2)."""
LAYOUTS = {  # name: (world size, overrides of MODEL)
    "pp2-1f1b-mtp": (2, PP2),
    "pp2-zbv-mtp": (2, ZBV_MTP),
    "pp2-gpipe-mtp": (2, {**PP2, "parallel.pp_schedule": "gpipe"}),
    "pp2-naive-mtp": (2, {**PP2, "parallel.pp_schedule": "naive"}),
    "pp2-interleaved-1f1b-mtp": (2, {**CHUNKED, "parallel.pp_schedule": "interleaved-1f1b"}),
    "pp2-zero-bubble-mtp": (2, {**CHUNKED, "parallel.pp_schedule": "zero-bubble"}),
    "pp2-tp2-mtp": (4, {**PP2, "parallel.tp": "2"}),
    "pp2-sp2-ulysses-mtp": (4, {**PP2, "parallel.sp": "2"}),
    "pp2-sp2-ring-mtp": (4, {**PP2, "parallel.sp": "2", "parallel.sp_mode": "ring", "model.q_lora_rank": "0"}),
    "ep2-pp2-mtp": (4, {**PP2, "parallel.ep": "2", "batch.micro_batch_size": "1", **NO_AUX}),
    "pp2-zbv-tp2-mtp": (4, {**ZBV_MTP, "parallel.tp": "2"}),
    "pp2-zbv-fsdp2-dp2-mtp": (4, {**ZBV_MTP, "parallel.zero_stage": "2", "batch.micro_batch_size": "1", **NO_AUX}),
}
FAST = ("pp2-1f1b-mtp",)
RESHARDS = {  # name: (the layout whose step-2 checkpoint it resumes, its world size, its own overrides)
    "tp2-from-pp2": ("pp2-1f1b-mtp", 2, {"parallel.tp": "2", **PIPE, **MTP}),
    "one-from-pp2": ("pp2-1f1b-mtp", 1, {**PIPE, **MTP}),
}
"""Each with the source's micro-batches (2 of 2 samples), so that it continues the reference run exactly."""
SABOTAGES = {"pp2-unsynced-embedding": (2, {**PP2, "train.steps": "1"})}
"""Step 1 of pp2-1f1b-mtp with the embedding copies' gradients not summed (:func:`_run_layout`)."""


def _run_layout(overrides: dict[str, str], out: Path, config: Path) -> None:
    """:func:`layout_worker.run_layout`; a layout of :data:`SABOTAGES` (``"mtp_sabotage"`` in its overrides) runs with
    a pipeline that forgets its embedding copies (``Pipeline.tied_weights`` lists none), so stage 0's embedding keeps
    the main loss's gradient only and the last stage's copy the MTP loss's only."""
    from meshtrain.parallel.pipeline.schedule import Pipeline

    overrides = dict(overrides)
    with pytest.MonkeyPatch.context() as patch:
        if overrides.pop("mtp_sabotage", None) in SABOTAGES:
            patch.setattr(Pipeline, "tied_weights", lambda self: [])
        _RUN_LAYOUT(overrides, out, config)


def launch(folder: Path, world: int, layouts: dict[str, dict[str, str]]) -> dict[str, tuple]:
    """Every layout (name -> overrides of :data:`MODEL`) on ``world`` ranks in one launch of this file as the worker."""
    from layout_worker import launch_layouts

    folder.mkdir(parents=True)
    return launch_layouts(world, folder, {n: {**MODEL, **o} for n, o in layouts.items()}, worker=Path(__file__))


def resumed(folder: Path, name: str) -> dict[str, str]:
    """:data:`RESHARDS`' ``name`` as a layout: it resumes its source's step-2 checkpoint under ``folder``."""
    source, _, overrides = RESHARDS[name]
    return {**overrides, **SAVE, "checkpoint.resume": str(folder / source / "checkpoints" / "step_000002")}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """:data:`FAST` (saving at step 2) and the sabotage: one 2-rank launch."""
    root = tmp_path_factory.mktemp("mtp_pp")
    layouts = {n: {**LAYOUTS[n][1], **SAVE} for n in FAST}
    layouts |= {n: {**o, "mtp_sabotage": n} for n, (_, o) in SABOTAGES.items()}
    return launch(root / "w2", 2, layouts), root


def check(root: Path, folder: Path, result: tuple, world: int, overrides: dict[str, str]) -> None:
    """The contract of the module docstring for one layout trained into ``folder``."""
    import torch

    from conftest import assert_close_losses, check_layout, read_records

    want, reference = one_process(root, world, overrides)
    check_layout(result, want, {**MODEL, **overrides})
    biases = [k for k in want[2] if k.endswith("expert_bias")]
    assert biases and any(k.startswith("mtp.") for k in biases), sorted(want[2])
    for key in biases:
        assert torch.equal(result[2][key], want[2][key]), key
    got, want_mtp = ({r["step"]: r["mtp_loss"] for r in read_records(d) if "mtp_loss" in r} for d in (folder, reference))
    assert want_mtp and got.keys() == want_mtp.keys()
    assert_close_losses(got, want_mtp)


@pytest.mark.slow  # one 2-rank launch, ~16 s on 2 idle cores: make test stays under 15 minutes (the split itself:
# tests/test_deepseek_v3_mtp.py's one-process pipeline chunks; the embedding group's sum: tests/test_pipeline.py)
@pytest.mark.parametrize("name", FAST)
def test_mtp_under_a_pipeline_equals_one_process(fast, name):
    """pp2 1F1B: the contract of the module docstring."""
    results, root = fast
    check(root, root / "w2" / name, results[name], *LAYOUTS[name])


def resumed_losses(root: Path, folder: Path, name: str) -> None:
    """Steps 3 and 4 of a run resumed from step 2 as the uninterrupted one-process run's
    (:func:`conftest.assert_resumed_losses`: step 3 within 1e-6, as resharding moves bytes)."""
    from conftest import assert_resumed_losses, losses, read_records

    source = RESHARDS[name][0]
    want = one_process(root, *LAYOUTS[source])[0][0]
    got = losses(read_records(folder))
    assert sorted(got) == [3, 4], got
    assert_resumed_losses(got, {s: want[s] for s in (3, 4)})


@pytest.mark.slow  # the launch above
def test_unsummed_embedding_copies_fail_the_comparison(fast):
    """pp2 1F1B with the embedding copies' gradients left unsummed (:func:`_run_layout`): step 1's loss and every other
    gradient are right (the forward is, and nothing else is summed over the embedding group), the embedding's is not
    (stage 0's holds the main loss's share only, the last stage's copy the MTP loss's), and
    :func:`conftest.assert_close_grads` says so."""
    from conftest import assert_close_grads, assert_close_losses

    (name, _), = SABOTAGES.items()
    losses, grads, _ = fast[0][name]
    want_losses, want_grads, _ = one_process(fast[1], *LAYOUTS["pp2-1f1b-mtp"])[0]
    assert_close_losses(losses, {1: want_losses[1]})
    others = [{k: g for k, g in gs.items() if k != "tok_emb.weight"} for gs in (grads, want_grads)]
    assert_close_grads(*others)
    with pytest.raises(AssertionError, match="gradient of tok_emb.weight"):
        assert_close_grads(grads, want_grads)


SLOW = [n for n in LAYOUTS if n not in FAST]


@pytest.fixture(scope="module")
def slow(fast, tmp_path_factory):
    """:data:`SLOW`, one launch per world size, the 2-rank one with the tp2 reshard of :func:`fast`'s pp2 checkpoint."""
    root = tmp_path_factory.mktemp("mtp_pp_slow")
    results = {}
    for world in sorted({LAYOUTS[n][0] for n in SLOW}):
        layouts = {n: LAYOUTS[n][1] for n in SLOW if LAYOUTS[n][0] == world}
        layouts |= {n: resumed(fast[1] / "w2", n) for n, (_, w, _) in RESHARDS.items() if w == world > 1}
        results |= launch(root / f"w{world}", world, layouts)
    return results, root


@pytest.mark.slow  # a 2-rank launch of 6 layouts, a 4-rank one of 6, and their references: ~4 min on 2 cores
@pytest.mark.parametrize("name", SLOW)
def test_slow_mtp_under_a_pipeline_equals_one_process(slow, name):
    """As :func:`test_mtp_under_a_pipeline_equals_one_process`, for the other schedules and pp2 with tp, sp or ep."""
    results, root = slow
    world = LAYOUTS[name][0]
    check(root, root / f"w{world}" / name, results[name], *LAYOUTS[name])


@pytest.mark.slow
def test_a_pp2_checkpoint_with_mtp_resumes_at_tp2(fast, slow):
    """The step-2 checkpoint of pp2 1F1B (the last stage's copy of the embedding saved under ``tok_emb.weight``, as
    stage 0's, its optimizer state alike) resumed at tp2, the modules replicated and the embedding vocab-sharded."""
    resumed_losses(fast[1], slow[1] / "w2" / "tp2-from-pp2", "tp2-from-pp2")


@pytest.mark.slow
def test_a_pp2_checkpoint_with_mtp_resumes_on_one_process(fast):
    """The step-2 checkpoint of pp2 1F1B resumed on one process (in this one)."""
    from layout_worker import reference_run

    _, root = fast
    folder = root / "one-from-pp2"
    reference_run(folder, {**MODEL, **resumed(root / "w2", "one-from-pp2")})
    resumed_losses(root, folder, "one-from-pp2")


if __name__ == "__main__":  # the torchrun worker: layout_worker's, with the sabotage above
    sys.path.insert(0, str(Path(__file__).parent))
    import layout_worker

    _RUN_LAYOUT = layout_worker.run_layout
    layout_worker.run_layout = _run_layout
    layout_worker.main()
