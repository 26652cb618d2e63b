"""Muon (docs/optimizers.md): one process equals ``torch.optim.Muon``; the fp32 Newton-Schulz equals its polynomial
on the singular values; Muon takes the blocks' matrices and AdamW the rest; and sharded matrices (FSDP2, tp, both,
experts) are updated bit for bit as whole ones, each orthogonalized once (``tests/muon_worker.py``, 4 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import CONFIG, ROOT, TINY
from meshtrain.config.load import load_config
from meshtrain.errors import ConfigError
from meshtrain.optim.build import build_optimizer, param_groups
from meshtrain.optim.muon import Muon, newton_schulz
from meshtrain.optim.table import NS_COEFFICIENTS, TABLE, muon_lr_ratio, takes_muon

SHAPES = [(32, 48), (64, 16), (20, 20), (8, 96)]
LR, STEPS = 0.02, 4
BF16_ULP = 2.0 ** -7
"""One bf16 ulp at magnitudes in [1, 2): Newton-Schulz's output has singular values <= 1.21 (its polynomial's
maximum on [0, 1.21], p(0.5545) = 1.2025), so every element is < 2 and its bf16 rounding is at most this."""


def _grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _run(optimizer, params, grads):
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_process_equals_torch_muon(adjust, nesterov):
    """Same matrices, gradients and hyperparameters, 4 steps, Newton-Schulz in bf16 as torch runs it. Tolerance:
    each step's update can differ by at most one bf16 ulp of Newton-Schulz's output (:data:`BF16_ULP`) times the
    step's learning rate, so ``STEPS * lr * ratio * ulp`` over the run (the two run the same operations in the same
    order here, and agree exactly on this machine)."""
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    ours = [torch.nn.Parameter(w.clone()) for w in start]
    theirs = [torch.nn.Parameter(w.clone()) for w in start]
    hyper = {"lr": LR, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov}
    grads = _grads(SHAPES, STEPS)
    _run(Muon([{"params": ours}], lr_adjust=adjust, **hyper), ours, grads)
    _run(torch.optim.Muon(theirs, adjust_lr_fn=adjust, **hyper), theirs, grads)
    for a, b, w, shape in zip(ours, theirs, start, SHAPES):
        bound = STEPS * LR * muon_lr_ratio(adjust, shape) * BF16_ULP
        torch.testing.assert_close(a.data, b.data, rtol=0, atol=bound)
        assert (a.data - w).abs().max() > 10 * bound  # it moved, by far more than the tolerance


def test_expert_stack_is_one_newton_schulz_per_expert():
    """A (E, A, B) stack is E matrices: each expert's update equals torch.optim.Muon's on that expert alone (the
    learning-rate ratio from the matrix's (A, B)); the same one-ulp-per-step bound."""
    torch.manual_seed(0)
    stack = torch.randn(3, 24, 40)
    ours = torch.nn.Parameter(stack.clone())
    theirs = [torch.nn.Parameter(stack[e].clone()) for e in range(3)]
    grads = _grads([(3, 24, 40)], STEPS)
    hyper = {"lr": LR, "weight_decay": 0.1, "momentum": 0.95}
    _run(Muon([{"params": [ours]}], lr_adjust="match_rms_adamw", **hyper), [ours], grads)
    _run(torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **hyper), theirs,
         [[g[0][e] for e in range(3)] for g in grads])
    bound = STEPS * LR * muon_lr_ratio("match_rms_adamw", (24, 40)) * BF16_ULP
    torch.testing.assert_close(ours.data, torch.stack([t.data for t in theirs]), rtol=0, atol=bound)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 16)])
