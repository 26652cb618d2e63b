"""The planner reads ``optim.name`` (issue 55, section 3): its memory and step time follow the optimizer's row of
:data:`meshtrain.optim.table.TABLE` (:mod:`meshtrain.planner.optimizer`), so SGD and Muon are no longer planned as
AdamW, and AdamW's numbers are the old formulas' to the last bit.

The parameters Muon takes are counted here independently of the planner: the trainer's own model is built with
torch and :func:`meshtrain.optim.table.takes_muon` is applied to its ``named_parameters`` (the trainer's rule), while
the planner derives them from the family's shapes (:func:`meshtrain.planner.optimizer.block_matrices`)."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from conftest import CONFIG, ROOT, TINY
from meshtrain.cli.main import main
from meshtrain.config.load import load_config
from meshtrain.optim.table import ADAMW_STATES, newton_schulz_flops, takes_muon
from meshtrain.planner.cost import optimizer_parts
from meshtrain.planner.hardware import catalog
from meshtrain.planner.layout import MESHTRAIN, Layout, meshtrain_framework
from meshtrain.planner.memory import PRECISIONS, memory_breakdown, state_memory, trained_params
from meshtrain.planner.model_specs import from_config, preset
from meshtrain.planner.optimizer import OptimizerPlan, block_matrices, muon_groups, muon_work
from meshtrain.planner.search import states_lower_bound

VOCAB = 96
H100 = catalog()["H100-SXM-80GB"]
FAMILIES = [("gpt", {}), ("llama", {"model.tie_embeddings": "false"}), ("mixtral", {}),
            ("qwen2_moe", {"model.shared_expert_ffn": "32"}), ("qwen3", {})]
"""The families the planner models, each with the parts Muon treats apart: plain matrices, an untied head, 3-D
expert stacks and a router, a shared expert with its one-row gate, q/k norms."""
LLAMA_405B = {"model.n_layer": "126", "model.n_embd": "16384", "model.n_head": "128", "model.n_kv_head": "8",
              "model.ffn_hidden": "53248", "model.block_size": "8192", "model.vocab_size": "128256"}
"""Llama 3 405B's shapes (Dubey et al. 2024, Table 3) as ``configs/llama_tiny.toml`` overrides."""


def _framework(name: str, exchange: str = "owner"):
    return replace(MESHTRAIN, optimizer=OptimizerPlan(name, exchange=exchange))


def _tiny(family: str, overrides: dict, optim: str = "adamw"):
    """(config, the planner's model, the trainer's named parameter shapes) of a tiny model of ``family``."""
    from meshtrain.models.build import build_model

    cfg = load_config(CONFIG, {**TINY, "model.type": family, "optim.name": optim, **overrides})
    shapes = {name: tuple(p.shape) for name, p in build_model(cfg.model, VOCAB).named_parameters()}
    return cfg, from_config(cfg, VOCAB), shapes


def _optimizer_bytes(model, layout: Layout, name: str, precision: str = "bf16") -> float:
    return memory_breakdown(model, layout, H100, PRECISIONS[precision], _framework(name)).optimizer


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_one_process_states_follow_the_row(family, overrides):
    """One process updates every parameter N: SGD keeps none of AdamW's two fp32 states, ``2 * 4 * N`` bytes fewer;
    Muon keeps one instead of two on the M parameters ``takes_muon`` gives it, ``4 * M`` fewer (the master copy of
    the bf16 precision is the same in all three). N and M are the torch model's: tied weights once, as
    ``named_parameters`` yields them. Both sides are sums of integers below 2^53 times small integers: exact."""
    _, model, shapes = _tiny(family, overrides)
    n = sum(math.prod(s) for s in shapes.values())
    m = sum(math.prod(s) for name, s in shapes.items() if takes_muon(name, s))
    one = Layout(dp=1)
    assert model.num_params() == n
    adamw = _optimizer_bytes(model, one, "adamw")
    assert adamw - _optimizer_bytes(model, one, "sgd") == ADAMW_STATES * 4 * n
    assert adamw - _optimizer_bytes(model, one, "muon") == 4 * m
    assert block_matrices(model).params() * model.layers == m  # the planner's shapes hold what Muon takes


