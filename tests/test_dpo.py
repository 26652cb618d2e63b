"""Direct preference optimization (train.objective = "dpo"): the loss against the papers' equations, and every
layout against one process.

The pairs are cut from the plays (scripts/shakespeare_chat.py): a prompt, the real reply as chosen, a reply from far
away in the text as rejected (the first :data:`PAIRS` of them). The reference log-probabilities are computed once
before step 1, with the starting weights and the run's own layout (meshtrain.train.reference); the first step's loss
is then ln 2 on every pair and the later steps' are not. Layouts, 2 gloo ranks, each against one process taking the
whole batch of pairs at once (every step's loss, the step-1 gradients, the final parameters): in make test's launch
DDP dp2 with gradient accumulation, tp2 with sequence parallelism, pp2 (1F1B), ep2 on a mixture of experts, IPO on
ring sp2, and the other reference, a frozen copy of the starting weights (train.dpo_reference = "copy"), at dp2 with
gradient accumulation; in make test-slow's launch FSDP2 dp2, Ulysses and ring sp2 with the sigmoid loss, the robust
loss at dp2, and the frozen copy under FSDP2, tp2, pp2 and ring sp2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY, adamw_drift_bound, assert_close_grads, assert_close_params, read_records
from layout_worker import launch_layouts, reference_run
from meshtrain.objectives import dpo_loss
from test_sft_layouts import MOE, prepared_plays

STEPS = 3
COPY = {"train.dpo_reference": "copy"}
MODEL = {**TINY, "model.type": "llama", "model.n_head": "2", "model.n_kv_head": "2", "model.block_size": "128",
         "model.vocab_size": "1280", "model.dropout": "0.0", "train.steps": str(STEPS), "train.eval_steps": "2",
         "train.eval_interval": "3",
         "train.objective": "dpo", "train.dpo_beta": "0.5", "data.packing": "pad",
         "batch.micro_batch_size": "4", "batch.gradient_accumulation_steps": "1"}
"""Global batch 4 pairs (8 rows of 128 tokens), as every layout below; beta 0.5 so that a few steps move the loss."""
LAYOUTS = {  # name: (reference, overrides); make test, one launch
    "dp2": ("dense", {"batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "2"}),
    "tp2-seqpar": ("dense", {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "pp2-1f1b": ("dense", {"parallel.pp": "2", "batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "4"}),
    "ep2": ("moe", {**MOE, "parallel.ep": "2", "batch.micro_batch_size": "2"}),
    "ipo-ring-sp2": ("ipo", {"train.dpo_loss": "ipo", "parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "copy-dp2-ga2": ("dense", {**COPY, "batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "2"}),
}
REFERENCES = {"dense": {}, "moe": MOE, "robust": {"train.dpo_loss": "robust", "train.dpo_label_smoothing": "0.1"},
              "ipo": {"train.dpo_loss": "ipo"}}
"""IPO on ring sp2: each rank holds half of every row, so a row's token count is summed over the sp group. The frozen
copy (``train.dpo_reference = "copy"``) is compared with the precomputed reference's one process ("dense"): the two
references are equal."""
SLOW_LAYOUTS = {  # make test-slow, one launch: the frozen copy sharded as the policy, and the layouts whose
    # mechanism a make-test layout already crosses (FSDP2 and Ulysses: the SFT layouts; ring: IPO's; the robust loss: dp2)
    "fsdp2-dp2": ("dense", {"batch.micro_batch_size": "2", "parallel.zero_stage": "3"}),
    "ulysses-sp2": ("dense", {"parallel.sp": "2", "parallel.sp_mode": "ulysses"}),
    "ring-sp2": ("dense", {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "robust-dp2-ga2": ("robust", {"train.dpo_loss": "robust", "train.dpo_label_smoothing": "0.1",
                                  "batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "2"}),
    "copy-fsdp2-dp2": ("dense", {**COPY, "batch.micro_batch_size": "2", "parallel.zero_stage": "3"}),
    "copy-tp2-seqpar": ("dense", {**COPY, "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
    "copy-pp2-1f1b": ("dense", {**COPY, "parallel.pp": "2", "batch.micro_batch_size": "1",
                                "batch.gradient_accumulation_steps": "4"}),
    "copy-ring-sp2": ("dense", {**COPY, "parallel.sp": "2", "parallel.sp_mode": "ring"}),
}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-60, 0), min_size=4, max_size=4), st.lists(st.floats(-60, 0), min_size=4, max_size=4),
       st.floats(0.01, 2.0), st.floats(0.0, 0.45))
def test_losses_are_the_papers_equations(policy, reference, beta, eps):
    """Rafailov et al. 2023, Eq. 7, Chowdhury et al. 2024's de-biased loss and Azar et al. 2023's IPO (Eq. 17, each
    log-ratio per completion token as TRL computes it), written out per pair in float64."""
    pi, ref = torch.tensor(policy, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    counts = [3.0, 7.0, 1.0, 12.0]
    losses, _ = dpo_loss(pi, ref, beta, "ipo", counts=torch.tensor(counts, dtype=torch.float64))
    for k in range(2):
        h = ((policy[2 * k] - reference[2 * k]) / counts[2 * k]
             - (policy[2 * k + 1] - reference[2 * k + 1]) / counts[2 * k + 1])
        assert float(losses[k]) == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-9, abs=1e-12)
    for loss_type, smoothing in (("sigmoid", 0.0), ("robust", eps)):
        losses, metrics = dpo_loss(pi, ref, beta, loss_type, smoothing)
        for k in range(2):
            h = (policy[2 * k] - reference[2 * k]) - (policy[2 * k + 1] - reference[2 * k + 1])
            want = -math.log(sig(beta * h)) if loss_type == "sigmoid" else (
                (-(1 - eps) * math.log(sig(beta * h)) + eps * math.log(sig(-beta * h))) / (1 - 2 * eps))
            assert float(losses[k]) == pytest.approx(want, rel=1e-9, abs=1e-12)
            chosen, rejected = beta * (policy[2 * k] - reference[2 * k]), beta * (policy[2 * k + 1] - reference[2 * k + 1])
            assert metrics[k].tolist() == pytest.approx([chosen, rejected, float(chosen > rejected), chosen - rejected],
                                                        rel=1e-9, abs=1e-12)


PAIRS = 64
"""Pairs trained on: the first 64 of the ~130 that :func:`prepared_plays` cuts from its lines (6 of them validation).
Every trainer computes the reference log-probability of every train pair before step 1 (each layout twice: for its
step-1 gradients, then for its run), which took most of this file's time with all of them; 3 steps of 4 pairs need
few."""


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> Path:
    """The first :data:`PAIRS` pairs of :func:`prepared_plays`, prepared with its tokenizer."""
    from meshtrain.data.preprocess import prepare

    root = tmp_path_factory.mktemp("dpo_data")
    prepared_plays(root, "preference")  # writes root/records.jsonl (every pair) and root/bpe.json (its tokenizer)
    records = (root / "records.jsonl").read_text().splitlines()
    assert len(records) > PAIRS
    (root / "first.jsonl").write_text("".join(line + "\n" for line in records[:PAIRS]))
    prepare(str(root / "bpe.json"), [str(root / "first.jsonl")], root / "first", data_format="preference",
            val_fraction=0.1)
    return root / "first"


def _model(reference: str, data: Path) -> dict[str, str]:
    return {**MODEL, **REFERENCES[reference], "data.path": str(data)}


class _References(dict):
    """One process's run of each :data:`REFERENCES` entry, trained the first time a test asks for it (make test
    needs fewer of them than make test-slow)."""

    def __init__(self, root: Path, data: Path):
        super().__init__()
        self.root, self.data = root, data

    def __missing__(self, name: str):
        self[name] = reference_run(self.root / name, _model(name, self.data))
        return self[name]


@pytest.fixture(scope="module")
def references(pair_data, tmp_path_factory):
    return _References(tmp_path_factory.mktemp("dpo_reference"), pair_data)


@pytest.fixture(scope="module")
def launched(pair_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_layouts")
    return root, launch_layouts(2, root, {name: {**_model(ref, pair_data), **overrides}
                                          for name, (ref, overrides) in LAYOUTS.items()})


@pytest.fixture(scope="module")
def launched_slow(pair_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_slow")
    return launch_layouts(2, root, {name: {**_model(ref, pair_data), **overrides}
                                    for name, (ref, overrides) in SLOW_LAYOUTS.items()})


def dpo_loss_tolerance(overrides: dict[str, str]) -> float:
    """How far two layouts' DPO losses of one step may lie apart from rounding alone (nats).

    A DPO loss is a function of h, a difference of four sequence log-probabilities of ~-7 nats a token (log V) summed
    over up to T tokens: hundreds of nats that cancel, so the contract's 1e-5 relative (a mean of B*T terms) does not
    hold. Each token's log-probability is computed in another summation order (tp's vocabulary split, sp's sequence
    split, another batch): ~sqrt(n_embd * n_layer) * 2**-24 of |log V| in practice (Higham 2002, Sec. 4.2); a row
    sums T such errors, ~sqrt(T) of one; h takes four rows, ~2 rows' worth; d loss / d h <= beta (sigmoid; robust:
    beta / (1 - 2 eps); IPO: 2 |h' - 1 / (2 beta)| / n <= 2 (1 / (2 beta) + 1) while |h'| <= 1, n >= 1 tokens). A
    dropped or doubled pair moves a later step's mean loss by ~1e-2 here, and the step-1
    gradients (1e-5 of their norm) catch a wrong scale."""
    m = {**MODEL, **overrides}
    per_token = math.sqrt(int(m["model.n_embd"]) * int(m["model.n_layer"])) * 2**-24 * math.log(int(m["model.vocab_size"]))
    beta = float(m["train.dpo_beta"])
    slope = (2 * (1 / (2 * beta) + 1) if m.get("train.dpo_loss") == "ipo"
             else beta / (1 - 2 * float(m.get("train.dpo_label_smoothing", "0"))))
    return slope * 2 * math.sqrt(int(m["model.block_size"])) * per_token


def assert_layout_matches(got_run: tuple, want_run: tuple, reference: str, overrides: dict[str, str]) -> None:
    """Every step's loss within :func:`dpo_loss_tolerance`, the step-1 gradients and the final parameters as the
    correctness contract says."""
    (got, grads, params), (want, want_grads, want_params) = got_run, want_run
    assert got.keys() == want.keys() and len(got) == STEPS
    tol = dpo_loss_tolerance(REFERENCES[reference] | overrides)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=tol), f"step {step}: {got[step]} vs {want[step]}"
    assert_close_grads(grads, want_grads)
    assert_close_params(params, want_params, atol=adamw_drift_bound(_model(reference, Path()) | overrides))


@pytest.mark.parametrize("name", LAYOUTS)
def test_dpo_layout_matches_one_process(references, launched, name):
    reference, overrides = LAYOUTS[name]
    assert_layout_matches(launched[1][name], references[reference], reference, overrides)


def test_a_frozen_copy_equals_the_precomputed_reference_on_one_process(references, pair_data, tmp_path):
    """train.dpo_reference = "copy" on one process (a second model, frozen, run forward on every micro-batch) against
    the precomputed reference ("dense"): the same reference values, so the same losses, gradients and parameters. The
    2-rank comparison is the layout "copy-dp2-ga2" above (DDP leaves the frozen copy unwrapped)."""
    got = reference_run(tmp_path / "copy", _model("dense", pair_data) | COPY)
    assert_layout_matches(got, references["dense"], "dense", COPY)
    assert not (tmp_path / "copy" / "reference_logps.json").exists()  # nothing precomputed, nothing written
    first = next(r for r in read_records(tmp_path / "copy") if r.get("step") == 1 and "loss" in r)
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the copy is the starting policy


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_LAYOUTS)
def test_slow_dpo_layout_matches_one_process(references, launched_slow, name):
    """FSDP2 dp2, Ulysses and ring sp2 with the sigmoid loss, the robust loss at dp2 x GA2, and the frozen copy
    under FSDP2 (sharded and gathered as the policy), tp2 with sequence parallelism, a pipeline (the copy's chunks run
    forward-only) and ring sp2, each against one process with the precomputed reference."""
    reference, overrides = SLOW_LAYOUTS[name]
    assert_layout_matches(launched_slow[name], references[reference], reference, overrides)


def test_first_step_is_ln2_and_the_records_hold_the_rewards(launched):
    """With the reference the starting model, every pair's first loss is -log sigmoid(0) = ln 2 and its rewards 0;
    the records carry TRL's reward metrics, and the validation ones."""
    records = read_records(launched[0] / "dp2")
    first = next(r for r in records if r.get("step") == 1 and "loss" in r)
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)  # sums of ~100 float32 log-probabilities, twice
    assert first["rewards_chosen"] == pytest.approx(0, abs=1e-4) and first["pairs"] == 4
    later = [r for r in records if "loss" in r and r["step"] > 1]
    assert later and all(abs(r["loss"] - math.log(2)) > 1e-4 for r in later)
    val = [r for r in records if "val_loss" in r]
    assert val and {"val_reward_accuracy", "val_rewards_chosen", "val_reward_margin"} <= set(val[-1])


