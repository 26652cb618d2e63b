"""DeepSeek-V3's multi-token prediction (``model.num_nextn_predict_layers``, V3 report arXiv:2412.19437, Sec. 2.2).

``transformers`` has no MTP forward, so the reference is the report's equations written out here on the module's
weights (Eq. 21: ``M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_{k-1})]``, Eq. 22: the block, Eq. 23: the shared head after
the module's norm, Eq. 24-25: ``(lambda / D) * sum_k CE_k`` over the main loss's token count), on sequences cut to the
positions that have a target k + 1 ahead (the model pads them instead and relies on causal attention):

- the MTP loss equals the equations', with and without masked targets; its gradient reaches the modules and the
  shared embedding and head; eval, ``generate`` and the main logits see the main head only;
- a checkpoint with MTP layers (``model.layers.{n_layer + k - 1}``, DeepSeek-V3's layer 61) imports and exports bit for
  bit, and ``transformers`` loads the export, drops those layers and computes the same main logits;
- a checkpoint whose MTP layers do not match ``num_nextn_predict_layers`` is one line before launch, and so is a
  layout MTP is not built for.
The layouts (DDP and FSDP2 at dp2 equal one process) are in ``test_deepseek_v3.py``'s dp launch.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshtrain.cli.export import load_hf_model
from meshtrain.errors import ConfigError
from meshtrain.models import hf_io as hf
from meshtrain.models.build import build_model
from meshtrain.models.hf import write_hf_folder
from meshtrain.models.registry import ModelConfig, check_model
from test_deepseek_v3 import saved, tensors, tolerance_width
from test_hf import FINETUNE, V, logits_tolerance, one_line_error

transformers = pytest.importorskip("transformers")

TINY = dict(type="deepseek_v3", n_layer=2, n_head=4, n_embd=32, block_size=16, ffn_hidden=16, num_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=12, first_k_dense_replace=1, mtp_loss_weight=0.3)
"""DeepSeek-V3 in miniature: one dense and one MoE layer, MTP depths of layer index 2, 3 (MoE, as V3's layer 61)."""


def built(D: int = 2, **overrides) -> torch.nn.Module:
    """A tiny DeepSeek-V3 with D MTP depths, its norms perturbed, its routers decisive and its matrices at
    ``1/sqrt(fan_in)`` (the init's ones and 0.02 would hide a norm in the wrong place, leave routing to rounding and
    give logits near 0, where a wrong wiring of the MTP path moves the loss by little)."""
    cfg = ModelConfig(**{**TINY, "num_nextn_predict_layers": D, **overrides})
    check_model(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, V)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.router.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, Eq. 4)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def report_mtp_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Eq. 21-25 written out: ``tokens`` (B, T) the input, ``targets`` (B, T) the main loss's (-100: ignored); each depth
    on the T - k positions that have a token k ahead; divided by the main loss's supervised count (Eq. 24's 1/T)."""
    seen = {}
    hook = model.norm.register_forward_hook(lambda mod, args, out: seen.setdefault("h", out))
    model(tokens)
    hook.remove()
    h, eps, T = seen["h"], model.cfg.norm_eps, tokens.size(1)  # h^0: (B, T, C)
    W_emb, W_head, total = model.tok_emb.weight, model.lm_head.weight, 0.0
    for k, module in enumerate(model.mtp, start=1):
        L = T - k
        emb = W_emb[tokens[:, k:]]  # (B, L, C): Emb(t_{i+k})
        x = torch.cat([rms(emb, module.enorm.weight, eps), rms(h[:, :L], module.hnorm.weight, eps)], dim=-1)
        x = x @ module.eh_proj.weight.T  # Eq. 21: (B, L, C)
        cos, sin = model.rope(torch.arange(L), torch.float32)
        h = rms(module.block(x, cos, sin), module.norm.weight, eps)  # Eq. 22, then the module's norm
        logits = h @ W_head.T  # Eq. 23: (B, L, V)
        total = total + F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten(), reduction="sum")  # Eq. 24
    return model.cfg.mtp_loss_weight / len(model.mtp) * total / (targets != -100).sum()  # Eq. 25


def ours_mtp_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    model(tokens)
    ce = lambda lk, yk: F.cross_entropy(lk.flatten(0, 1), yk.flatten(), reduction="sum")  # noqa: E731
    return model.mtp_loss(targets, ce) / (targets != -100).sum()


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
@pytest.mark.parametrize("model", [{}, dict(q_lora_rank=24, tie_embeddings=True, n_shared_experts=0)])
def test_mtp_loss_follows_the_report_equations(model, masked):
    """Equal within ``2 x`` the logit bound of :func:`test_hf.logits_tolerance` over the n_layer + D blocks (a token's
    cross-entropy moves by at most twice its logits' largest change; the mean and lambda/D do not widen it): padding
    past the window instead of cutting, the embedding and hidden halves of ``eh_proj`` swapped, h^0 before the final
    norm or a depth fed the previous one's un-normed output are each O(1) off."""
    net = built(**model).train()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, V, (3, 13), generator=g)
    tokens, targets = seq[:, :-1], seq[:, 1:].clone()
    if masked:
        targets[torch.rand(targets.shape, generator=g) < 0.4] = -100
    got, want = ours_mtp_loss(net, tokens, targets), report_mtp_loss(net, tokens, targets)
    with torch.no_grad():
        scale = max(float(net(tokens).abs().max()), *(float(lk.abs().max()) for lk in net.mtp_logits))
    cfg = net.cfg
    width = max(cfg.n_embd * 2, cfg.dense_ffn_hidden or 0, cfg.q_lora_rank, tokens.size(1), tolerance_width(cfg))
    tol = 2 * logits_tolerance(cfg.n_layer + cfg.num_nextn_predict_layers, width, scale)
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) <= tol, (got, want, tol)
    assert got > 0.1  # the comparison is of a loss of order 1, not of zeros