def test_float32_newton_schulz_is_its_polynomial_on_the_singular_values(shape):
    """Newton-Schulz applies an odd polynomial to U, so ``NS(U) = P diag(p5(s / |U|_F)) Q^T`` for U's SVD
    ``P diag(s) Q^T``, with p5 five rounds of ``p(x) = a x + b x^3 + c x^5`` (Jordan et al. 2024): the reference,
    in float64 from the SVD, shares no code with the iteration. Tolerance: fp32 rounding (2**-24) of sums of at most
    96 terms per matmul, 3 matmuls per round, amplified by at most |p'| <= a = 3.4445 per round over 5 rounds
    (3.4445**5 = 487): 487 * 5 * 3 * 96 * 2**-24 = 4.2e-3; in practice ~1e-6, and a wrong coefficient or a missed
    transpose is off by 0.1 or more."""
    torch.manual_seed(0)
    u = torch.randn(shape)
    ours = newton_schulz(u, 5, torch.float32).double()
    p, s, qt = torch.linalg.svd(u.double(), full_matrices=False)
    x = s / u.double().norm(dim=(-2, -1), keepdim=True).squeeze(-1)
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        x = a * x + b * x ** 3 + c * x ** 5
    want = p @ torch.diag_embed(x) @ qt
    torch.testing.assert_close(ours, want, rtol=0, atol=487 * 5 * 3 * 96 * 2.0 ** -24)
    assert float(x.max()) <= 1.2025 + 1e-3 and float(x.min()) > 0.5  # Jordan's range of the singular values


@pytest.mark.parametrize("family, overrides", [
    ("gpt", {}), ("llama", {"model.tie_embeddings": "false"}), ("mixtral", {}),
    ("qwen2_moe", {"model.shared_expert_ffn": "32"}), ("lstm", {})])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(family, overrides):
    """Every trained parameter is in exactly one group; Muon's are the 2-D and 3-D parameters under ``blocks``
    except routers and a shared expert's one-row gate; AdamW's matrices are decayed, vectors not."""
    from meshtrain.models.build import build_model

    cfg = load_config(CONFIG, {**TINY, "model.type": family, "optim.name": "muon", **overrides})
    model = build_model(cfg.model, 96)
    named = dict(model.named_parameters())
    groups = param_groups(named.items(), cfg.optim)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in named.values())  # each once
    by_id = {id(p): n for n, p in named.items()}
    muon = {by_id[id(p)] for g in groups if g.get("muon") for p in g["params"]}
    want = {n for n, p in named.items() if n.startswith("blocks.") and p.dim() in (2, 3)
            and "router" not in n and "shared_gate" not in n}
    assert muon == want
    assert all(not n.startswith(("tok_emb", "pos_emb", "lm_head")) for n in muon)
    assert muon  # every family has hidden matrices (the recurrent family's gate matrices too)
    for g in groups:
        if not g.get("muon"):
            assert g["weight_decay"] == (cfg.optim.weight_decay if g["params"][0].dim() >= 2 else 0.0)


def test_the_rule_reads_names_under_any_wrapper():
    assert takes_muon("module._orig_mod.blocks.3.attn.q.weight", (64, 64))
    assert not takes_muon("blocks.0.mlp.router.weight", (8, 64))
    assert not takes_muon("blocks.0.mlp.shared_gate.weight", (1, 64))
    assert not takes_muon("tok_emb.weight", (96, 64))
    assert takes_muon("blocks.0.mlp.experts.w_up", (8, 64, 32))


def test_muon_adamw_lr_sets_the_rests_learning_rate():
    cfg = load_config(CONFIG, {**TINY, "optim.name": "muon", "optim.lr": "0.02", "optim.muon_adamw_lr": "0.003"})
    from meshtrain.models.build import build_model

    optimizer, scheduler = build_optimizer(build_model(cfg.model, 96).named_parameters(), cfg, 12)
    lrs = {g["muon"]: g["initial_lr"] for g in optimizer.param_groups}
    assert lrs == {True: 0.02, False: 0.003}
    assert isinstance(optimizer, Muon) and TABLE["muon"].states == 1


