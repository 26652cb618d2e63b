"""The DeepSeek-V3 family on the layouts ``tests/test_deepseek_v3_layouts.py`` does not run, against one process.

The same tiny DeepSeek-V3 (:data:`test_deepseek_v3_layouts.MODEL`: 8 routed experts in 2 groups, 1 shared, the first
layer dense, MLA with q's low-rank path, routing biases moved after every step, fp32), the same one-process references
(:func:`test_deepseek_v3_layouts.one_process`: the layout's model keys and global batch, no recomputation, eager) and
the same contract (:func:`conftest.check_layout`: every step's loss within 1e-5 relative, the step-1 gradients within
1e-5 of their norm, the final parameters within AdamW's drift bound; the routing biases bit for bit, since each moves
by ``rate * sign(mean - count)`` of integer counts that no summation order changes):

- USP (``parallel.sp_mode = "usp"``): Ulysses 2 inside x ring 2 across, 4 ranks, with multi-token prediction;
- recomputation (``train.recompute``): "full" and "selective" on one process against the same process without it, and
  under layouts: selective under ep2 x FSDP2 dp2 with multi-token prediction and under interleaved 1F1B, full under tp2
  with sequence parallelism and under zero-bubble. A recomputed forward runs the same operators on the same inputs, so
  the tolerances are unchanged;
- compiled blocks (``train.compile = "on"``) on one process and under ep2 (DDP dp2), against eager: inductor's fused
  elementwise loops differ by a few ulps per operator, within the same bounds (``tests/test_recompute.py``). MLA and
  the group-limited routing trace without a graph break; the shared MoE layer (``models/moe/layer.py``) breaks at its
  two ``bincount``\ s, its recomputation check and the fp32 grouped GEMM, so the 2-layer model is 22 graphs (training
  and eval) and 26 inductor compiles to C++ (forward and backward parts; 1 rank: 88 s of CPU, a first step of 60 s on
  a quiet 2-core machine and 3 min on a loaded one). Under ep the all-to-all sizes change every step: dynamo
  compiles the dispatch's graphs again once, at step 2, with those sizes symbolic, and not after (measured on a loaded
  machine: step 1 226 s, step 2 30 s, step 3 0.06 s);
- the pipeline schedules beyond 1F1B and ZBV at pp2: gpipe, naive, zero-bubble, and interleaved 1F1B with 2 chunks
  per rank (4 layers: the dense one in the first chunk);
- tp2 x ep2 (4 ranks: MLA's heads split over tp, the routed experts over the dp2 ranks), whose export ``transformers``
  loads and continues a prompt greedily as meshtrain's ``generate`` does, token for token;
- GLM-4.5 (``glm4_moe``: grouped-query attention with biases and q/k norms, DeepSeek-V3's MoE) and DeepSeek-V2
  (``deepseek_v2``: V2's group-limited softmax router, no selection bias) at pp2 1F1B and at ep2, and each one's step-2
  checkpoint of ep2 resumed at tp2 (:func:`conftest.assert_resumed_losses`).

Everything here is ``@pytest.mark.slow``: one launch per world size (1, 2 and 4 ranks), :func:`launched`.
"""

from __future__ import annotations

import pytest
import torch

from test_deepseek_v3_layouts import DIRECT_Q, MODEL, MTP, PIPE, SAVE, ZBV, one_process

SEL, FULL, COMPILED = {"train.recompute": "selective"}, {"train.recompute": "full"}, {"train.compile": "on"}
PP2 = {"parallel.pp": "2", **PIPE}
"""pp2 with 2 micro-batches of 2 samples (the global batch of 4 of :data:`MODEL`)."""
EP2 = {"parallel.ep": "2", "batch.micro_batch_size": "2"}
"""ep2 over DDP dp2: each dp rank 2 of the 4 samples."""
MLA_DEFAULTS = {"model.kv_lora_rank": "512", "model.q_lora_rank": "0", "model.qk_nope_head_dim": "128",
                "model.qk_rope_head_dim": "64", "model.v_head_dim": "128"}
"""MLA's keys back at their defaults: ``glm4_moe`` refuses any other value (it has no MLA)."""
GLM = {**MLA_DEFAULTS, "model.type": "glm4_moe", "model.n_kv_head": "2", "model.attention_bias": "true",
       "model.qk_norm": "true"}
"""GLM-4.5 in :data:`MODEL`'s miniature: 4 query heads on 2 kv heads of 8 features, half of them rotated."""
V2 = {"model.type": "deepseek_v2", "model.topk_method": "group_limited_greedy", "model.router_bias_update_rate": "0",
      **DIRECT_Q}
"""DeepSeek-V2 in :data:`MODEL`'s miniature: q projected directly (V2-Lite's), the best group of 2 kept."""