def test_mtp_gradient_reaches_the_modules_and_the_shared_weights_in_training_only():
    """The MTP loss alone gives every module parameter and the shared embedding and head a gradient; in eval the
    forward keeps no MTP logits and the main logits and greedy tokens are those of the same main weights without MTP
    (the modules are built after the main model, whose init gets the same draws)."""
    net = built().train()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    ours_mtp_loss(net, tokens[:, :-1], tokens[:, 1:]).backward()
    for name, p in net.named_parameters():
        if name.startswith(("mtp.", "tok_emb.", "lm_head.")) and "experts" not in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    plain = built(D=0).eval()
    fresh = {}
    for D in (0, 2):
        torch.manual_seed(0)
        fresh[D] = build_model(ModelConfig(**{**TINY, "num_nextn_predict_layers": D}), V).state_dict()
    assert all(torch.equal(t, fresh[2][name]) for name, t in fresh[0].items())  # the main model's init is unchanged
    net.load_state_dict(plain.state_dict(), strict=False)  # the perturbations drew after the modules' init
    net.eval()
    with torch.no_grad():
        assert torch.equal(net(tokens), plain(tokens)) and net.mtp_logits is None
        assert torch.equal(net.generate(tokens[:1, :4], 6, temperature=0.0),
                           plain.generate(tokens[:1, :4], 6, temperature=0.0))


def test_parameter_count_includes_the_mtp_modules():
    from meshtrain.models.deepseek_v3 import spec

    net = built()
    plain = built(D=0)
    assert net.num_params() - plain.num_params() == spec.mtp_params(net.cfg)


