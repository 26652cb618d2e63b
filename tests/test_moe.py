"""Mixture of experts (``models/moe``; the families ``mixtral`` and ``qwen3_moe``), checked against ``transformers`` and
against one process.

``transformers`` builds tiny random ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` models offline; their routers are
scaled up (the init's 0.02 gives near-uniform probabilities whose top-k a rounding could flip) and their norms
perturbed:

- imported logits equal ``transformers``' from the published per-expert files and from ``transformers`` 5's fused
  in-memory tensors saved as they are; import -> export is bit-identical and loads with no missing key;
- each layer's load-balancing loss equals ``transformers``' ``load_balancing_loss_func`` of that layer's router
  logits, and for one layer the model's auxiliary loss is ``transformers``' ``aux_loss``;
- the grouped GEMM equals the per-expert loop (outputs and gradients);
- DeepSeek-V3's routing biases move by the rate towards balance after each step, pick the experts but do not weigh
  them, and refuse a Hugging Face export;
- expert parallelism: experts split over ep = 2 ranks route, compute and differentiate as one process (the all-to-all
  dispatch alone);
- ``model.init_from`` into FSDP2 dp2 with and without routing biases (one launch; ring and Ulysses sp2,
  DDP, pp2 1F1B and ZBV, full and selective recomputation, tp2 (attention split, experts replicated), and ep2,
  ep2 x ring sp2, ep2 x USP sp2 (2 x 1) and sp4 (2 x 2), ep2 x FSDP2 dp4, ep2 x DDP dp4, ep4, ep2 x pp2 1F1B x ring sp2, ep2 x pp2 ZBV x sp2, ep2 x tp2,
  ep2 x tp2 x FSDP2 dp4 (8 ranks), ep2 with full recomputation, ep2 with compiled blocks and qwen2_moe ep2 x FSDP2
  dp2, each alone; all in ``make test-slow``) with a load-balancing coefficient of 1: every step's loss and the step-1 gradients equal one process's with the same
  micro-batches (the global-batch scope counts each micro-batch's tokens over dp x sp);
- greedy ``generate`` of the dp2 run equals ``transformers``' greedy decoding of its export (``make test-slow``);
- the planner's experts (ep, tp), its MoE presets against the built models, a capacity factor's drop rule, Qwen2-MoE.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import assert_close_grads, assert_close_losses, losses, read_records
from layout_worker import launch_layouts, reference_run
from meshtrain.models import hf_io as hf
from meshtrain.cli.export import load_hf_model
from meshtrain.models.hf import write_hf_folder
from conftest import ROOT
from test_hf import FINETUNE, EPS32, PIPE, V, assert_logits_equal, model_overrides, reference
from test_qwen import generates_as_transformers

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
             num_experts_per_tok=2, output_router_logits=True)
ARCHITECTURES = {
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=48, num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                              head_dim=16, norm_topk_prob=True)),
    "qwen3_moe-unnormalised": ("Qwen3MoeForCausalLM", dict(intermediate_size=64, moe_intermediate_size=24,
                                                           num_experts=8, head_dim=8, norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(intermediate_size=64, moe_intermediate_size=24,
                                              shared_expert_intermediate_size=40, num_experts=4, norm_topk_prob=False)),
}


def saved(folder: Path, case: str, fused: bool = False, **overrides) -> Path:
    """A random tiny model of ``case`` saved into ``folder`` (published per-expert tensors, or with ``fused`` the
    state dict ``transformers`` keeps in memory), its routers scaled to decisive probabilities, norms perturbed."""
    architecture, shape = ARCHITECTURES[case]
    config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**{**SHAPE, **shape, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("shared_expert_gate.weight"):  # norms, q/k/v biases, the shared gate
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return save_hf(model, folder, fused)


def save_hf(model, folder: Path, fused: bool) -> Path:
    """``model`` (a transformers MoE model) saved into ``folder``: ``save_pretrained``'s per-expert tensors, or with
    ``fused`` the state dict ``transformers`` keeps in memory (its fused expert tensors, a tied head left out)."""
    if not fused:
        model.save_pretrained(folder)
        return folder
    folder.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(folder / hf.SINGLE_FILE), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    return folder


def moe_tolerance_width(cfg) -> int:
    """The widest sum of a block (C, F, T, and the k weighted expert outputs a token adds), for
    :func:`test_hf.logits_tolerance`."""
    return max(cfg.n_embd, cfg.ffn_hidden_size(), cfg.block_size) + cfg.num_experts_per_tok


@pytest.mark.parametrize("case", list(ARCHITECTURES))
@pytest.mark.parametrize("fused", [False, True], ids=["published", "fused"])
def test_imported_logits_equal_transformers(case, fused, tmp_path):
    folder = saved(tmp_path / "hf", case, fused)
    ours, cfg = load_hf_model(folder)
    assert cfg.type == case.split("-")[0]
    assert_logits_equal(ours, reference(folder), cfg.n_layer, moe_tolerance_width(cfg), T=cfg.block_size)


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes the published per-expert tensors back bit for bit, and ``transformers`` loads them
    with no missing, unexpected or mismatched key; an import of the fused form exports the same tensors."""
    folder = saved(tmp_path / "hf", case)
    ours, cfg = load_hf_model(folder)
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    fused, _ = load_hf_model(saved(tmp_path / "fused", case, fused=True))
    write_hf_folder(tmp_path / "out-fused", fused.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    with safe_open(str(folder / hf.SINGLE_FILE), framework="pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    for out in ("out", "out-fused"):
        with safe_open(str(tmp_path / out / hf.SINGLE_FILE), framework="pt") as f:
            exported = {name: f.get_tensor(name) for name in f.keys()}
        assert exported.keys() == original.keys()
        for name, t in original.items():
            assert torch.equal(exported[name], t), (out, name)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_load_balancing_loss_equals_transformers(case, tmp_path):
    """Each layer's ``E * sum_i f_i P_i`` is ``transformers``' ``load_balancing_loss_func`` of that layer's router
    logits alone; with one layer the model's auxiliary loss is ``router_aux_loss_coef`` x ``transformers``'
    ``aux_loss`` (with several, ``transformers`` pools the layers' counts: docs/moe.md). Sums of N*k ones and of
    N probabilities in another order: ``2 * N * eps`` relative."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    for layers in (2, 1):
        folder = saved(tmp_path / f"hf{layers}", case, num_hidden_layers=layers)
        ours, cfg = load_hf_model(folder)
        ours.train()
        theirs = reference(folder)
        x = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
        ours(x)
        out = theirs(x, output_router_logits=True)
        tol = 2 * x.numel() * EPS32
        for i, logits in enumerate(out.router_logits):
            want = load_balancing_loss_func((logits,), cfg.num_experts, cfg.num_experts_per_tok)
            torch.testing.assert_close(ours.blocks[str(i)].mlp.aux_loss, want, rtol=tol, atol=0)
            theirs_experts = torch.topk(torch.softmax(logits.float(), -1), cfg.num_experts_per_tok).indices
            assert torch.equal(ours.blocks[str(i)].mlp.last_experts, theirs_experts)
        if layers == 1:
            torch.testing.assert_close(ours.aux_loss(), cfg.router_aux_loss_coef * out.aux_loss, rtol=tol, atol=0)


def test_grouped_gemm_equals_the_per_expert_loop():
    """``moe_compute = "grouped"`` and ``"loop"`` compute each (token, expert) pair's SwiGLU with the same sums
    (of C or F products, in another order at most): outputs within ``2 * max(C, F) * eps`` of their scale, and the
    gradients of every parameter within the same relative bound (the backward's sums are over N*k rows at most)."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    results = {}
    for compute in ("grouped", "loop"):
        cfg = ModelConfig(type="mixtral", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48, block_size=32,
                          num_experts=4, moe_compute=compute, router_aux_loss_coef=1.0)
        torch.manual_seed(0)
        model = build_model(cfg, V)
        x = torch.randint(0, V, (3, 32), generator=torch.Generator().manual_seed(1))
        logits = model(x)
        logits.sum().backward()  # a stride-0 incoming gradient: the grouped GEMM's backward needs it contiguous
        results[compute] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    (a, ga), (b, gb) = results["grouped"], results["loop"]
    rel = 2 * max(48, 3 * 32) * EPS32
    torch.testing.assert_close(a, b, rtol=0, atol=rel * float(b.abs().max()))
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=rel * float(gb[name].abs().max()) + 1e-30,
                                   msg=name)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=16))