def test_sharded_states_follow_the_row():
    """ZeRO and tp shard Muon's saving as they shard the states: FSDP over dp = 4 holds a quarter of every
    parameter (Mixtral's expert stacks included), tp = 2 half of a dense Llama's matrices (all of them column- or
    row-parallel) and all of its norms (replicated, AdamW's); SGD's saving is a quarter of ``8 N`` under FSDP. The
    planner subtracts floats of ~1e5-1e7 bytes: equal to a few ulps (rel 1e-15 is ~4.5 of them)."""
    _, moe, shapes = _tiny("mixtral", {})
    n = sum(math.prod(s) for s in shapes.values())
    m = sum(math.prod(s) for name, s in shapes.items() if takes_muon(name, s))
    fsdp = Layout(dp=4, zero_stage=3)
    adamw = _optimizer_bytes(moe, fsdp, "adamw")
    assert adamw - _optimizer_bytes(moe, fsdp, "muon") == pytest.approx(4 * m / 4, rel=1e-15)
    assert adamw - _optimizer_bytes(moe, fsdp, "sgd") == pytest.approx(8 * n / 4, rel=1e-15)
    _, llama, shapes = _tiny("llama", {"model.tie_embeddings": "false", "model.n_head": "2"})
    m = sum(math.prod(s) for name, s in shapes.items() if takes_muon(name, s))
    tp = Layout(dp=1, tp=2)
    assert _optimizer_bytes(llama, tp, "adamw") - _optimizer_bytes(llama, tp, "muon") == pytest.approx(4 * m / 2,
                                                                                                     rel=1e-15)


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_newton_schulz_of_one_process_is_every_matrix_once(family, overrides):
    """One process orthogonalizes each Muon parameter of the torch model once: the planner's FLOPs equal the sum
    of :func:`~meshtrain.optim.table.newton_schulz_flops` over them (integers below 2^53 summed in another order:
    equal to a few ulps)."""
    cfg, model, shapes = _tiny(family, overrides, "muon")
    plan = meshtrain_framework(cfg, "cuda").optimizer
    want = sum(newton_schulz_flops(s, plan.ns_steps) for name, s in shapes.items() if takes_muon(name, s))
    groups = muon_groups(model, model.layers, tp=1, dp_sp=1, ep=1, zero_stage=0, exchange=plan.exchange)
    assert muon_work(groups, plan, H100.device).flops == pytest.approx(want, rel=1e-13)


def _parts(model, layout: Layout, exchange: str = "owner"):
    return optimizer_parts(model, layout, H100, PRECISIONS["bf16-autocast"], _framework("muon", exchange))


def test_owner_exchange_splits_newton_schulz_over_the_ranks_sharing_a_matrix():
    """Llama 3 405B under FSDP over 64 ranks: "gather" orthogonalizes all 126 x 7 matrices on every rank (the
    total T), "owner" deals them out largest first to the least loaded rank, so the busiest rank's share is at
    least T/64 and at most T/64 plus the largest matrix (Graham 1969: the last matrix dealt to the busiest rank
    went to the least loaded one, loaded at most T/64 then). DDP's replicas each orthogonalize all of them, ZeRO-1
    deals them out like the owners. The owner exchange (two all-to-alls of a rank's bf16 shards) moves less than
    gathering every fp32 matrix."""
    model = preset("llama3-405b")
    steps = OptimizerPlan("muon").ns_steps
    largest = max(newton_schulz_flops(s, steps) for s in block_matrices(model).split)
    fsdp = Layout(dp=64, zero_stage=3)
    plan = OptimizerPlan("muon")
    owner = muon_work(muon_groups(model, model.layers, 1, 64, 1, 3, "owner"), plan, H100.device)
    gather = muon_work(muon_groups(model, model.layers, 1, 64, 1, 3, "gather"), plan, H100.device)
    total = gather.flops
    assert total / 64 <= owner.flops <= total / 64 + largest
    assert muon_work(muon_groups(model, model.layers, 1, 8, 1, 0, "owner"), plan, H100.device).flops == total
    assert total / 8 <= muon_work(muon_groups(model, model.layers, 1, 8, 1, 1, "owner"), plan,
                                  H100.device).flops <= total / 8 + largest
    owner_time, gather_time = _parts(model, fsdp), _parts(model, fsdp, "gather")
    assert owner_time.newton_schulz < gather_time.newton_schulz / 32
    assert 0 < owner_time.exchange < gather_time.exchange
    assert _parts(model, Layout(dp=1)).exchange == 0.0  # whole matrices: nothing to exchange