def with_mtp(folder: Path, out: Path, D: int = 1) -> Path:
    """The model of the ``transformers``-saved ``folder`` with D multi-token prediction layers added (its MTP norms
    perturbed and routers decisive, as :func:`test_deepseek_v3.saved` makes the others), exported to ``out``."""
    ours, cfg = load_hf_model(folder)
    cfg = replace(cfg, num_nextn_predict_layers=D)
    torch.manual_seed(1)
    net = build_model(cfg, cfg.vocab_size)
    net.load_state_dict(ours.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.startswith("mtp.") and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.startswith("mtp.") and name.endswith("mlp.router.weight"):
                p.normal_(0.0, 0.5)
    write_hf_folder(out, net.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    return out


def exported(folder: Path, D: int = 1) -> tuple[torch.nn.Module, Path]:
    net = built(D=D, n_layer=3)
    write_hf_folder(folder, net.state_dict(), net.cfg, V, None, max_shard_bytes=2**30)
    return net, folder


def test_mtp_layers_import_and_export_bit_for_bit(tmp_path):
    """An export writes layer 3 (n_layer) as DeepSeek-V3's layer 61 with its copies of the embedding and head; the
    import reads D = 1 from it and every parameter bit for bit; a second export is the first, tensor for tensor."""
    net, folder = exported(tmp_path / "out")
    first = tensors(folder / hf.SINGLE_FILE)
    layer = {name for name in first if name.startswith("model.layers.3.")}
    assert {"model.layers.3.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight",
            "model.layers.3.shared_head.norm.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.self_attn.kv_b_proj.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.3.mlp.experts.7.down_proj.weight"} <= layer
    assert torch.equal(first["model.layers.3.shared_head.head.weight"], first["lm_head.weight"])
    assert json.loads((folder / hf.CONFIG_FILE).read_text())["num_nextn_predict_layers"] == 1
    ours, cfg = load_hf_model(folder)
    assert cfg.num_nextn_predict_layers == 1
    mine = net.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, mine[name]), name
    write_hf_folder(tmp_path / "again", ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    again = tensors(tmp_path / "again" / hf.SINGLE_FILE)
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], t) for k, t in first.items())