def test_bucketed_rows_keep_each_expert_in_its_own_padded_rows(sizes):
    """:func:`bucket_rows`: every expert's count rounded up by less than ``max(16, m / 8)`` rows (the padding's
    bound), its rows in order at the start of its own padded segment."""
    from meshtrain.models.moe.layer import bucket_rows

    counts = torch.tensor(sizes)
    padded, pos = bucket_rows(counts)
    assert pos.shape == (sum(sizes),)
    ends, row = padded.cumsum(0).tolist(), 0
    for m, p, end in zip(sizes, padded.tolist(), ends):
        assert m <= p < m + max(16, m / 8), (m, p)
        assert pos[row:row + m].tolist() == list(range(end - p, end - p + m))  # its rows, in order, from its start
        row += m


def test_bucketed_rows_take_few_sizes():
    """At most 8 + 1 padded sizes between any power of two and the next from 16 to 8192 rows (few GEMM shapes for
    oneDNN to cache), every count of such a range padded in one call."""
    from meshtrain.models.moe.layer import bucket_rows

    for low in range(4, 13):  # row counts in [2^low, 2^(low+1)]
        padded, _ = bucket_rows(torch.arange(2 ** low, 2 ** (low + 1) + 1))
        assert len(set(padded.tolist())) <= 9, low