def test_more_ranks_than_matrices_leave_the_largest_matrix_on_the_busiest_rank():
    """Owners of 2 blocks' 14 matrices over tp 8 x dp 16 = 128 ranks: each rank owns at most one, and the busiest
    orthogonalizes the largest (an MLP matrix), whatever the rank count beyond 14."""
    model = preset("llama3-405b")
    plan = OptimizerPlan("muon")
    largest = max(newton_schulz_flops(s, plan.ns_steps) for s in block_matrices(model).split)
    work = muon_work(muon_groups(model, 2, 8, 16, 1, 3, "owner"), plan, H100.device)
    assert work.flops == largest


@pytest.mark.parametrize("layout", [Layout(dp=1), Layout(dp=8, zero_stage=1), Layout(dp=8, tp=8, pp=2, zero_stage=3,
                                                                                    gradient_accumulation_steps=4)])
def test_adamw_is_planned_by_the_old_formulas(layout):
    """AdamW's states, step temporaries and step time, computed here by the formulas the planner had before it read
    the optimizer: ``updated * optimizer_bytes``, one fp32 temporary per updated parameter (torch's foreach AdamW),
    and ``updated * (2 (w + o) + 3 g) / bandwidth`` plus the host time per tensor; the same floats."""
    model, prec, hw = preset("llama3-70b"), PRECISIONS["bf16"], H100
    fw = _framework("adamw")
    shard = layout.dp * layout.sp if layout.zero_stage >= 1 else 1
    updated = trained_params(model, layout, fw) / shard  # ZeRO's shard: the rank's parameters / (dp*sp), no experts
    states = state_memory(model, layout, hw, prec, fw)
    assert states.optimizer == updated * prec.optimizer_bytes
    assert states.optimizer_peak == updated * 4
    per_tensor = (hw.device.sharded_tensor_update_host_s if layout.zero_stage >= 2 else hw.device.tensor_update_host_s)
    old = (updated * (2 * (prec.weight_bytes + prec.optimizer_bytes) + 3 * prec.grad_bytes) / hw.device.bandwidth()
           + per_tensor * model.param_tensors() / layout.pp)
    parts = optimizer_parts(model, layout, hw, prec, fw)
    assert parts.total == old and parts.newton_schulz == parts.exchange == 0.0
    if layout.pp == 1:  # no framework: AdamW (and, under a pipeline, Megatron's uniform split instead of the trainer's)
        assert optimizer_parts(model, layout, hw, prec) == parts


def test_lower_bound_stays_below_every_optimizers_memory():
    """The search prunes by :func:`states_lower_bound`; with fewer states per parameter it must still bound the
    memory from below (SGD and Muon), or the search would drop layouts that fit."""
    model, prec = preset("llama3-70b"), PRECISIONS["bf16"]
    for name in ("adamw", "sgd", "muon"):
        fw = _framework(name)
        for layout in (Layout(dp=8, tp=8, zero_stage=0), Layout(dp=64, zero_stage=3), Layout(dp=4, tp=8, pp=2)):
            bound = states_lower_bound(model, layout.tp, layout.pp, layout.dp * layout.sp, layout.zero_stage, H100,
                                       prec, fw)
            assert bound <= memory_breakdown(model, layout, H100, prec, fw).total, (name, layout)