@pytest.mark.parametrize("loss_type", ["sigmoid", pytest.param("ipo", marks=pytest.mark.slow)])
def test_dpo_steps_equal_trls_dpo_trainer(tmp_path, loss_type):
    """TRL's own DPOTrainer and meshtrain, from one tiny Qwen3 and one ChatML tokenizer, on the same pairs: three
    plain-SGD steps, each taking every train pair (so neither's data order matters), with DPO's sigmoid loss and (in
    `make test-slow`) IPO's, whose log-ratios are per completion token. The first loss is ln 2 (IPO: 1) on both;
    the next ones follow from each side's gradients, so equal losses after SGD steps mean equal gradients too, as
    the equal gradient norms say directly. The window (96 tokens) holds every sequence whole: a cut tail would
    change what meshtrain supervises."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    import torch.distributed as dist
    from meshtrain.config.load import load_config
    from meshtrain.data.preprocess import prepare
    from meshtrain.train.loop import Trainer
    from test_chat_data import MARKED, SENTENCES, hf_folder
    from test_hf import EPS32, logits_tolerance
    from test_qwen import saved

    tok = hf_folder(tmp_path / "tok", MARKED)
    model = saved(tmp_path / "model", "Qwen3ForCausalLM", vocab_size=384, head_dim=16, max_position_embeddings=128)
    say = lambda role, k: [{"role": role, "content": SENTENCES[k % len(SENTENCES)]}]  # noqa: E731
    pairs = [{"prompt": say("user", k), "chosen": say("assistant", k + 1), "rejected": say("assistant", k + 3)}
             for k in range(10)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prepare(str(tok), [str(tmp_path / "pairs.jsonl")], tmp_path / "data", data_format="preference", val_fraction=0.1)
    train = pairs[:9]  # the rule's val pair: floor((i + 1) * 0.1) > floor(i * 0.1) first at i = 9
    beta, lr, steps = 0.5, 0.05, 3
    cfg = load_config(None, {"model.init_from": str(model), "model.block_size": "96", "model.dropout": "0.0",
                             "data.path": str(tmp_path / "data"), "data.packing": "pad", "train.objective": "dpo",
                             "train.dpo_beta": str(beta), "train.dpo_loss": loss_type, "optim.name": "sgd", "optim.lr": str(lr),
                             "optim.min_lr": str(lr), "optim.warmup_steps": "0", "optim.weight_decay": "0",
                             "optim.grad_clip": "0", "batch.micro_batch_size": "9", "train.steps": str(steps),
                             "train.log_interval": "1", "train.eval_interval": "0", "train.dtype": "float32",
                             "checkpoint.interval": "0", "train.out_dir": str(tmp_path / "ours")})
    try:
        Trainer(cfg).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ours = [r for r in read_records(tmp_path / "ours") if "loss" in r]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=9, max_steps=steps,
                     learning_rate=lr, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
                     beta=beta, loss_type=[loss_type], precompute_ref_log_probs=True, logging_steps=1, report_to=[],
                     use_cpu=True, save_strategy="no", seed=0, bf16=False)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=args,
                         train_dataset=Dataset.from_list(train), processing_class=AutoTokenizer.from_pretrained(tok))
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, steps + 1))
    # The contract's 1e-5 relative, as between layouts (each side's rounding moves a step's loss and gradient by
    # less), plus the models' own difference: a sequence's log-probability sums <= 96 token terms, each within
    # 2 x the logits' tolerance (log-softmax is 1-Lipschitz in the max norm); h takes four, and d loss / d h <= beta.
    with torch.no_grad():
        peak = float(AutoModelForCausalLM.from_pretrained(model)(torch.arange(96)[None] % 384).logits.abs().max())
    logp_tol = 96 * 2 * logits_tolerance(2, 96, peak) + 96 * EPS32 * 100  # + the sum's own rounding (~100 nats)
    slope = beta if loss_type == "sigmoid" else 2 * (1 / (2 * beta) + 1)  # d loss / d h (IPO: while |h'| <= 1)
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=slope * 4 * logp_tol), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
        assert a["reward_accuracy"] == pytest.approx(b["rewards/accuracies"], abs=1e-6)
        for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected")):
            assert a[ours_key] == pytest.approx(b[trl_key], rel=1e-5, abs=beta * 2 * logp_tol), (a, b)


def test_the_planner_counts_two_sequences_a_pair_and_the_frozen_copy():
    """A DPO step runs two sequences a pair: the planner's layout of a DPO config has twice the micro-batch of the same
    config's language modelling. A frozen reference copy (train.dpo_reference = "copy") adds, to the precomputed
    reference's plan, exactly one more set of weights (fp32, 4 bytes each: all of them on every replica under DDP, a
    1/(dp*sp) shard under FSDP2), the forward's compute once more per micro-batch, and its FLOPs (a third of the model
    FLOPs of forward and backward) to the hardware's; nothing else."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.cost import hardware_flops, model_flops, step_time
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.layout import Layout, meshtrain_framework
    from meshtrain.planner.memory import PRECISIONS, stage_params, state_memory
    from meshtrain.planner.model_specs import from_config

    dpo = {"train.objective": "dpo", "data.packing": "pad", "batch.micro_batch_size": "3"}
    lm = Layout.from_config(load_config(None, {"batch.micro_batch_size": "3"}), 2)
    assert Layout.from_config(load_config(None, dpo), 2).micro_batch_size == 2 * lm.micro_batch_size == 6
    hw, fp32 = get_hardware("h100"), PRECISIONS["fp32"]
    for zero in (0, 3):
        cfgs = [load_config(None, dpo | {"parallel.zero_stage": str(zero), "train.dpo_reference": ref})
                for ref in ("precomputed", "copy")]
        (pre, copy), layout = [from_config(c) for c in cfgs], Layout.from_config(cfgs[0], 2)
        assert (pre.reference_copy, copy.reference_copy) == (False, True)
        fw = meshtrain_framework(cfgs[0], "cuda")
        a, b = state_memory(pre, layout, hw, fp32, fw), state_memory(copy, layout, hw, fp32, fw)
        held = stage_params(pre, layout, fw) / (layout.dp * layout.sp if zero >= 2 else 1)
        assert b.weights - a.weights == pytest.approx(4 * held, rel=1e-12)
        assert (b.grads, b.optimizer, b.gathered) == (a.grads, a.optimizer, a.gathered)
        ta, tb = step_time(pre, layout, hw, fp32, fw), step_time(copy, layout, hw, fp32, fw)
        assert tb.compute > ta.compute and (tb.dp_comm, tb.optimizer) == (ta.dp_comm, ta.optimizer)
        samples = layout.global_batch_size
        assert hardware_flops(copy, samples, "none") - hardware_flops(pre, samples, "none") == pytest.approx(
            model_flops(pre, samples) / 3, rel=1e-12)