def test_bucketed_bf16_experts_equal_the_unpadded_grouped_gemm():
    """On a CPU in bf16 the experts run on rows padded to buckets (:func:`bucket_rows`); each real row's output and
    every gradient equal the unpadded grouped GEMM's within three bf16 roundings of their scale (the gate/up GEMM's
    output, the SwiGLU product and the down GEMM's output may each round one ulp, 2^-8 relative, the other way when
    the padded GEMM sums in another order), and the padding rows add nothing."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import GroupedExperts, grouped_swiglu

    cfg = ModelConfig(type="mixtral", n_embd=32, ffn_hidden=48, num_experts=4)
    torch.manual_seed(0)
    experts = GroupedExperts(cfg)
    for w, _ in experts.expert_weights():
        torch.nn.init.normal_(w, std=0.2)
    counts = torch.tensor([0, 37, 5, 130])
    x = torch.randn(int(counts.sum()), 32)
    results = []
    for padded in (True, False):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if padded:
                y = experts(xi, counts)
            else:
                y = grouped_swiglu(xi.bfloat16(), *(w.bfloat16() for w, _ in experts.expert_weights()),
                                   torch.cumsum(counts, 0).to(torch.int32))
        y.float().square().sum().backward()
        results.append((y.detach().float(), xi.grad, [w.grad.clone() for w, _ in experts.expert_weights()]))
        experts.zero_grad()
    (a, ga, wa), (b, gb, wb) = results
    bound = 3 * 2.0 ** -8
    torch.testing.assert_close(a, b, rtol=0, atol=bound * float(b.abs().max()))
    for got, want in zip([ga, *wa], [gb, *wb]):
        torch.testing.assert_close(got, want, rtol=0, atol=bound * float(want.abs().max()))


@pytest.mark.parametrize("model", [{"type": "mixtral"}, {"type": "qwen3_moe", "head_dim": 16, "norm_topk_prob": False}])
def test_a_built_model_exports_as_transformers_computes_it(model, tmp_path):
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=24, block_size=32, num_experts=4,
                      **model)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, V, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == cfg.family().hf.architectures[0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_equal(ours, theirs.eval(), cfg.n_layer, moe_tolerance_width(cfg), T=cfg.block_size)


def test_routing_biases_move_towards_balance():
    """Auxiliary-loss-free balancing (DeepSeek-V3): after a step, each bias moves by the rate towards the mean count
    of the step's training forwards (``b_i += rate * sign(mean - c_i)``); an evaluation forward counts nothing;
    the biases pick the experts, the probabilities weigh them."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import MoE

    cfg = ModelConfig(type="mixtral", n_embd=32, ffn_hidden=24, num_experts=4, router_bias_update_rate=0.5)
    torch.manual_seed(0)
    layer = MoE(cfg)
    for w, _ in layer.experts.expert_weights():
        torch.nn.init.normal_(w, std=0.02)
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(2, 16, 32)
    counts = torch.zeros(4)
    for _ in range(2):
        layer(x)
        counts += torch.bincount(layer.last_experts.reshape(-1), minlength=4)
    layer.eval()
    with torch.no_grad():
        layer(x)
    layer.train()
    layer.update_bias()
    assert torch.equal(layer.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert torch.equal(layer.step_counts, torch.zeros(4))
    probs, weights, experts = layer.route(x.reshape(-1, 32))
    assert torch.equal(experts, torch.topk(probs + layer.expert_bias, 2).indices)
    torch.testing.assert_close(weights, probs.gather(-1, experts) / probs.gather(-1, experts).sum(-1, keepdim=True))


def _bias_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: a MoE layer (same weights on both) trains on this rank's tokens, then moves its biases
    over the pair of ranks; saves (its counts, its biases)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import MoE

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        layer = MoE(ModelConfig(type="mixtral", n_embd=16, ffn_hidden=8, num_experts=8, router_bias_update_rate=0.25))
        torch.nn.init.normal_(layer.router.weight, std=1.0)
        for w, _ in layer.experts.expert_weights():
            torch.nn.init.normal_(w, std=0.02)
        layer.balance_group = dist.group.WORLD
        layer(torch.randn(1, 24, 16, generator=torch.Generator().manual_seed(10 + rank)))  # each rank its own tokens
        counts = layer.step_counts.clone()
        layer.update_bias()
        torch.save((counts, layer.expert_bias.clone()), Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo ranks (~8 s); make test checks the biases in the FSDP2 dp2 layout
def test_routing_biases_move_by_the_counts_of_every_rank(tmp_path):
    """Over dp x sp the biases move by the summed counts (one process's step), not each rank's own: both ranks end
    with ``rate * sign(mean(c0 + c1) - (c0 + c1))``, which here differs from what rank 0's counts alone give."""
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_bias_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    (c0, b0), (c1, b1) = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    total = c0 + c1
    want = 0.25 * torch.sign(total.mean() - total)
    assert torch.equal(b0, want) and torch.equal(b1, want)
    assert not torch.equal(want, 0.25 * torch.sign(c0.mean() - c0))  # the test can tell local from global counts


EP_WORLD = 2  # ep = 4 runs in make test-slow (the mixtral-ep4 layout)
EP_TOKENS = 12  # per rank: with 8 experts and top-2, some rank sends some expert no row (an empty split)


def _ep_layer():
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import MoE

    torch.manual_seed(0)
    layer = MoE(ModelConfig(type="mixtral", n_embd=16, ffn_hidden=8, num_experts=8, router_aux_loss_scope="global_batch"))
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    for w, _ in layer.experts.expert_weights():
        torch.nn.init.normal_(w, std=0.3)
    return layer


def _ep_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (1, EP_TOKENS, 16) and the weights of its outputs in the objective."""
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(1, EP_TOKENS, 16, generator=gen), torch.randn(1, EP_TOKENS, 16, generator=gen)


def _ep_worker(rank: int, port: int, out: str) -> None:
    """One of EP_WORLD gloo ranks: the MoE layer with its 8 experts split over ep = EP_WORLD ranks runs this rank's
    tokens; objective ``sum(y * g) + aux`` per rank; saves its outputs, expert ids, aux loss, input gradient, router
    gradient (averaged over the ranks as dp averages it) and its experts' gradients."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.parallel.expert import apply_ep

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=EP_WORLD, timeout=timedelta(seconds=60))
    try:
        layer = _ep_layer()
        layer.balance_group = dist.group.WORLD
        apply_ep(layer, init_device_mesh("cpu", (EP_WORLD,), mesh_dim_names=("ep",)))
        x, g = _ep_inputs(rank)
        x.requires_grad_(True)
        y = layer(x)
        ((y * g).sum() + layer.aux_loss).backward()
        router = layer.router.weight.grad.clone()
        dist.all_reduce(router)
        experts = {n: p.grad.to_local().clone() for n, p in layer.experts.named_parameters()}
        torch.save({"y": y.detach(), "ids": layer.last_experts, "aux": layer.aux_loss.detach(), "x": x.grad,
                    "router": router / EP_WORLD, "experts": experts}, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_dispatch_equals_one_process(tmp_path):
    """Experts split over ep = EP_WORLD gloo ranks (all-to-all dispatch and combine, uneven and empty splits) against one
    process running the 4 ranks' tokens at once with the mean of their objectives: every token's expert ids are
    identical, outputs equal, the ranks' global-batch auxiliary losses average to one process's, and the input, router
    and expert gradients equal (each expert's on the rank that holds it).

    Tolerance: each output and gradient element is a sum of at most 2 * max(C, F, N*k) = 96 products
    (the same terms in another order across GEMMs of other sizes), so fp32 errs by ~96 * 2**-24 ~ 6e-6 of their
    magnitude sum; 1e-5 relative plus 1e-5 absolute (magnitudes here are O(1)) holds on any CPU."""
    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_ep_worker, args=(free_port(), str(tmp_path)), nprocs=EP_WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(EP_WORLD)]

    layer = _ep_layer()
    inputs = [_ep_inputs(r) for r in range(EP_WORLD)]
    x = torch.cat([i[0] for i in inputs], dim=1).requires_grad_(True)  # (1, EP_WORLD * EP_TOKENS, 16)
    g = torch.cat([i[1] for i in inputs], dim=1)
    y = layer(x)
    ((y * g).sum() / EP_WORLD + layer.aux_loss).backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    for r, got in enumerate(ranks):
        mine = slice(r * EP_TOKENS, (r + 1) * EP_TOKENS)
        assert torch.equal(got["ids"], layer.last_experts[mine])
        torch.testing.assert_close(got["y"], y.detach()[:, mine], **tol)
        torch.testing.assert_close(got["x"], x.grad[:, mine] * EP_WORLD, **tol)  # rank r's objective is EP_WORLD x its share
        torch.testing.assert_close(got["router"], layer.router.weight.grad, **tol)
        per_rank = 8 // EP_WORLD
        held = slice(r * per_rank, (r + 1) * per_rank)  # the experts rank r holds
        for name, grad in got["experts"].items():
            torch.testing.assert_close(grad, getattr(layer.experts, name).grad[held], **tol)
    # the global-batch loss: every rank weighs its own probabilities by the counts of all, so their mean is one process's
    torch.testing.assert_close(torch.stack([got["aux"] for got in ranks]).mean(), layer.aux_loss.detach(), **tol)
    sent = torch.stack([torch.bincount(got["ids"].reshape(-1), minlength=8) for got in ranks])  # (ranks, experts)
    assert (sent == 0).any(), "no empty split: the test does not reach the all-to-all's zero-row case"


def test_an_export_refuses_routing_biases(tmp_path):
    from meshtrain.errors import ConfigError
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    cfg = ModelConfig(type="mixtral", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=24, block_size=32,
                      num_experts=4, router_bias_update_rate=0.001)
    with pytest.raises(ConfigError, match="trained routing biases that mixtral's Hugging Face format has no tensor"):
        write_hf_folder(tmp_path / "out", build_model(cfg, V).state_dict(), cfg, V, None, max_shard_bytes=2**30)
    assert not (tmp_path / "out").exists()


MOE_PRESETS = {  # the published configs (Mixtral: Jiang et al. 2024, Table 1; Qwen3-30B-A3B: its config.json)
    "mixtral-8x7b": {"model.type": "mixtral", "model.n_layer": "32", "model.n_head": "32", "model.n_kv_head": "8",
                     "model.n_embd": "4096", "model.ffn_hidden": "14336", "model.num_experts": "8",
                     "model.vocab_size": "32000"},
    "mixtral-8x22b": {"model.type": "mixtral", "model.n_layer": "56", "model.n_head": "48", "model.n_kv_head": "8",
                      "model.n_embd": "6144", "model.ffn_hidden": "16384", "model.num_experts": "8",
                      "model.vocab_size": "32768"},
    "qwen3-30b-a3b": {"model.type": "qwen3_moe", "model.n_layer": "48", "model.n_head": "32", "model.n_kv_head": "4",
                      "model.head_dim": "128", "model.n_embd": "2048", "model.ffn_hidden": "768",
                      "model.num_experts": "128", "model.num_experts_per_tok": "8", "model.vocab_size": "151936"},
}


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_are_the_model_the_trainer_builds(name):
    """Each mixture-of-experts preset of the planner, written as a config, builds on the meta device exactly the
    preset's parameters (46.7 B, 140.6 B and 30.5 B, the published totals), and the planner's spec of that config is
    the preset."""
    from dataclasses import replace

    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.planner.model_specs import PRESETS, from_config, preset

    # the DeepSeek-V3 family's presets (latent attention; GLM-4.5's dense first layers): tests/test_planner_deepseek_v3.py
    # and tests/test_planner_glm_v2.py
    assert {n for n, m in PRESETS.items() if m.experts and not m.kv_lora_rank and not m.dense_layers} == set(MOE_PRESETS)
    spec = preset(name)
    cfg = load_config(None, {**MOE_PRESETS[name], "model.block_size": str(spec.seq_len)})
    with torch.device("meta"):
        model = build_model(cfg.model, spec.vocab)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    assert replace(from_config(cfg), name=spec.name) == spec


PUBLISHED_ACTIVE = {"mixtral-8x7b": (12.9, 0.1), "mixtral-8x22b": (39, 1), "qwen3-30b-a3b": (3.3, 0.1)}
"""Active parameters per token, billions, as published (Jiang et al. 2024, Sec. 2: 12.9 B; Mistral's Mixtral 8x22B
announcement: 39 B; Qwen3 technical report, Table 2: 3.3 B), with one unit of the last digit given: a published
figure may be cut rather than rounded (3.35 B is Qwen's "3.3 B")."""


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_active_params_are_the_built_model_less_the_unchosen_experts(name):
    """The planner's active parameters are the built model's parameters less (E - k)/E of its expert stacks, and
    match the published count to its rounding."""
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.planner.model_specs import preset

    spec = preset(name)
    cfg = load_config(None, {**MOE_PRESETS[name], "model.block_size": str(spec.seq_len)})
    with torch.device("meta"):
        params = dict(build_model(cfg.model, spec.vocab).named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    idle = experts * (spec.experts - spec.experts_per_token) // spec.experts
    assert spec.active_params() == sum(p.numel() for p in params.values()) - idle
    published, rounding = PUBLISHED_ACTIVE[name]
    assert abs(spec.active_params() / 1e9 - published) <= rounding


def test_the_planner_splits_experts_over_ep():
    """ep in the planner: a Mixtral 8x7B layout at ep = 8 holds 1/8 of the experts' states per rank (without ZeRO),
    pays the dispatch all-to-alls (ep_comm > 0, none at ep = 1), and the search offers ep > 1; ep that does not
    divide the experts or dp*sp, or a model without experts, is a rule broken."""
    from meshtrain.planner.cost import step_time
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.layout import FRAMEWORKS, Layout, divisibility_errors, framework_errors
    from meshtrain.planner.memory import PRECISIONS, stage_params
    from meshtrain.planner.model_specs import preset
    from meshtrain.planner.search import candidate_layouts
    from meshtrain.planner.estimate import Job

    model, hw, fw, prec = preset("mixtral-8x7b"), get_hardware("H100"), FRAMEWORKS["meshtrain"], PRECISIONS["bf16"]
    one, eight = Layout(dp=8, pp=4, micro_batch_size=1, gradient_accumulation_steps=8), \
        Layout(dp=8, pp=4, ep=8, micro_batch_size=1, gradient_accumulation_steps=8)
    experts = model.layers / 4 * model.expert_params()
    assert stage_params(model, one) - stage_params(model, eight) == pytest.approx(experts * 7 / 8, rel=1e-12)
    assert step_time(model, one, hw, prec, fw).ep_comm == 0 < step_time(model, eight, hw, prec, fw).ep_comm
    assert divisibility_errors(model, eight) == []
    assert divisibility_errors(model, Layout(dp=6, ep=3)) == [
        "model.num_experts = 8 is not divisible by parallel.ep = 3: each ep rank holds num_experts/ep whole experts; "
        "use an ep that divides 8"]
    assert divisibility_errors(model, Layout(dp=2, ep=4)) == [
        "parallel.ep = 4 does not divide tp*dp*sp = 2: parallel folding borrows expert ranks from them"]
    folded = Layout(dp=2, tp=2, ep=4, tp_sequence_parallel=True)  # Megatron's parallel folding: ep over tp x dp
    assert divisibility_errors(model, folded) == framework_errors(FRAMEWORKS["megatron-core"], folded, model) == []
    assert framework_errors(fw, folded, model) == [  # the trainer's rule book (rules/layout.py), in its words
        "parallel.tp_sequence_parallel = true is not supported with model 'mixtral-8x7b' (tensor parallelism "
        "replicates its experts, which take every token of the sequence): use tp_sequence_parallel = false",
        "parallel.ep = 4 does not divide dp*sp = 2*1 = 2: expert parallelism borrows its ranks from the data- and "
        "sequence-parallel ones; use ep in 1, 2, or more dp ranks"]
    assert divisibility_errors(preset("llama3-8b"), Layout(dp=2, ep=2)) == [
        "parallel.ep = 2 splits a mixture of experts' experts, and model 'llama3-8b' has none: use ep = 1, or a model "
        "with experts (mixtral and qwen3_moe and qwen2_moe and deepseek_v3 and glm4_moe and deepseek_v2)"]
    job = Job(num_devices=16, global_batch_size=64)
    assert {layout.ep for layout, _ in candidate_layouts(model, job, fw, {"pp": 4, "tp": 1})} == {1, 2, 4}


def test_expert_gemm_traffic_is_each_experts_roofline_summed():
    """The routed experts' operand traffic is the sum over the rank's E/ep experts of each expert's own GEMMs
    (``gemm_traffic_bytes`` of its rows through h -> (m-1)f and f -> h): every expert's weights read once, however
    few rows it gets; the rows are the rank's tokens times k times the imbalance."""
    from dataclasses import replace

    from meshtrain.planner.cost import expert_gemm_traffic_bytes, gemm_traffic_bytes
    from meshtrain.planner.model_specs import preset

    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        for ep, imbalance in ((1, 1.0), (8, 1.0), (8, 1.3)):
            m = replace(preset(name), expert_imbalance=imbalance)
            tokens, local = 4096, m.experts // ep
            rows = tokens * m.experts_per_token * imbalance / local  # each local expert's
            shapes = ((m.hidden, (m.mlp_matrices - 1) * m.ffn_hidden), (m.ffn_hidden, m.hidden))
            assert expert_gemm_traffic_bytes(m, tokens, ep, 2) == pytest.approx(
                local * gemm_traffic_bytes(rows, shapes, 2), rel=1e-12)
    assert expert_gemm_traffic_bytes(preset("llama3-8b"), 4096, 1, 2) == 0


def test_expert_imbalance_slows_the_routed_experts_and_the_dispatch():
    """expert_imbalance = x multiplies the busiest rank's routed-expert GEMM FLOPs (forward + backward: 3x the forward's)
    and its all-to-all rows by x; nothing else in the step changes (on a device whose memory traffic is free and a
    network with no latency, the terms isolate); x < 1 is refused."""
    from dataclasses import replace

    from meshtrain.errors import ConfigError
    from meshtrain.planner.cost import routed_flops_per_token, step_time
    from meshtrain.planner.hardware import Device, Hardware, Network
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import preset

    dev = Device("ideal", {"bfloat16": 1e15, "float32": 1e14}, memory_bytes=1e13, memory_bandwidth=1e30,
                 matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=0.0, grouped_gemm_tile=0)
    hw = Hardware(dev, Network(8, 1e11, 1e10, 0.0, 0.0, 1.0, 1.0))
    fw, prec = FRAMEWORKS["meshtrain"], PRECISIONS["bf16"]
    layout = Layout(dp=8, ep=8, micro_batch_size=1, gradient_accumulation_steps=1)
    balanced = replace(preset("mixtral-8x7b"), expert_imbalance=1.0)  # stated: the prediction's is test_planner_moe_gemm's
    hot = replace(balanced, expert_imbalance=1.5)
    a, b = step_time(balanced, layout, hw, prec, fw), step_time(hot, layout, hw, prec, fw)
    tokens = balanced.seq_len  # a micro-batch of one sequence
    extra = 3 * tokens * balanced.layers * 0.5 * routed_flops_per_token(balanced) / dev.matmul_flops("bfloat16", 4096)
    assert b.compute - a.compute == pytest.approx(extra, rel=1e-9)
    assert b.ep_comm == pytest.approx(1.5 * a.ep_comm, rel=1e-9)
    with pytest.raises(ConfigError, match="expert_imbalance = 0.9 must be a number >= 1"):
        replace(balanced, expert_imbalance=0.9)


def test_megatron_folds_expert_parallelism_into_tp():
    """Framework.expert_folding (Megatron-Core's parallel folding, expert tp 1): at tp = 2 each tp rank routes half the
    tokens, so the router's and experts' FLOPs (3x forward), the all-to-all rows and the routed activations are halved
    against the same framework replicating them over tp; everything else is the same. Ideal hardware isolates the terms."""
    from dataclasses import replace

    from meshtrain.planner.cost import expert_flops_per_token, step_time
    from meshtrain.planner.hardware import Device, Hardware, Network
    from meshtrain.planner.layout import FRAMEWORKS, Layout
    from meshtrain.planner.memory import PRECISIONS, layer_activation_bytes
    from meshtrain.planner.model_specs import preset

    dev = Device("ideal", {"bfloat16": 1e15, "float32": 1e14}, memory_bytes=1e13, memory_bandwidth=1e30,
                 matmul_efficiency=1.0, memory_efficiency=1.0, framework_overhead_bytes=0.0, grouped_gemm_tile=0)
    hw = Hardware(dev, Network(8, 1e11, 1e10, 0.0, 0.0, 1.0, 1.0))
    folding, prec, model = FRAMEWORKS["megatron-core"], PRECISIONS["bf16"], replace(preset("mixtral-8x7b"),
                                                                                    expert_imbalance=1.0)
    replicating = replace(folding, expert_folding=False)
    layout = Layout(dp=2, tp=2, ep=2, micro_batch_size=1, gradient_accumulation_steps=1)
    a, b = step_time(model, layout, hw, prec, replicating), step_time(model, layout, hw, prec, folding)
    saved = 3 * model.seq_len * model.layers * expert_flops_per_token(model) / 2 / dev.matmul_flops("bfloat16", 2048)
    assert a.compute - b.compute == pytest.approx(saved, rel=1e-9)
    assert b.ep_comm == pytest.approx(a.ep_comm / 2, rel=1e-9)
    routed = model.seq_len * (model.experts * 4 + model.experts_per_token * model.hidden * prec.activation_bytes)
    assert (layer_activation_bytes(model, layout, prec, replicating, "none")
            - layer_activation_bytes(model, layout, prec, folding, "none")) == pytest.approx(routed / 2, rel=1e-12)


def test_the_planner_plans_experts(capsys):
    """``meshtrain plan`` on a Mixtral config: every expert's parameters in the states, the k active ones in the
    FLOPs (a token costs the dense model of width k*F plus the router); tp > 1 layouts replicate the experts (their
    parameters and FLOPs are not divided by tp), the routers and the norms (the final one too) and offer no Megatron
    sequence parallelism."""
    import json

    from meshtrain.cli.main import main as cli_main
    from meshtrain.config.load import load_config
    from meshtrain.planner.cost import dense_flops_per_token
    from meshtrain.planner.model_specs import from_config

    moe = {"model.type": "mixtral", "model.ffn_hidden": "96", "model.num_experts": "8"}
    llama = ROOT / "configs" / "llama_tiny.toml"
    spec = from_config(load_config(llama, moe))
    dense = from_config(load_config(llama, {"model.ffn_hidden": "192"}))  # k * F = 2 * 96
    assert dense_flops_per_token(spec) == dense_flops_per_token(dense) + 2 * 8 * 128
    assert spec.num_params() - dense.num_params() == spec.layers * (8 * 3 * 128 * 96 + 8 * 128 - 3 * 128 * 192)
    args = ["plan", str(llama), "--num-gpus", "2", "--json", "--top", "1000",
            *[a for k, v in moe.items() for a in (f"--{k}", v)]]
    assert cli_main(args) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked and any(r["tp"] == 2 for r in ranked)
    assert not any(r["tp_sequence_parallel"] for r in ranked)
    from meshtrain.planner.layout import Layout
    from meshtrain.planner.memory import stage_params

    tp2 = stage_params(spec, Layout(tp=2))
    assert stage_params(spec, Layout()) - tp2 == pytest.approx((spec.num_params() - spec.layers * (
        spec.expert_params() + spec.tp_replicated_params) - spec.hidden) / 2)  # all but experts, routers, norms halved


@pytest.mark.parametrize("overrides, expected", [
    ({"model.type": "mixtral", "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"},
     "parallel.tp_sequence_parallel = true is not supported with model.type = 'mixtral'"),
    ({"model.type": "mixtral", "model.norm_topk_prob": "false"}, "model.norm_topk_prob = false is not Mixtral's"),
    ({"model.type": "qwen3_moe", "model.num_experts_per_tok": "9"}, "model.num_experts_per_tok = 9 must be in [1,"),
    ({"model.type": "qwen3_moe", "model.router_aux_loss_scope": "step"}, "model.router_aux_loss_scope = 'step'"),
    ({"model.type": "llama", "model.num_experts": "4"}, "model.num_experts = 4 applies to model.type = 'mixtral' or"),
])
def test_bad_moe_keys_are_one_line(overrides, expected):
    from meshtrain.config.load import load_config
    from meshtrain.errors import ConfigError

    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(")) as e:
        load_config(FINETUNE, {"model.n_kv_head": "2", **overrides})
    assert "\n" not in str(e.value)


# --- training from imported weights, layouts against one process -----------------------------------------------

BALANCED = {"model.router_aux_loss_coef": "1.0"}
"""A load-balancing coefficient large enough that a wrong count or scope moves the loss and router gradients."""
LAYOUTS = {
    "mixtral-fsdp2-dp2": (2, "mixtral", {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"}),
    "qwen3_moe-ring-sp2": (2, "qwen3_moe", {"parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "qwen3_moe-fsdp2-dp2-bias": (2, "qwen3_moe", {"parallel.zero_stage": "3", "batch.micro_batch_size": "2",
                                                  "model.router_bias_update_rate": "0.05"}),
    "mixtral-ddp-dp2": (2, "mixtral", {"batch.micro_batch_size": "2"}),
    "qwen3_moe-ulysses-sp2": (2, "qwen3_moe", {"parallel.sp": "2"}),
    "mixtral-pp2": (2, "mixtral", PIPE),
    "qwen3_moe-pp2-zbv": (2, "qwen3_moe", {**PIPE, "parallel.pp_schedule": "zbv", "parallel.virtual_stages": "2"}),
    "mixtral-dp2-full-recompute": (2, "mixtral", {"batch.micro_batch_size": "2", "train.recompute": "full"}),
    "qwen3_moe-fsdp2-dp2-selective": (2, "qwen3_moe", {"parallel.zero_stage": "2", "batch.micro_batch_size": "2",
                                                       "train.recompute": "selective"}),
    # expert parallelism: ep ranks borrowed from dp x sp
    "mixtral-ep2": (2, "mixtral", {"parallel.ep": "2", "batch.micro_batch_size": "2"}),
    "qwen3_moe-ep2-ring-sp2": (2, "qwen3_moe", {"parallel.ep": "2", "parallel.sp": "2", "parallel.sp_mode": "ring"}),
    # ep over USP's ranks: Ulysses 2 x ring 1, and Ulysses 2 x ring 2
    "qwen3_moe-ep2-usp-sp2": (2, "qwen3_moe", {"parallel.ep": "2", "parallel.sp": "2", "parallel.sp_mode": "usp",
                                               "parallel.sp_ulysses": "2"}),
    "mixtral-ep2-usp-sp4": (4, "mixtral", {"parallel.ep": "2", "parallel.sp": "4", "parallel.sp_mode": "usp",
                                           "parallel.sp_ulysses": "2"}),
    "qwen3_moe-ep2-fsdp2-dp4": (4, "qwen3_moe", {"parallel.ep": "2", "parallel.zero_stage": "3",
                                                 "batch.micro_batch_size": "1"}),
    "mixtral-ep2-ddp-dp4": (4, "mixtral", {"parallel.ep": "2", "batch.micro_batch_size": "1"}),
    "mixtral-ep4": (4, "mixtral", {"parallel.ep": "4", "batch.micro_batch_size": "1"}),
    # tp splits the attention and replicates the experts
    "qwen3_moe-tp2": (2, "qwen3_moe", {"parallel.tp": "2"}),
    "mixtral-ep2-tp2": (4, "mixtral", {"parallel.ep": "2", "parallel.tp": "2", "batch.micro_batch_size": "2"}),
    "qwen3_moe-ep2-tp2-fsdp2-dp4": (8, "qwen3_moe", {"parallel.ep": "2", "parallel.tp": "2", "parallel.zero_stage": "3",
                                                     "batch.micro_batch_size": "1"}),
    "mixtral-ep2-dp2-full-recompute": (2, "mixtral", {"parallel.ep": "2", "batch.micro_batch_size": "2",
                                                      "train.recompute": "full"}),
    "mixtral-ep2-compiled": (2, "mixtral", {"parallel.ep": "2", "batch.micro_batch_size": "2", "train.compile": "on"}),
    # a shared expert: a dense MLP on every rank's tokens, averaged over dp x sp like the attention
    "qwen2_moe-ep2-fsdp2-dp2": (2, "qwen2_moe", {"parallel.ep": "2", "parallel.zero_stage": "3",
                                                 "batch.micro_batch_size": "2"}),
    # pipelines with ep over sp: the batch ranks of a stage hold the same samples, as the per-sample reference's
    "mixtral-ep2-pp2-ring-sp2": (4, "mixtral", {**PIPE, "parallel.ep": "2", "parallel.sp": "2", "parallel.sp_mode": "ring"}),
    "qwen3_moe-ep2-pp2-zbv-sp2": (4, "qwen3_moe", {**PIPE, "parallel.pp_schedule": "zbv", "parallel.virtual_stages": "2",
                                                   "parallel.ep": "2", "parallel.sp": "2", "parallel.zero_stage": "2"}),
}
"""Each layout's global batch is the reference's 4 samples; a pipeline's micro-batches of 1 sample are the
reference's with ``micro_batch_size`` 1 and 4 accumulation steps (the scope counts a micro-batch's tokens)."""
SLOW = {"mixtral-ddp-dp2", "qwen3_moe-ulysses-sp2", "mixtral-pp2", "qwen3_moe-pp2-zbv", "mixtral-dp2-full-recompute",
        "qwen3_moe-fsdp2-dp2-selective", "qwen3_moe-ring-sp2", "mixtral-ep2", "qwen3_moe-ep2-ring-sp2", "qwen3_moe-ep2-fsdp2-dp4",
        "mixtral-ep2-ddp-dp4", "mixtral-ep4", "mixtral-ep2-pp2-ring-sp2", "qwen3_moe-ep2-pp2-zbv-sp2", "qwen3_moe-tp2",
        "mixtral-ep2-tp2", "qwen3_moe-ep2-tp2-fsdp2-dp4", "mixtral-ep2-dp2-full-recompute", "mixtral-ep2-compiled",
        "qwen2_moe-ep2-fsdp2-dp2", "qwen3_moe-ep2-usp-sp2", "mixtral-ep2-usp-sp4"}
"""Launched one by one in `make test-slow`; the rest (FSDP2 over dp with and without routing biases) share one 2-rank
launch, also in `make test-slow` since this session's expert-parallel tests (make test keeps the unit tests and the
2-rank dispatch test, :func:`test_expert_parallel_dispatch_equals_one_process`, to stay under 15 minutes)."""
PER_SAMPLE = {"batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "4"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    return {"mixtral": saved(root / "mixtral", "mixtral"),
            "qwen3_moe": saved(root / "qwen3_moe", "qwen3_moe", num_hidden_layers=4),  # zbv: 4 chunks
            "qwen2_moe": saved(root / "qwen2_moe", "qwen2_moe")}, root


def reference_folder(root: Path, name: str, overrides: dict[str, str]) -> Path:
    """Where :func:`one_process` trains the reference of a layout with ``overrides``."""
    pipeline = "parallel.pp" in overrides
    model = [v for k, v in overrides.items() if k.startswith("model.")]
    return root / ("one-" + "-".join([name] + (["per-sample"] if pipeline else []) + model))


def one_process(root: Path, folder: Path, name: str, overrides: dict[str, str]) -> tuple:
    """One process with the layout's model keys, and its micro-batches (a pipeline's: 1 sample, 4 steps); run once
    per module and kept (layouts share references)."""
    pipeline = "parallel.pp" in overrides
    model = {k: v for k, v in overrides.items() if k.startswith("model.")}
    tag = reference_folder(root, name, overrides).name.removeprefix("one-")
    if (root / f"one-{tag}") not in _REFERENCES:
        _REFERENCES[root / f"one-{tag}"] = reference_run(
            root / f"one-{tag}", {**model_overrides(folder), **BALANCED, **(PER_SAMPLE if pipeline else {}), **model},
            config=FINETUNE)
    return _REFERENCES[root / f"one-{tag}"]


_REFERENCES: dict[Path, tuple] = {}


def launch(root: Path, layouts: dict, folders: dict) -> dict:
    results = {}
    for world in sorted({w for w, _, _ in layouts.values()}):
        (root / f"w{world}").mkdir(parents=True, exist_ok=True)
        named = {n: {**model_overrides(folders[f]), **BALANCED, **o} for n, (w, f, o) in layouts.items() if w == world}
        results |= launch_layouts(world, root / f"w{world}", named, config=FINETUNE)
    return results


@pytest.fixture(scope="module")
def trained(folders):
    paths, root = folders
    return launch(root, {n: v for n, v in LAYOUTS.items() if n not in SLOW}, paths)


def check(results: dict, folders: tuple, name: str, launched: Path) -> None:
    """The layout's losses and step-1 gradients, and its logged load-balancing loss (a mean over micro-batches of
    the routers' losses over every layer: under a pipeline each stage logs its layers' share, summed over the stages),
    against one process's: the same tolerance as the loss (:func:`assert_close_losses`), since the auxiliary loss too
    is an fp32 mean over the micro-batch's tokens of values computed from parameters that drift alike."""
    paths, root = folders
    world, family, overrides = LAYOUTS[name]
    one = one_process(root, paths[family], family, overrides)
    assert_close_losses(results[name][0], one[0])
    assert_close_grads(results[name][1], one[1])
    aux = [{r["step"]: r["aux_loss"] for r in read_records(folder) if "aux_loss" in r}
           for folder in (launched / f"w{world}" / name, reference_folder(root, family, overrides))]
    assert aux[1], "the reference logged no aux_loss"
    assert_close_losses(*aux)


@pytest.mark.slow  # one 2-rank launch (~25 s with the generation below): make test keeps the MoE unit tests
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n not in SLOW])
def test_training_from_imported_weights_equals_one_process(trained, folders, name):
    check(trained, folders, name, folders[1])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_training_from_imported_weights_equals_one_process_slow(folders, name):
    paths, root = folders
    check(launch(root / "slow" / name, {name: LAYOUTS[name]}, paths), folders, name, root / "slow" / name)


@pytest.mark.slow  # needs the 2-rank launch above
def test_dp2_run_exported_generates_as_transformers(trained, folders, tmp_path):
    """The Mixtral trained under FSDP2 at dp=2 and exported: ``transformers``' greedy continuation of a prompt is
    meshtrain's ``generate --temperature 0`` on the run and on the export, token for token."""
    generates_as_transformers(folders[1] / "w2" / "mixtral-fsdp2-dp2", tmp_path, "MixtralForCausalLM")


# --- checkpoints reshard across ep --------------------------------------------------------------------------------

MOE_SCRATCH = {"model.type": "mixtral", "model.n_kv_head": "1", "model.num_experts": "4", "model.ffn_hidden": "24",
               "model.router_aux_loss_coef": "0.1", "checkpoint.interval": "5", "checkpoint.keep": "3"}
"""A tiny Mixtral trained from scratch on the bundled text (global batch 8)."""


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """ep2 over dp2 (DDP, micro-batch 4), 10 steps, checkpoints at 5 and 10."""
    from conftest import train_cli

    out = tmp_path_factory.mktemp("ep2")
    return out, losses(train_cli(out, 2, **MOE_SCRATCH, **{"parallel.ep": "2", "batch.micro_batch_size": "4"}))


@pytest.mark.slow  # three launches, ~45 s
@pytest.mark.parametrize("layout, nproc", [({"parallel.ep": "1", "batch.micro_batch_size": "4"}, 2),
                                           ({"parallel.ep": "4", "parallel.zero_stage": "3",
                                             "batch.micro_batch_size": "2"}, 4)], ids=["to-ep1", "to-ep4-fsdp2"])
def test_an_ep2_checkpoint_resumes_at_other_ep(ep2_run, tmp_path, layout, nproc):
    """The experts saved as ep = 2 shards (DCP) load as whole stacks at ep = 1 and as ep = 4 shards under FSDP2, and
    the run continues as the uninterrupted ep2 run (the resumed losses' tolerance: :func:`conftest.assert_resumed_losses`)."""
    from conftest import assert_resumed_losses, train_cli

    saved, full = ep2_run
    records = train_cli(tmp_path, nproc, **MOE_SCRATCH, **layout,
                        **{"checkpoint.resume": str(saved / "checkpoints" / "step_000005")})
    assert_resumed_losses(losses(records), {s: full[s] for s in range(6, 11)})


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_a_capacity_factor_drops_each_experts_assignments_past_its_capacity_in_token_order(factor):
    """``moe_capacity_factor``: each expert keeps its first ``ceil(factor * N*k / E)`` assignments in token order; a
    token's output is the weighted sum over its kept experts alone (weights not renormalised), computed here token by
    token from the routing; the load-balancing loss is the dropless one. Tolerance: each output element is a sum of
    k <= 2 products of C = 16 / F = 8 wide dot products: fp32 rounding, 1e-6 relative plus absolute."""
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.moe.layer import MoE

    def layer(capacity: float) -> MoE:
        torch.manual_seed(0)
        moe = MoE(ModelConfig(type="mixtral", n_embd=16, ffn_hidden=8, num_experts=4, moe_capacity_factor=capacity))
        torch.nn.init.normal_(moe.router.weight, std=1.0)
        for w, _ in moe.experts.expert_weights():
            torch.nn.init.normal_(w, std=0.3)
        return moe

    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(3))
    capped, dropless = layer(factor), layer(0.0)
    y = capped(x).reshape(-1, 16)
    dropless(x)
    probs, weights, experts = capped.route(x.reshape(-1, 16))
    cap = math.ceil(factor * 20 * 2 / 4)
    taken = [0] * 4
    want = torch.zeros(20, 16)
    dropped = 0
    for t in range(20):  # token order, then the token's choices in rank order
        for j in range(2):
            e = int(experts[t, j])
            if taken[e] < cap:
                taken[e] += 1
                w = capped.experts
                h = torch.nn.functional.silu(x.reshape(-1, 16)[t] @ w.w_gate[e].T) * (x.reshape(-1, 16)[t] @ w.w_up[e].T)
                want[t] += weights[t, j] * (h @ w.w_down[e].T)
            else:
                dropped += 1
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(capped.aux_loss, dropless.aux_loss, rtol=0, atol=0)
    assert (dropped > 0) == (factor < 1.25), dropped  # the cases reach both sides of the rule


@pytest.mark.parametrize("experts, shape", [(1, (5, 1)), (3, (7, 2)), (8, (33, 2)), (64, (16, 8)), (8, (0, 2))])
def test_expert_counts_equal_bincount(experts, shape):
    """The static-shape count the MoE layer and its load-balancing loss use equals ``torch.bincount(minlength=E)``
    exactly (integers), experts never chosen included."""
    from meshtrain.models.moe.layer import expert_counts

    torch.manual_seed(experts)
    chosen = torch.randint(0, experts, shape)
    assert torch.equal(expert_counts(chosen, experts), torch.bincount(chosen.reshape(-1), minlength=experts))
