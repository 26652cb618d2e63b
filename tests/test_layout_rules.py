"""One rule book (``meshtrain.rules.layout``): the planner's ``meshtrain`` stack accepts exactly the layouts that
``meshtrain train`` accepts.

Random models of three families (a GPT, a Llama with grouped-query attention and its own MLP width, a Mixtral) and
random layouts of every axis and mode the planner's ``Layout`` holds are judged twice: by the trainer's config
validation (``load_config`` and ``resolve_world`` for the layout's ranks) and by the planner's rules
(``divisibility_errors`` and ``framework_errors`` of the ``meshtrain`` stack). The verdicts must be equal, case by case.
Of the other sync modes, DiLoCo's workers are drawn (its group, H, fragments, delay and precision).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshtrain.axes import PP_SCHEDULES, RECOMPUTE_MODES, SP_MODES, ZERO_STAGES
from meshtrain.config.checks import resolve_world
from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError
from meshtrain.planner.layout import FRAMEWORKS, Layout, divisibility_errors, framework_errors, meshtrain_framework
from meshtrain.planner.model_specs import from_config
from meshtrain.rules.layout import LayoutShape, layout_errors

CASES = 5000
"""Draws per run (about 0.5 ms each). On the code before the rule book, 118 of these 5000 were judged differently:
kv heads the planner let tp and Ulysses split that the trainer refused, chunked schedules at pp = 1, and MLP widths
tp does not divide, which the trainer accepted and then crashed on in its ranks."""


def draw_model(rng: random.Random) -> dict[str, str]:
    """``[model]`` overrides of a valid model: head counts with several divisors, kv heads dividing them, a Llama MLP
    width that is sometimes odd, 2-8 experts, a block size that 2, 3 or 4 chunks may or may not divide."""
    kind = rng.choice(["gpt", "llama", "mixtral"])
    heads = rng.choice([1, 2, 3, 4, 6, 8, 12])
    head_dim = rng.choice([4, 8])
    m = {"model.type": kind, "model.n_layer": str(rng.randint(1, 6)), "model.n_head": str(heads),
         "model.n_embd": str(heads * head_dim), "model.block_size": str(rng.choice([6, 8, 12, 16, 24, 30, 32])),
         "model.dropout": rng.choice(["0.0", "0.0", "0.1"])}
    if kind != "gpt":
        m["model.n_kv_head"] = str(rng.choice([d for d in range(1, heads + 1) if heads % d == 0]))
        m["model.ffn_hidden"] = str(rng.choice([0, 6, 9, 12, 16, 18, 24]))  # 0: Llama's rule
    if kind == "mixtral":
        experts = rng.randint(2, 8)
        m.update({"model.num_experts": str(experts), "model.num_experts_per_tok": str(rng.randint(1, min(2, experts)))})
    return m


def draw_layout(rng: random.Random) -> Layout:
    """A layout of one process to 48: every degree, schedule and mode, biased towards small degrees; one in five
    DiLoCo workers (group, H, F, tau, precision)."""
    pp = rng.choice([1, 1, 2])
    schedule = rng.choice(PP_SCHEDULES)
    diloco = {}
    if rng.random() < 0.2:
        diloco = dict(diloco_group=rng.choice([1, 2, 3, 4, 8]), diloco_inner_steps=rng.choice([1, 2, 4, 6]),
                      diloco_fragments=rng.choice([1, 1, 2, 3]), diloco_delay=rng.choice([0, 0, 1, 2]),
                      diloco_precision=rng.choice(["fp32", "bf16", "int8", "fp8"]))
    return Layout(**diloco, dp=rng.choice([1, 1, 2, 3, 4]), tp=rng.choice([1, 1, 2, 3, 4]), pp=pp, sp=rng.choice([1, 1, 2, 4]),
                  ep=rng.choice([1, 1, 2, 4]), zero_stage=rng.choice(ZERO_STAGES),
                  micro_batch_size=rng.randint(1, 2), gradient_accumulation_steps=rng.randint(1, 4),
                  recompute=rng.choice(RECOMPUTE_MODES), pp_schedule=schedule if pp > 1 or rng.random() < 0.2 else "1f1b",
                  virtual_stages=rng.choice([1, 1, 2]) if pp > 1 or rng.random() < 0.2 else 1,
                  tp_sequence_parallel=rng.random() < 0.3, sp_mode=(sp_mode := rng.choice(SP_MODES)),
                  sp_ulysses=rng.choice([1, 2, 2, 4]) if sp_mode == "usp" else 1,
                  hierarchical_allreduce=rng.random() < 0.1)


def trainer_verdict(model: dict[str, str], layout: Layout) -> str:
    """"" when ``meshtrain train --nproc WORLD`` accepts ``layout`` of ``model``, else its one-line refusal."""
    try:
        cfg = load_config(None, {**model, **layout.to_overrides()})
        resolve_world(cfg, layout.world_size)
    except ConfigError as e:
        return str(e)
    return ""


def planner_verdict(model: dict[str, str], layout: Layout) -> list[str]:
    """The planner's refusals of ``layout`` under the ``meshtrain`` stack (empty: it may rank it)."""
    cfg = load_config(None, model)
    spec = from_config(cfg, 65)
    return divisibility_errors(spec, layout) + framework_errors(meshtrain_framework(cfg), layout, spec)