@pytest.mark.parametrize("key, value", [("muon_momentum", "1.0"), ("muon_ns_steps", "0"), ("muon_ns_dtype", "fp16"),
                                        ("muon_lr_adjust", "rms"), ("muon_exchange", "all"), ("muon_adamw_lr", "-1"),
                                        ("name", "lion")])
def test_a_bad_muon_key_is_one_line(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, {f"optim.{key}": value})
    assert f"optim.{key}" in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon") / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(ROOT / "tests" / "muon_worker.py"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


LAYOUTS = ["fsdp2-dp4", "fsdp2-dp2", "tp2", "fsdp2-tp2", "experts-by-rows"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("exchange", ["owner", "gather"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_muon_equals_whole_muon_bit_for_bit(sharded, layout, exchange, dtype):
    """The owner assembles exactly the numbers one process holds (the momentum is elementwise, the shards are moved,
    not summed) and runs the same Newton-Schulz on them; the update's shards go back unchanged: equal bit for bit."""
    assert sharded[f"{layout}/{exchange}/{dtype}"]["max_abs_diff"] == 0.0


def test_the_owner_exchange_in_buckets_is_the_same_update(sharded):
    """With buckets of 4 KiB the three sharded matrices of FSDP2 dp4 go one bucket each: 2 all-to-alls a bucket and
    step, and the same parameters bit for bit."""
    got = sharded["fsdp2-dp4/owner/float32/buckets"]
    assert got["max_abs_diff"] == 0.0 and got["all_to_all_calls"] == 2 * 3 * 3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_owner_exchange_is_two_all_to_alls_and_no_repeated_newton_schulz(sharded, layout):
    """Per step: one all-to-all gathers, one returns (3 steps); the gather way uses none (DTensor's all-gather).
    Newton-Schulz FLOPs: the gather way repeats every matrix on every rank; the owner way runs each sharded matrix
    once among the ranks that share it: fewer FLOPs in all, and no rank does more than the gather way's each."""
    owner, gather = sharded[f"{layout}/owner/float32"], sharded[f"{layout}/gather/float32"]
    assert owner["all_to_all_calls"] == 2 * 3 and gather["all_to_all_calls"] == 0
    assert sum(owner["ns_flops_per_rank"]) < sum(gather["ns_flops_per_rank"])
    assert max(owner["ns_flops_per_rank"]) <= min(gather["ns_flops_per_rank"])
    if layout == "fsdp2-dp4":  # all four ranks share every matrix: the four together do the whole model's once
        assert sum(owner["ns_flops_per_rank"]) == sharded["whole_ns_flops"]


@pytest.mark.parametrize("rank, taken", [(4, True), (1, False)])
def test_muon_trains_lora_adapters_of_rank_two_or_more(rank, taken):
    """With LoRA the base is frozen: only the adapters train, and they are matrices inside the blocks, so Muon takes
    them (rank >= 2) or leaves a rank-1 pair, a vector each, to AdamW."""
    from meshtrain.adapters.apply import adapt
    from meshtrain.models.build import build_model

    cfg = load_config(CONFIG, {**TINY, "model.type": "llama", "optim.name": "muon", "adapter.lora_rank": str(rank),
                               "adapter.lora_targets": "all-linear"})
    model = build_model(cfg.model, 96)
    adapt(model, cfg.adapter, cfg.model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    groups = param_groups(model.named_parameters(), cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in groups if g.get("muon") for p in g["params"]}
    rest = {names[id(p)] for g in groups if not g.get("muon") for p in g["params"]}
    adapters = {n for n in names.values() if "lora_" in n}
    assert (muon, rest) == ((adapters, set()) if taken else (set(), adapters))


def test_the_planner_counts_the_trainers_bucket():
    from meshtrain.optim import muon
    from meshtrain.planner.optimizer import BUCKET_BYTES

    assert BUCKET_BYTES == muon.BUCKET_BYTES