def test_transformers_loads_an_export_with_mtp_layers_and_computes_the_main_logits(tmp_path):
    """``transformers`` reports the MTP layer as unexpected and drops it (as DeepSeek-V3's layer 61), misses nothing,
    and its logits are meshtrain's main head's within the bound of ``test_deepseek_v3``'s import test."""
    net, folder = exported(tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"]), info
    x = torch.randint(0, V, (2, net.cfg.block_size), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = net.eval()(x), theirs.eval()(x).logits
    tol = logits_tolerance(net.cfg.n_layer, tolerance_width(net.cfg), float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_a_transformers_save_without_mtp_layers_imports_the_main_model(tmp_path):
    """``save_pretrained`` writes ``num_nextn_predict_layers = 1`` (the config's default) and no layer 3: the main
    model, as ``transformers`` builds it."""
    folder = saved(tmp_path / "hf")
    assert json.loads((folder / hf.CONFIG_FILE).read_text()).get("num_nextn_predict_layers", 1) == 1
    _, cfg = load_hf_model(folder)
    assert cfg.num_nextn_predict_layers == 0


@pytest.mark.parametrize("claimed, message", [
    (2, "holds layers 3 past its 3 main ones but config.json's num_nextn_predict_layers = 2 gives multi-token "
        "prediction layers 3..4"),
    (0, "holds layers 3 past its 3 main ones but config.json's num_nextn_predict_layers = 0"),
])
def test_mtp_layers_that_do_not_match_the_config_are_one_line_before_launch(claimed, message, tmp_path, capsys):
    _, folder = exported(tmp_path / "out")
    data = json.loads((folder / hf.CONFIG_FILE).read_text())
    (folder / hf.CONFIG_FILE).write_text(json.dumps({**data, "num_nextn_predict_layers": claimed}))
    one_line_error(capsys, ["plan", str(FINETUNE), "--model.init_from", str(folder), "--num-gpus", "1"], message)


@pytest.mark.parametrize("overrides, shown", [
    ({"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}, "parallel.tp_sequence_parallel = True"),
    ({"train.objective": "dpo", "data.packing": "pad"}, "train.objective = 'dpo'")])
def test_a_layout_mtp_is_not_built_for_is_one_line(overrides, shown):
    from meshtrain.config.load import load_config

    base = {"model.type": "deepseek_v3", "model.n_embd": "32", "model.kv_lora_rank": "16",
            "model.qk_nope_head_dim": "8", "model.v_head_dim": "8", "model.ffn_hidden": "16",
            "model.num_nextn_predict_layers": "1"}
    with pytest.raises(ConfigError) as e:
        load_config(None, {**base, **overrides})
    text = str(e.value)
    assert "\n" not in text and "model.num_nextn_predict_layers = 1 (multi-token prediction) is not supported with " \
        f"{shown}" in text, text



def pipeline_halves(net: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, list]:
    """``net`` cut as a 2-stage pipeline cuts it (:func:`meshtrain.parallel.pipeline.split.split_model`'s steps on
    each rank's copy of the whole model): (first chunk, last chunk, [first rank's pruned model, last rank's])."""
    import copy

    first, last = copy.deepcopy(net), copy.deepcopy(net)
    for model in (first, last):
        model.untie_weights()
    first.keep_only({0}, True, False)
    last.keep_only({1}, False, True)
    return first.pipeline_chunk(range(0, 1), True, False), last.pipeline_chunk(range(1, 2), False, True), [first, last]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_pipelines_last_chunk_computes_the_whole_models_mtp_loss_and_gradients(tied):
    """A 2-stage split (no process group: the two chunks called in turn, the last one given the depths' sequences as a
    pipeline step gives them): the MTP loss equals the whole model's, and the embedding's gradient is the sum of the
    first stage's and the last stage's copy (the untied model's ``tok_emb`` kept there, the tied one's head copy), as
    the pipeline's embedding group sums them. The same operators on the same values (the last chunk pads instead of
    cutting, adding only ignored positions), so equal within a few fp32 roundings of values of order 1: 1e-5."""
    net = built(D=2, **({"tie_embeddings": True} if tied else {})).train()
    first, last, (pruned_first, pruned_last) = pipeline_halves(net)
    assert pruned_first.mtp is None and getattr(first, "mtp", None) is None and last.mtp is pruned_last.mtp is not None
    assert (pruned_last.tok_emb is None) == tied
    assert getattr(last, "mtp_embedding", None) is (None if tied else pruned_last.tok_emb)
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, V, (2, 13), generator=g)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    ce = lambda lk, yk: F.cross_entropy(lk.flatten(0, 1), yk.flatten(), reduction="sum")  # noqa: E731
    want = ce(net(tokens), targets) + net.mtp_loss(targets, ce)
    want.backward()
    pairs = net.mtp_sequences(tokens, targets, 2)
    mtp = torch.stack([a for a, _ in pairs] + [t for _, t in pairs], dim=1)  # (B, 2D, T)
    got = ce(last(first(tokens), mtp=mtp), targets) + last.mtp_loss(targets, ce)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    copy = pruned_last.lm_head.weight if tied else pruned_last.tok_emb.weight
    torch.testing.assert_close(pruned_first.tok_emb.weight.grad + copy.grad, net.tok_emb.weight.grad,
                               rtol=0, atol=1e-5 * float(net.tok_emb.weight.grad.abs().max()))
    assert float(pruned_first.tok_emb.weight.grad.abs().sum()) > 0 and float(copy.grad.abs().sum()) > 0


def test_the_v_placements_last_chunk_embeds_with_a_copy_of_its_own():
    """Where one rank holds the first and the last chunk (zbv), the last one's MTP embedding is a parameter of its own,
    equal to ``tok_emb`` (two chunks sharing a parameter would each divide its gradient by the micro-batches), and not
    a parameter of the rank's pruned model (neither optimised nor saved: the pipeline refreshes it every step)."""
    import copy

    model = copy.deepcopy(built(D=1))
    model.untie_weights()
    model.keep_only({0, 1}, True, True)
    last = model.pipeline_chunk(range(1, 2), False, True)
    own = last.mtp_embedding.weight
    assert own is not model.tok_emb.weight and torch.equal(own, model.tok_emb.weight) and own.requires_grad
    assert all(p is not own for p in model.parameters())