def judged(seed: int) -> list[tuple[dict[str, str], Layout, str, list[str]]]:
    rng = random.Random(seed)
    return [(m, L, trainer_verdict(m, L), planner_verdict(m, L))
            for m, L in ((draw_model(rng), draw_layout(rng)) for _ in range(CASES))]


@pytest.fixture(scope="module")
def cases() -> list[tuple[dict[str, str], Layout, str, list[str]]]:
    return judged(seed=53)


def test_the_planner_accepts_exactly_what_the_trainer_accepts(cases):
    for model, layout, trainer, planner in cases:
        assert (trainer == "") == (planner == []), (model, layout.label(), trainer, planner)
        if trainer:  # the trainer's first refusal is one the planner gives too, word for word, or a check of its own
            assert trainer in planner or not any(word in trainer for word in ("n_head", "n_kv_head", "num_experts",
                                                                            "hidden width", "block_size")), \
                (model, layout.label(), trainer, planner)


def test_the_draws_cover_every_rule_both_ways(cases):
    """Not a test that cannot fail: the draws accept layouts, and each shape rule refuses some."""
    accepted = sum(1 for *_, trainer, _ in cases if not trainer)
    fired = Counter(rule for *_, planner in cases for line in planner for rule in
                    ("n_head", "n_kv_head", "hidden width", "num_experts", "borrows its ranks", "replicates its experts",
                     "block_size", "zero_stage = 1 is not supported with parallel.ep")
                    if rule in line)
    assert accepted >= 50, accepted
    assert sum(1 for _, layout, trainer, _ in cases if layout.diloco_group and not trainer) >= 3  # DiLoCo runs too
    assert all(fired[rule] >= 5 for rule in ("n_head", "n_kv_head", "hidden width", "num_experts", "borrows its ranks",
                                             "replicates its experts", "block_size")), fired


def test_other_stacks_are_the_trainer_with_their_differences():
    """Megatron replicates kv heads past tp and folds ep into tp; the trainer does neither. An NF4 base takes no tp in
    any stack."""
    shape = LayoutShape("model 'gqa'", heads=16, kv_heads=2, ffn_hidden=64, seq_len=32)
    tp4 = Layout(dp=1, tp=4)
    assert layout_errors(shape, tp4, dp=1) == [
        "model.n_kv_head = 2 is not divisible by parallel.tp = 4: tensor parallelism gives each tp rank whole kv heads "
        "(grouped-query attention); use a tp that divides 2"]
    assert layout_errors(shape, tp4, dp=1, replicate_kv_heads=True) == []
    assert layout_errors(shape, Layout(dp=1, tp=3), dp=1, replicate_kv_heads=True)  # 3 neither divides nor is a multiple
    moe = LayoutShape("model 'moe'", heads=4, kv_heads=4, ffn_hidden=0, seq_len=32, experts=8)
    folded = Layout(dp=2, tp=2, ep=4, tp_sequence_parallel=True)
    assert len(layout_errors(moe, folded, dp=2)) == 2 and layout_errors(moe, folded, dp=2, expert_folding=True) == []
    nf4 = LayoutShape("model 'qlora'", heads=4, kv_heads=4, ffn_hidden=64, seq_len=32, nf4_base=True)
    assert layout_errors(nf4, Layout(dp=1, tp=2), dp=1, replicate_kv_heads=True, expert_folding=True) == [
        "adapter.quantize_base = 'nf4' with parallel.tp = 2: an NF4 weight's blocks run along its rows, which tensor "
        "parallelism would cut; use tp = 1 (dp, FSDP2, pp and sp work)"]  # no stack differs: a rule of the weights
    model = from_config(load_config(None, {"model.type": "llama", "model.n_head": "16", "model.n_kv_head": "4",
                                           "model.n_embd": "128"}), 65)
    tp8 = Layout(dp=8, tp=8)  # the case: 4 kv heads, tp = 8
    assert framework_errors(FRAMEWORKS["meshtrain"], tp8, model) and not divisibility_errors(model, tp8)
    assert framework_errors(FRAMEWORKS["megatron-core"], tp8, model) == []


def test_a_pinned_diloco_group_is_ranked_only_on_degrees_that_hold_it(capsys):
    """``--fix diloco_group=8`` on 16 devices: the search checks DiLoCo's rules (whole replicas per worker) on each
    degree choice before costing it (it divided by zero on pp8 x sp2, whose replica of 16 ranks no worker holds)."""
    import json

    from meshtrain.cli.main import main

    assert main(["plan", "--model", "gpt2-small", "--gpu", "H100", "--num-gpus", "16", "--global-batch-size", "64",
                 "--fix", "diloco_group=8,diloco_inner_steps=32", "--json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(8 % (r["pp"] * r["sp"] * r["tp"]) == 0 for r in rows)
