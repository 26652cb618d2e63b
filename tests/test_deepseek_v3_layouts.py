"""DeepSeek-V3 (``models/deepseek_v3``) on every parallel axis, against one process.

A tiny DeepSeek-V3 (:data:`MODEL`: 8 routed experts in 2 groups of which 1 may be used, 1 shared expert, the first
layer dense, MLA with q through its low-rank path or not, v narrower than q and k (dv = 6, dn + dr = 12), routing biases
that move after every step, one multi-token prediction layer, fp32) trains at each layout of :data:`LAYOUTS` and at one
process with the same global batch and micro-batches (:func:`one_process`). The contract
(:func:`conftest.check_layout`): every step's loss within 1e-5 relative, the step-1 gradients within 1e-5 of their
norm, the final parameters within AdamW's drift bound; and the routing biases bit for bit
(:func:`test_layout_equals_one_process`), so every step routed every token of the global batch to experts with the
same counts.

- tp2: MLA's heads split (``q_b``/``q`` and ``kv_b`` column-, ``proj`` row-parallel, the latents replicated, the shared
  RoPE key's gradient all-reduced), the dense layer's and the shared experts' SwiGLU split, the routed experts
  replicated; with multi-token prediction (its module replicated); and with ``tp_sequence_parallel`` (the MoE layers
  take the all-gathered sequence and return their rank's part);
- pp2 (1F1B, and ZBV over 4 layers): the dense layer on the first stage, MoE ones after;
- ep2 (DDP), ep2 x FSDP2 dp2 (with multi-token prediction), ep2 x pp2 (4 ranks);
- Ulysses and ring sp2: the shared RoPE key through the all-to-all and around the ring with the heads, v narrower
  than q and k; with multi-token prediction, whose shifted tokens and targets cross the sp shards;
- checkpoints reshard: a run saved at ep2 resumes at tp2 and one saved at tp2 resumes at ep2, their resumed steps
  equal to the uninterrupted reference's (:func:`conftest.assert_resumed_losses`);
- a sabotage (:data:`SABOTAGES`: tp2 without the all-reduce of the shared RoPE key's gradient) fails the comparison,
  so the tolerances catch a wrong reduction.

``make test`` runs :data:`FAST` in one 2-rank launch; the rest is ``make test-slow``. Multi-token prediction under pp:
``tests/test_deepseek_v3_mtp_pp.py``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

TINY = {"model.block_size": "32", "optim.warmup_steps": "2", "optim.lr": "3e-3", "train.log_interval": "1",
        "train.eval_interval": "0", "train.eval_steps": "2", "checkpoint.interval": "0", "train.dtype": "float32"}
""":data:`conftest.TINY`'s run keys (this file is also the torchrun worker, which does not import conftest)."""
MODEL = {**TINY, "model.type": "deepseek_v3", "model.n_layer": "2", "model.n_head": "4", "model.n_embd": "32",
         "model.kv_lora_rank": "16", "model.q_lora_rank": "24", "model.qk_nope_head_dim": "8",
         "model.qk_rope_head_dim": "4", "model.v_head_dim": "6", "model.ffn_hidden": "16", "model.num_experts": "8",
         "model.num_experts_per_tok": "2", "model.n_group": "2", "model.topk_group": "1", "model.n_shared_experts": "1",
         "model.first_k_dense_replace": "1", "model.router_bias_update_rate": "0.05",
         "model.router_aux_loss_coef": "1.0", "train.steps": "4", "batch.micro_batch_size": "4"}