@pytest.mark.parametrize("reference", ["precomputed", "copy"])
def test_auto_layout_plans_dpo_in_whole_pairs(reference):
    """--layout auto on a DPO config: it searches in sequences (the global batch of 12 pairs is 24) and keeps only
    micro-batches of whole pairs; the overrides it hands the trainer are in pairs again (micro_batch_size *
    gradient_accumulation_steps * dp = the config's 12), and a pinned micro-batch is in pairs too."""
    from meshtrain.config.load import load_config
    from meshtrain.launch import auto

    cfg = load_config(None, {"train.objective": "dpo", "data.packing": "pad", "batch.micro_batch_size": "3",
                             "batch.gradient_accumulation_steps": "2", "train.dpo_reference": reference})
    for fixed in ({}, {"micro_batch_size": 3}):
        choice = auto.choose_layout(cfg, 2, 2, 1, fixed)
        assert choice.global_batch_size == 12 and choice.best.layout.global_batch_size == 24
        assert all(e.layout.micro_batch_size % 2 == 0 for e in (choice.best, choice.runner_up) if e is not None)
        o = choice.overrides()
        assert int(o["batch.micro_batch_size"]) * int(o["batch.gradient_accumulation_steps"]) * int(o["parallel.dp"]) == 12
        assert not fixed or o["batch.micro_batch_size"] == "3"
        assert "pairs" in choice.lines()[0]