LAYOUTS = {  # name: (world size, overrides of MODEL)
    "one-full": (1, FULL),
    "one-selective": (1, {**SEL, **MTP}),
    "one-compiled": (1, COMPILED),
    "pp2-gpipe": (2, {**PP2, "parallel.pp_schedule": "gpipe"}),
    "pp2-naive": (2, {**PP2, "parallel.pp_schedule": "naive"}),
    "pp2-zero-bubble-full": (2, {**PP2, "parallel.pp_schedule": "zero-bubble", **FULL}),
    "pp2-interleaved-1f1b-selective": (2, {**ZBV, "parallel.pp": "2", "parallel.pp_schedule": "interleaved-1f1b",
                                           **SEL}),
    "ep2-fsdp2-dp2-selective-mtp": (2, {**EP2, "parallel.zero_stage": "3", **SEL, **MTP}),
    "tp2-sp-full": (2, {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true", **FULL}),
    "ep2-compiled": (2, {**EP2, **COMPILED}),
    "glm4-pp2": (2, {**GLM, **PP2}),
    "v2-pp2": (2, {**V2, **PP2}),
    "glm4-ep2": (2, {**GLM, **EP2, **SAVE}),
    "v2-ep2": (2, {**V2, **EP2, **SAVE}),
    "usp-sp4-mtp": (4, {"parallel.sp": "4", "parallel.sp_mode": "usp", "parallel.sp_ulysses": "2", **MTP}),
    "tp2-ep2": (4, {"parallel.tp": "2", **EP2, **SAVE}),
}
"""Each layout's global batch is the reference's 4 samples of 32 tokens; the pipelines' 2 micro-batches of 2 are the
reference's (:func:`test_deepseek_v3_layouts.one_process_overrides`)."""
RESHARDS = {  # name: (the layout whose step-2 checkpoint it resumes, its own overrides of MODEL); 2 ranks
    "glm4-tp2-from-ep2": ("glm4-ep2", {**GLM, "parallel.tp": "2", **SAVE}),
    "v2-tp2-from-ep2": ("v2-ep2", {**V2, "parallel.tp": "2", **SAVE}),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``get(world)``: {name: :func:`layout_worker.load_result`} of the layouts of that world size (2: with the
    reshards, after their sources), launched once per world size into ``root/w{world}``; and ``root``."""
    from layout_worker import launch_layouts

    root, cache = tmp_path_factory.mktemp("deepseek_layouts_more"), {}

    def get(world: int) -> dict[str, tuple]:
        if world not in cache:  # a failed launch is kept too: its peers' tests report it rather than launch again
            folder = root / f"w{world}"
            folder.mkdir()
            named = {n: {**MODEL, **o} for n, (w, o) in LAYOUTS.items() if w == world}
            if world == 2:
                named |= {n: {**MODEL, **o, "checkpoint.resume": str(folder / source / "checkpoints" / "step_000002")}
                          for n, (source, o) in RESHARDS.items()}
            try:
                cache[world] = launch_layouts(world, folder, named)
            except AssertionError as e:
                cache[world] = e
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return get, root


@pytest.mark.slow  # 1-, 2- and 4-rank launches, references: 3m47s on 2 quiet cores (inductor cache warm), ~9 min loaded
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_one_process(launched, name):
    """The contract (module docstring) for layout ``name``; with multi-token prediction, every step's ``mtp_loss``
    within the loss's tolerance (the same sums, reduced alike)."""
    from conftest import assert_close_losses, check_layout, read_records

    get, root = launched
    world, overrides = LAYOUTS[name]
    got = get(world)[name]
    want, folder = one_process(root, world, overrides)
    check_layout(got, want, {**MODEL, **overrides})
    biases = [k for k in want[2] if k.endswith("expert_bias")]
    assert biases, sorted(want[2])
    for key in biases:
        assert torch.equal(got[2][key], want[2][key]), key
    if "model.num_nextn_predict_layers" in overrides:
        got_mtp, want_mtp = ({r["step"]: r["mtp_loss"] for r in read_records(d) if "mtp_loss" in r}
                             for d in (root / f"w{world}" / name, folder))
        assert want_mtp and got_mtp.keys() == want_mtp.keys()
        assert_close_losses(got_mtp, want_mtp)


@pytest.mark.slow
@pytest.mark.parametrize("name", RESHARDS)
def test_a_checkpoint_reshards_from_ep_to_tp(launched, name):
    """The step-2 checkpoint of ep2 (DDP dp2) resumed at tp2: steps 3 and 4 as the uninterrupted one-process run's
    (:func:`conftest.assert_resumed_losses`: the first resumed step within 1e-6, as resharding moves bytes and only the
    forward's summation order differs)."""
    from conftest import assert_resumed_losses, losses, read_records

    get, root = launched
    get(2)
    source, _ = RESHARDS[name]
    want = one_process(root, *LAYOUTS[source])[0][0]
    got = losses(read_records(root / "w2" / name))
    assert sorted(got) == [3, 4], got
    assert_resumed_losses(got, {s: want[s] for s in (3, 4)})


@pytest.mark.slow  # the 4-rank launch above
def test_a_tp2_ep2_run_exports_and_generates_as_transformers(launched, tmp_path):
    """The tp2 x ep2 run exported (its tp and ep shards gathered into ``DeepseekV3ForCausalLM``'s names, the routing
    biases it moved as ``e_score_correction_bias``): ``transformers``' greedy continuation of a prompt is meshtrain's
    ``generate --temperature 0`` on the run and on the export, token for token."""
    from test_qwen import generates_as_transformers

    get, root = launched
    get(4)
    generates_as_transformers(root / "w4" / "tp2-ep2", tmp_path, "DeepseekV3ForCausalLM")