"""4 steps of a global batch of 4 samples of 32 tokens; a load-balancing weight of 1, so that expert counts summed over
the wrong ranks move the loss; routing biases moved by 0.05 after each step by the step's counts over dp x sp."""
MTP = {"model.num_nextn_predict_layers": "1", "model.mtp_loss_weight": "1.0"}
"""One multi-token prediction layer, its loss at weight 1 so that one normalised per rank or micro-batch shows."""
DIRECT_Q = {"model.q_lora_rank": "0"}
"""q projected from the hidden state directly (V2-Lite's, Moonlight's): ``attn.q`` column-parallel instead of q_b."""
PIPE = {"batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "2"}
ZBV = {**PIPE, "parallel.pp_schedule": "zbv", "parallel.virtual_stages": "2", "model.n_layer": "4"}

LAYOUTS = {  # name: (world size, overrides of MODEL)
    "tp2-mtp": (2, {"parallel.tp": "2", **MTP}),
    "tp2-sp": (2, {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "ep2-fsdp2-dp2-mtp": (2, {"parallel.ep": "2", "parallel.zero_stage": "3", "batch.micro_batch_size": "2", **MTP}),
    "tp2-direct-q": (2, {"parallel.tp": "2", **DIRECT_Q}),
    "pp2-1f1b": (2, {"parallel.pp": "2", **PIPE}),
    "pp2-zbv": (2, {"parallel.pp": "2", **ZBV}),
    "ep2": (2, {"parallel.ep": "2", "batch.micro_batch_size": "2", **DIRECT_Q}),
    "ulysses-sp2-mtp": (2, {"parallel.sp": "2", "parallel.sp_mode": "ulysses", **MTP}),
    "ring-sp2-mtp": (2, {"parallel.sp": "2", "parallel.sp_mode": "ring", **DIRECT_Q, **MTP}),
    "ep2-pp2": (4, {"parallel.ep": "2", "parallel.pp": "2", "batch.micro_batch_size": "1",
                    "batch.gradient_accumulation_steps": "2", "model.router_aux_loss_coef": "0"}),
}
"""ep2-pp2 runs dp2 x GA2: dp rank r takes samples 2r and 2r+1 of the step (:mod:`meshtrain.data.sampler`), so its
micro-step j holds samples {j, 2+j}, where one process's micro-batch j holds {2j, 2j+1}; the load-balancing loss,
whose counts are per micro-step (over dp), then differs by design. Without it the rest must still be equal, and the
routing biases (counted over the whole step) check the routing."""
FAST = ("tp2-mtp", "tp2-sp", "ep2-fsdp2-dp2-mtp")
"""In ``make test``, with the reshard pair below and the sabotage: one 2-rank launch."""
SAVE = {"checkpoint.interval": "2"}
RESHARDS = {  # name: (the layout whose step-2 checkpoint it resumes, its own overrides); 2 ranks
    "tp2-from-ep2": ("ep2-fsdp2-dp2-mtp", {"parallel.tp": "2", **MTP}),
    "ep2-from-tp2": ("tp2-direct-q", {"parallel.ep": "2", "batch.micro_batch_size": "2", **DIRECT_Q}),
}
SABOTAGES = {"tp2-unreduced-rope-key": (2, {"parallel.tp": "2", "train.steps": "1", **MTP})}  # step 1 of tp2-mtp
"""Layouts run with a deliberate bug (:func:`sabotaged`), whose comparison must fail."""


@contextlib.contextmanager
def sabotaged(name: str | None):
    """Within it, MLA under tp forgets to all-reduce the shared RoPE key's gradient (each tp rank keeps its own heads'
    share): ``kv_a``'s gradient is wrong, and through the residual stream every gradient before it."""
    from meshtrain.models.deepseek_v3 import model

    saved = model.shared_by_heads
    if name in SABOTAGES:
        model.shared_by_heads = lambda x, head_weight: x
    try:
        yield
    finally:
        model.shared_by_heads = saved


def _run_layout(overrides: dict[str, str], out: Path, config: Path) -> None:
    """:func:`layout_worker.run_layout` within :func:`sabotaged` (``"deepseek_sabotage"`` in the overrides)."""
    overrides = dict(overrides)
    with sabotaged(overrides.pop("deepseek_sabotage", None)):
        _RUN_LAYOUT(overrides, out, config)


def one_process_overrides(world: int, overrides: dict[str, str]) -> dict[str, str]:
    """The single-process run a layout must equal: its model keys and micro-batches, the dp ranks' samples in one
    micro-batch (dp = world / (tp*pp*sp))."""
    model = {k: v for k, v in overrides.items() if k.startswith("model.")}
    parallel = {a: int(overrides.get(f"parallel.{a}", "1")) for a in ("tp", "pp", "sp")}
    dp = world // (parallel["tp"] * parallel["pp"] * parallel["sp"])
    batch = {k: v for k, v in overrides.items() if k.startswith("batch.") or k == "train.steps"}
    mbs = int(batch.get("batch.micro_batch_size", MODEL["batch.micro_batch_size"])) * dp
    return {**MODEL, **model, **batch, "batch.micro_batch_size": str(mbs)}


_REFERENCES: dict[tuple, Path] = {}


def one_process(root: Path, world: int, overrides: dict[str, str]) -> tuple[tuple, Path]:
    """(:func:`layout_worker.reference_run` of :func:`one_process_overrides`, its folder), run once per module for the
    layouts that share it."""
    from layout_worker import load_result, reference_run

    ref = one_process_overrides(world, overrides)
    key = tuple(sorted(ref.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = root / f"one-{len(_REFERENCES)}"
        reference_run(_REFERENCES[key], ref)
    return load_result(_REFERENCES[key]), _REFERENCES[key]


def launch(root: Path, world: int, layouts: dict[str, dict[str, str]]) -> dict[str, tuple]:
    """Every layout (name -> overrides of MODEL) on ``world`` ranks in one launch of this file as the worker."""
    from layout_worker import launch_layouts

    folder = root / f"w{world}-{'-'.join(sorted(layouts))[:60]}"
    folder.mkdir(parents=True)
    return launch_layouts(world, folder, {n: {**MODEL, **o} for n, o in layouts.items()}, worker=Path(__file__))


def resumes(root: Path, launched: Path) -> dict[str, dict[str, str]]:
    """:data:`RESHARDS` as layouts: each resumes its source's step-2 checkpoint (saved earlier in the same launch)."""
    return {name: {**overrides, **SAVE, "checkpoint.resume": str(launched / source / "checkpoints" / "step_000002")}
            for name, (source, overrides) in RESHARDS.items()}


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """:data:`FAST` (saving at step 2), the reshards of :data:`RESHARDS` whose source is among them, and the sabotage,
    in one 2-rank launch (in that order: a resume reads a checkpoint saved before it)."""
    root = tmp_path_factory.mktemp("deepseek_layouts")
    layouts = {n: {**LAYOUTS[n][1], **SAVE} for n in FAST}
    return _launch_with_resumes(root, layouts), root


def _launch_with_resumes(root: Path, layouts: dict[str, dict[str, str]]) -> dict[str, tuple]:
    from layout_worker import launch_layouts

    folder = root / "w2"
    folder.mkdir(parents=True)
    ours = {n: o for n, o in resumes(root, folder).items() if RESHARDS[n][0] in layouts}
    sabotage = {n: {**o, "deepseek_sabotage": n} for n, (_, o) in SABOTAGES.items()} if "tp2-mtp" in layouts else {}
    named = {n: {**MODEL, **o} for n, o in {**layouts, **ours, **sabotage}.items()}
    return launch_layouts(2, folder, named, worker=Path(__file__))


def test_the_run_keys_are_conftests():
    """:data:`TINY` is :data:`conftest.TINY` (its model shape and steps aside, which :data:`MODEL` sets)."""
    from conftest import TINY as CONFTEST_TINY

    def run(keys: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in keys.items() if k not in ("model.n_layer", "model.n_head", "model.n_embd", "train.steps")}

    assert run(TINY) == run(CONFTEST_TINY)


def _check(root: Path, results: dict, name: str) -> None:
    """The contract for layout ``name`` (:func:`test_layout_equals_one_process`)."""
    from conftest import assert_close_losses, check_layout, read_records

    world, overrides = LAYOUTS[name]
    want, folder = one_process(root, world, overrides)
    check_layout(results[name], want, {**MODEL, **overrides})
    biases = [k for k in want[2] if k.endswith("expert_bias")]
    assert biases, sorted(want[2])
    for key in biases:  # moved by sign(mean - count) after each step: equal only if every step's counts are
        assert torch.equal(results[name][2][key], want[2][key]), key
    if "model.num_nextn_predict_layers" in overrides:
        got, want_mtp = ({r["step"]: r["mtp_loss"] for r in read_records(d) if "mtp_loss" in r}
                         for d in (root / "w2" / name, folder))
        assert want_mtp and got.keys() == want_mtp.keys()
        assert_close_losses(got, want_mtp)


@pytest.mark.parametrize("name", FAST)
def test_layout_equals_one_process(fast, name):
    """Every step's loss, the step-1 gradients and the final parameters as one process's (the contract, with the
    tolerances :func:`conftest.check_layout` derives); the routing biases bit for bit: each is moved by
    ``rate * sign(mean - count)`` of the step's expert counts over the global batch, a sum of integers that no
    summation order changes, so they agree exactly when every step's routing does; with multi-token prediction, every
    step's ``mtp_loss`` within the loss's tolerance (the same sums, reduced alike)."""
    results, root = fast
    _check(root, results, name)


def _resumed(root: Path, name: str) -> None:
    from conftest import assert_resumed_losses, losses, read_records

    source, _ = RESHARDS[name]
    want = one_process(root, *LAYOUTS[source])[0][0]
    got = losses(read_records(root / "w2" / name))
    assert sorted(got) == [3, 4], got
    assert_resumed_losses(got, {s: want[s] for s in (3, 4)})


@pytest.mark.parametrize("name", [n for n in RESHARDS if RESHARDS[n][0] in FAST])
def test_a_checkpoint_reshards_across_ep_and_tp(fast, name):
    """The step-2 checkpoint of one layout resumed at another: steps 3 and 4 as the uninterrupted one-process run's
    (:func:`conftest.assert_resumed_losses`: the first resumed step within 1e-6, as resharding moves bytes and only the
    forward's summation order differs; the routing biases, buffers of the checkpoint, resharded with the weights)."""
    _resumed(fast[1], name)


def test_a_sabotaged_layout_fails_the_comparison(fast):
    """tp2 with the shared RoPE key's gradient left unreduced (:func:`sabotaged`): step 1's loss is right (the forward
    is), its gradients are not (``kv_a``'s, and through the residual stream every earlier one), and
    :func:`conftest.assert_close_grads` says so; compared with :data:`FAST`'s tp2 reference, whose step 1 it is."""
    from conftest import assert_close_grads, assert_close_losses

    results, root = fast
    (name, _), = SABOTAGES.items()
    got, want = results[name], one_process(root, *LAYOUTS["tp2-mtp"])[0]
    assert_close_losses(got[0], {1: want[0][1]})
    with pytest.raises(AssertionError, match="gradient of"):
        assert_close_grads(got[1], want[1])


SLOW = [n for n in LAYOUTS if n not in FAST]


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """The other layouts, one launch per world size (the 2-rank one with the remaining reshard)."""
    root = tmp_path_factory.mktemp("deepseek_layouts_slow")
    two = {n: {**LAYOUTS[n][1], **SAVE} for n in SLOW if LAYOUTS[n][0] == 2}
    results = _launch_with_resumes(root, two)
    results |= launch(root, 4, {n: LAYOUTS[n][1] for n in SLOW if LAYOUTS[n][0] == 4})
    return results, root


@pytest.mark.slow  # two launches (2 and 4 ranks) and their references: ~5 min on 2 cores
@pytest.mark.parametrize("name", SLOW)
def test_slow_layout_equals_one_process(slow, name):
    """As :func:`test_layout_equals_one_process`."""
    results, root = slow
    _check(root, results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RESHARDS if RESHARDS[n][0] in SLOW])
def test_slow_checkpoint_reshards_across_ep_and_tp(slow, name):
    """As :func:`test_a_checkpoint_reshards_across_ep_and_tp`."""
    _resumed(slow[1], name)


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.tp": "2", "parallel.tp_sequence_parallel": "true", **MTP},
     "model.num_nextn_predict_layers = 1 (multi-token prediction) is not supported with "
     "parallel.tp_sequence_parallel = True"),
    ({"parallel.tp": "2", "model.dense_ffn_hidden": "33"}, "the dense layers' SwiGLU width (model.dense_ffn_hidden, or "
                                                            "(n_shared_experts + num_experts_per_tok) * ffn_hidden) = 33 "
                                                            "is not divisible by parallel.tp = 2"),
    ({"parallel.tp": "2", "model.ffn_hidden": "15", "model.dense_ffn_hidden": "30"},
     "the shared experts' width model.n_shared_experts * model.ffn_hidden = 15 is not divisible by parallel.tp = 2"),
])
def test_a_layout_the_family_cannot_split_is_one_line_before_launch(overrides, message):
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, {**MODEL, **overrides})
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)