@pytest.mark.parametrize("name", ["muon", "sgd"])
def test_a_search_plans_the_optimizer_as_one_layout_alone(name):
    """``--layout auto`` and ``plan`` rank layouts by :func:`meshtrain.planner.search.search`, which shares a memo of
    the model states between layouts: with Muon's count and temporaries in them, every estimate is still the one
    computed alone (the memo's key holds what they read), and the search's memory is each layout's own."""
    from meshtrain.planner.estimate import Job, estimate
    from meshtrain.planner.search import search

    model, prec, fw = preset("mixtral-8x7b"), PRECISIONS["bf16"], _framework(name)
    job = Job(num_devices=16, global_batch_size=32, token_budget=1e9)
    found = search(model, H100, prec, fw, job, keep_unfit=True)
    assert found
    for e in found:
        assert e == estimate(model, e.layout, H100, prec, fw, job, checked=True)


def test_layout_auto_plans_the_configs_optimizer():
    """``--layout auto`` (:func:`meshtrain.launch.auto.choose_layout`) and the plan of a config take the framework
    from :func:`meshtrain_framework`, which now carries the config's ``[optim]``."""
    cfg = load_config(CONFIG, {**TINY, "optim.name": "muon", "optim.muon_exchange": "gather",
                               "optim.muon_ns_dtype": "float32"})
    assert meshtrain_framework(cfg, "cuda").optimizer == OptimizerPlan("muon", 5, "float32", "gather")
    assert meshtrain_framework(load_config(CONFIG, TINY), "cpu").optimizer == OptimizerPlan()


LINE = re.compile(r"Optimizer (\w+): ([\d.e+-]+) s/step \(([\d.]+)% of the step\)(.*); states ([\d.]+) GiB/device\.")


def _explain(capsys, name: str) -> tuple[str, float, float, str, float]:
    """``meshtrain plan`` of a 405B Llama config with ``optim.name = name`` on 1024 H100s, one layout explained:
    its optimizer line (name, seconds, percent, Muon's parts, GiB of states)."""
    layout = "tp=8,pp=16,dp=8,zero_stage=0,micro_batch_size=1,gradient_accumulation_steps=64,recompute=full"
    args = [str(ROOT / "configs" / "llama_tiny.toml"), *(x for k, v in LLAMA_405B.items() for x in (f"--{k}", v)),
            "--optim.name", name, "--gpu", "H100-SXM-80GB", "--num-gpus", "1024", "--global-batch-size", "512",
            "--explain", layout]
    assert main(["plan", *args]) == 0
    found = LINE.search(capsys.readouterr().out)
    assert found, "the plan shows the optimizer's line"
    return found[1], float(found[2]), float(found[3]), found[4], float(found[5])


def test_plan_of_a_405b_layout_shows_the_optimizers_share(capsys):
    """The explained layout prints the optimizer's seconds, share of the step and states. Muon's line adds up its
    parts (each printed to 3 significant digits: within 0.5% of the total), its share exceeds AdamW's (8 blocks'
    Newton-Schulz split over tp = 8 ranks), and its states are about half of AdamW's (bf16 autocast keeps fp32
    weights as the master: AdamW 8 bytes per parameter, Muon 4 on its matrices, ~99% of a 405B's parameters)."""
    name, adamw_s, adamw_pct, rest, adamw_gib = _explain(capsys, "adamw")
    assert name == "adamw" and rest == "" and 0 < adamw_pct < 1
    name, muon_s, muon_pct, rest, muon_gib = _explain(capsys, "muon")
    parts = [float(x) for x in re.findall(r"([\d.e+-]+) s\b", rest)]
    assert name == "muon" and len(parts) == 3 and sum(parts) == pytest.approx(muon_s, rel=5e-3)
    assert muon_pct > adamw_pct and muon_s > adamw_s
    assert 0.49 < muon_gib / adamw_gib < 0.51