@pytest.mark.parametrize("v_width", [6, 20])
def test_ring_attention_takes_v_narrower_or_wider_than_q_and_k(v_width):
    """Ring attention (``parallel/sequence/ring.py``) with v of another width than q and k (MLA's dv and dn + dr),
    narrower (v zero-padded) and wider (q and k zero-padded, the scale kept at 1/sqrt(12)), against ``torch``'s causal
    SDPA: the output and the gradients of q, k, v. On a ring of one rank, which runs the same chunking, block kernels,
    online-softmax merge and padding. Tolerance: each output or gradient element is a sum of <= T = 8 fp32 products of
    softmax weights in [0, 1] and unit-normal values, merged in another order than SDPA's single softmax; the
    rounding is ~T * 2**-24 * max|term| ~ 1e-6, so 1e-5 holds, while a wrong scale or a padded feature left in
    moves results by > 1e-2."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from conftest import free_port
    from meshtrain.parallel.sequence.ring import RingAttention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        q, k = torch.randn(2, 3, 8, 12, requires_grad=True), torch.randn(2, 3, 8, 12, requires_grad=True)
        v = torch.randn(2, 3, 8, v_width, requires_grad=True)  # (B, nh, T, dv)
        got = RingAttention(dist.group.WORLD)(q, k, v)
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    finally:
        dist.destroy_process_group()
    assert got.shape == want.shape == (2, 3, 8, v_width)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


if __name__ == "__main__":  # the torchrun worker: layout_worker's, with the sabotages above
    sys.path.insert(0, str(Path(__file__).parent))
    import layout_worker

    _RUN_LAYOUT = layout_worker.run_layout
    layout_worker.run_layout = _run_layout
    layout_worker.main()
