"""GLM-4.5 (``models/glm4_moe``), checked against ``transformers``' ``Glm4MoeForCausalLM``.

``transformers`` builds tiny random models offline in GLM-4.5's shape (grouped-query attention with biases on q, k
and v, RoPE on half of each head, one dense first layer, 8 routed experts and a shared one) and variants: q/k norms
on, experts in 4 groups of which 2 may be used, whole-head RoPE, a tied head and two shared experts, and the fused
expert layout; norms, routing biases and routers are made non-trivial (the init sets them to 1, 0 and small values,
which would hide a norm or bias loaded into the wrong place and leave routing to rounding):

- imported logits equal ``transformers``' within :func:`test_hf.logits_tolerance`;
- every MoE layer routes every token to the same experts with the same weights;
- greedy ``generate`` equals ``transformers``' (which runs its kv cache);
- import -> export is bit-identical with no missing key, and a meshtrain-built model (routing biases moved) exports
  as ``transformers`` computes it;
- the parameter count of ``spec.py`` is the built model's; bad keys are one line each before launch;
- GLM-4.5's multi-token prediction layer (``model.layers.{n_layer}``, DeepSeek-V3's scheme) is read into meshtrain's
  MTP module, whose loss follows the V3 report's equations, and written back bit for bit; ``transformers`` loads such
  an export with the same main logits; a run with ``num_nextn_predict_layers = 0`` drops the layer with the logits of a
  folder without it, bit for bit; a layer count that does not match is one line before launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtrain.cli.export import load_hf_model
from meshtrain.models import hf_io as hf
from meshtrain.models.hf import write_hf_folder
from test_deepseek_v3 import (assert_bad_key, assert_folder_refused, assert_greedy_equal, assert_round_trip,
                              assert_routing_equal, randomised, tensors)
from test_hf import FINETUNE, V, logits_tolerance, one_line_error, reference
from test_moe import save_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, n_group=1, topk_group=1, num_experts_per_tok=3, first_k_dense_replace=1,
             attention_bias=True, use_qk_norm=False, max_position_embeddings=32, rms_norm_eps=1e-5,
             bos_token_id=None, eos_token_id=None)
"""GLM-4.5 in miniature: 4 query heads on 2 kv heads of 12 features (not C / nh = 8), half of them rotated."""
CASES = {
    "glm4.5": {},
    "qk-norm-groups": dict(use_qk_norm=True, attention_bias=False, n_group=4, topk_group=2),
    "full-rope-tied": dict(partial_rotary_factor=1.0, tie_word_embeddings=True, n_shared_experts=2,
                           first_k_dense_replace=2, head_dim=None, norm_topk_prob=False),
}


def saved(folder: Path, fused: bool = False, **overrides) -> Path:
    """A random tiny ``Glm4MoeForCausalLM`` saved into ``folder`` (``save_pretrained``'s per-expert tensors, or with
    ``fused`` the state dict ``transformers`` keeps in memory); norms and biases perturbed, routers decisive, routing
    biases random."""
    spec = {**SHAPE, **overrides}
    if spec.get("head_dim") is None:
        spec.pop("head_dim")
    config = transformers.Glm4MoeConfig(**spec)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(config)
    return save_hf(randomised(model), folder, fused)


def tolerance_width(cfg) -> int:
    """The widest sum of a block, for :func:`test_hf.logits_tolerance`: C, nh*hd (the output projection's), the
    dense and expert widths, the T keys of a softmax, and the k routed plus the shared outputs a token adds."""
    return max(cfg.n_embd, cfg.n_head * cfg.head_size(), cfg.dense_ffn_hidden, cfg.ffn_hidden,
               cfg.block_size) + cfg.num_experts_per_tok + 1


def batch(T: int) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [False, True], ids=["published", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(case, fused, tmp_path):
    """Each logit is within ``2 * n_layer * width * eps * max|logit|`` of ``transformers``' (the summation bound of
    :func:`test_hf.logits_tolerance`; both compute in fp32, in other orders). RoPE on the wrong features, a bias or
    norm loaded into the wrong place, or the selection bias used to weigh the experts are each orders of magnitude
    more."""
    folder = saved(tmp_path / "hf", fused, **CASES[case])
    ours, cfg = load_hf_model(folder)
    assert cfg.type == "glm4_moe" and cfg.n_kv_head == 2
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), reference(folder)(x).logits
    tol = logits_tolerance(cfg.n_layer, tolerance_width(cfg), float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("case", ["glm4.5", "qk-norm-groups"])
def test_every_token_is_routed_as_transformers_routes_it(case, tmp_path):
    """Same experts for every token of every MoE layer, and the same weights within the rounding of a sigmoid of a
    C-term dot product times the scaling factor (``2 * C * eps`` relative, C = 32)."""
    assert_routing_equal(saved(tmp_path / "hf", **CASES[case]))


@pytest.mark.parametrize("case", ["glm4.5", "full-rope-tied"])
def test_greedy_generate_equals_transformers(case, tmp_path):
    """16 greedy tokens after a prompt: meshtrain recomputes the whole context each step, ``transformers`` runs its kv
    cache; the argmax of logits equal within the bound above is the same token."""
    assert_greedy_equal(saved(tmp_path / "hf", **CASES[case]))


@pytest.mark.parametrize("case", ["glm4.5", "qk-norm-groups", "full-rope-tied"])
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes every tensor back bit for bit under the same names, routing biases included; an import
    of the fused form exports the same published tensors; ``transformers`` loads the export with no missing,
    unexpected or mismatched key."""
    assert_round_trip(saved, CASES[case], tmp_path)


def test_a_built_model_exports_as_transformers_computes_it(tmp_path):
    """A meshtrain-built model, its routing biases moved (as ``router_bias_update_rate`` moves them), exports to a
    folder ``transformers`` loads with no missing key and the same logits (the bound of the import test)."""
    from meshtrain.models.build import build_model
    from meshtrain.models.registry import ModelConfig, check_model

    cfg = ModelConfig(type="glm4_moe", n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=32, ffn_hidden=16,
                      num_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, attention_bias=True,
                      qk_norm=True, partial_rotary_factor=0.5, router_bias_update_rate=0.01, dense_ffn_hidden=40)
    check_model(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    with torch.no_grad():
        for name, b in ours.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, V, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), theirs.eval()(x).logits
    width = max(32, 40, cfg.block_size) + cfg.num_experts_per_tok + 1
    torch.testing.assert_close(got, want, rtol=0, atol=logits_tolerance(cfg.n_layer, width, float(want.abs().max())))


# --- multi-token prediction (GLM-4.5's layer 92, GLM-4.5-Air's 46: the layer after the last main one) -----------------

def with_mtp_layer(folder: Path) -> Path:
    """GLM-4.5's checkpoint layout in miniature: a random 4-layer ``Glm4MoeForCausalLM`` saved by ``transformers``
    whose last layer is made the multi-token prediction layer of a 3-layer model (``num_nextn_predict_layers = 1``):
    its block's tensors as they are, its own ``enorm``, ``hnorm``, ``shared_head.norm`` (C,) (near 1) and ``eh_proj``
    (C, 2C) (at ``1/sqrt(2C)``), and the copies of the embedding and the head the published checkpoints repeat in it."""
    saved(folder, num_hidden_layers=4)
    path, C = folder / hf.SINGLE_FILE, SHAPE["hidden_size"]
    state, g = load_file(path), torch.Generator().manual_seed(2)
    own = {name: 1 + 0.1 * torch.randn(C, generator=g) for name in ("enorm", "hnorm", "shared_head.norm")}
    own["eh_proj"] = torch.randn(C, 2 * C, generator=g) / (2 * C) ** 0.5
    state.update({f"model.layers.3.{name}.weight": t for name, t in own.items()})
    state.update({"model.layers.3.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                  "model.layers.3.shared_head.head.weight": state["lm_head.weight"].clone()})
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((folder / hf.CONFIG_FILE).read_text())
    (folder / hf.CONFIG_FILE).write_text(json.dumps({**config, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    return folder


def _builds_mtp() -> bool:
    from meshtrain.models.build import build_model
    from meshtrain.models.registry import ModelConfig

    cfg = ModelConfig(type="glm4_moe", n_layer=1, n_head=2, n_embd=8, ffn_hidden=4, num_experts=2,
                      num_experts_per_tok=1, first_k_dense_replace=0, num_nextn_predict_layers=1)
    return hasattr(build_model(cfg, 8), "mtp")


needs_mtp_modules = pytest.mark.skipif(not _builds_mtp(), reason="glm4_moe/model.py builds no MTP modules yet")
"""The tests that import into meshtrain's MTP modules: ``Glm4Moe`` builds them (DeepSeek-V3's ``MTPModule`` around a
``Glm4MoeBlock``) once its model change lands; the format's checks run without it."""


@needs_mtp_modules
def test_the_mtp_layer_imports_into_the_mtp_module_and_exports_bit_for_bit(tmp_path):
    """Layer 3's own tensors land in ``mtp.0``'s modules (``enorm``, ``hnorm``, ``eh_proj``, ``norm`` from
    ``shared_head.norm``: two norms swapped would pass a round trip, not this) and its block in ``mtp.0.block``, GLM's
    attention with its biases; the export writes every tensor of the folder back bit for bit, no more, no fewer, the
    copies of the embedding and head included."""
    folder = with_mtp_layer(tmp_path / "hf")
    theirs = tensors(folder / hf.SINGLE_FILE)
    ours, cfg = load_hf_model(folder)
    assert cfg.num_nextn_predict_layers == 1
    mine = ours.state_dict()
    for name, source in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm"),
                         ("block.attn.q", "self_attn.q_proj"), ("block.mlp.router", "mlp.gate")):
        assert torch.equal(mine[f"mtp.0.{name}.weight"], theirs[f"model.layers.3.{source}.weight"]), name
    assert torch.equal(mine["mtp.0.block.attn.q.bias"], theirs["model.layers.3.self_attn.q_proj.bias"])
    write_hf_folder(tmp_path / "out", mine, cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    again = tensors(tmp_path / "out" / hf.SINGLE_FILE)
    assert again.keys() == theirs.keys()
    assert all(torch.equal(again[k], t) for k, t in theirs.items())
    assert json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())["num_nextn_predict_layers"] == 1


@needs_mtp_modules
def test_the_mtp_loss_of_an_imported_model_follows_the_report_equations(tmp_path):
    """The imported model's MTP loss equals the V3 report's Eq. 21-25 written out on its weights
    (:func:`test_deepseek_v3_mtp.report_mtp_loss`) within ``2 x`` the logit bound over the n_layer + 1 blocks (a
    token's cross-entropy moves by at most twice its logits' largest change), and its gradient reaches ``mtp.0``;
    GLM's partial RoPE in the MTP block, or the embedding and hidden halves of ``eh_proj`` swapped, are O(1) off."""
    from test_deepseek_v3_mtp import ours_mtp_loss, report_mtp_loss

    net, cfg = load_hf_model(with_mtp_layer(tmp_path / "hf"))
    seq = batch(cfg.block_size + 1)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    got, want = ours_mtp_loss(net.train(), tokens, targets), report_mtp_loss(net, tokens, targets)
    got.backward()
    assert net.mtp[0].eh_proj.weight.grad.abs().sum() > 0
    with torch.no_grad():
        scale = max(float(net(tokens).abs().max()), float(net.mtp_logits[0].abs().max()))
    tol = 2 * logits_tolerance(cfg.n_layer + 1, max(2 * cfg.n_embd, tolerance_width(cfg)), scale)
    got, want = float(got.detach()), float(want.detach())
    assert abs(got - want) <= tol and got > 0.1, (got, want, tol)


@needs_mtp_modules
def test_transformers_loads_an_export_with_the_mtp_layer_and_computes_the_main_logits(tmp_path):
    """``transformers`` reports layer 3 as unexpected and drops it, misses nothing, and its logits are meshtrain's main
    head's within the import test's bound."""
    ours, cfg = load_hf_model(with_mtp_layer(tmp_path / "hf"))
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"]), info
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), theirs.eval()(x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=logits_tolerance(cfg.n_layer, tolerance_width(cfg),
                                                                          float(want.abs().max())))


def test_a_run_without_mtp_drops_the_layer_with_the_logits_of_a_folder_without_it(tmp_path):
    """``model.num_nextn_predict_layers = 0`` beside ``init_from`` (a training key: the run's where given) checks
    layer 3 and reads none of it: the logits are bit for bit those of the same folder with layer 3 removed (which
    imports as ``transformers`` saves GLM-4.5, ``num_nextn_predict_layers = 1`` and no layer: 0), and an export writes
    no layer 3."""
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import load_hf_weights
    from meshtrain.models.registry import check_hf_weights

    folder = with_mtp_layer(tmp_path / "hf")
    cfg = load_config(FINETUNE, {"model.init_from": str(folder), "model.num_nextn_predict_layers": "0"}).model
    check_hf_weights(folder, cfg)
    ours = build_model(cfg, cfg.vocab_size)
    load_hf_weights(ours, folder, cfg)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / hf.CONFIG_FILE).write_text((folder / hf.CONFIG_FILE).read_text())
    save_file({k: t for k, t in tensors(folder / hf.SINGLE_FILE).items() if not k.startswith("model.layers.3.")},
              str(tmp_path / "plain" / hf.SINGLE_FILE), metadata={"format": "pt"})
    plain, plain_cfg = load_hf_model(tmp_path / "plain")
    assert cfg.num_nextn_predict_layers == plain_cfg.num_nextn_predict_layers == 0
    x = batch(cfg.block_size)
    with torch.no_grad():
        assert torch.equal(ours.eval()(x), plain.eval()(x))
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
    assert not any(name.startswith("model.layers.3.") for name in tensors(tmp_path / "out" / hf.SINGLE_FILE))


def _claims(count: int):
    def edit(folder: Path) -> list[str]:
        config = json.loads((folder / hf.CONFIG_FILE).read_text())
        (folder / hf.CONFIG_FILE).write_text(json.dumps({**config, "num_nextn_predict_layers": count}))
        return []
    return edit


def _stray_layer(folder: Path) -> list[str]:
    from test_hf_defaults import with_tensors

    with_tensors(folder, {"model.layers.46.eh_proj.weight": torch.ones(SHAPE["hidden_size"], 2 * SHAPE["hidden_size"])})
    return []


@pytest.mark.parametrize("edit, message", [
    (_claims(2), "holds layers 3 past its 3 main ones but config.json's num_nextn_predict_layers = 2 gives "
                 "multi-token prediction layers 3..4"),
    (_claims(0), "holds layers 3 past its 3 main ones but config.json's num_nextn_predict_layers = 0"),
    (_stray_layer, "holds layers 3..46 past its 3 main ones"),
    (lambda folder: ["--model.num_nextn_predict_layers", "2"],
     "model.num_nextn_predict_layers = 2 but the checkpoint's multi-token prediction layers past its 3 main ones "
     "number 1: use 1, or 0 to train without them"),
], ids=["config-2", "config-0", "layer-46", "run-2"])
def test_mtp_layers_that_do_not_match_are_one_line_before_launch(edit, message, tmp_path, capsys):
    """``config.json`` claiming another count than the layers held, a layer past them (GLM-4.5-Air's index in a
    3-layer model) or a run asking for another count: ``train`` stops before launch in one line."""
    folder = with_mtp_layer(tmp_path / "hf")
    extra = edit(folder)
    argv = ["train", str(FINETUNE), "--model.init_from", str(folder), "--model.block_size", "16", "--out",
            str(tmp_path / "run"), "--nproc", "1", *extra]
    one_line_error(capsys, argv, message)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", [{}, dict(attention_bias=True, qk_norm=True, first_k_dense_replace=0,
                                            n_shared_experts=0), dict(tie_embeddings=True, first_k_dense_replace=2)])
def test_parameter_count_of_the_spec_equals_the_built_model(model):
    from meshtrain.models.build import build_model
    from meshtrain.models.glm4_moe import spec
    from meshtrain.models.registry import ModelConfig

    cfg = ModelConfig(type="glm4_moe", n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=32, ffn_hidden=16,
                      num_experts=8, **model)
    torch.manual_seed(0)
    built = build_model(cfg, V)
    embeddings = V * cfg.n_embd * (1 if cfg.tie_embeddings else 2) + cfg.n_embd
    assert built.num_params() == embeddings + sum(spec.block_params(cfg, i) for i in range(cfg.n_layer))


BAD_KEYS = [
    ({"model.n_group": "2", "model.topk_group": "3"}, "model.topk_group = 3 must be in [1, model.n_group = 2]"),
    ({"model.num_experts": "6", "model.n_group": "4"}, "model.num_experts = 6 must be divisible by model.n_group = 4"),
    ({"model.partial_rotary_factor": "0.2"}, "model.partial_rotary_factor = 0.2 must be in (0, 1] with int(head size"),
    ({"model.shared_expert_ffn": "16"}, "model.shared_expert_ffn = 16 is not supported by model.type = 'glm4_moe'"),
    ({"model.first_k_dense_replace": "4"}, "model.first_k_dense_replace = 4 must be in [0, model.n_layer = 4)"),
    ({"model.kv_lora_rank": "16"}, "model.kv_lora_rank = 16 applies to model.type = 'deepseek_v3' or 'deepseek_v2' only"),
]


@pytest.mark.parametrize("overrides, message", BAD_KEYS)
def test_bad_keys_are_one_line_before_launch(overrides, message):
    assert_bad_key("glm4_moe", overrides, message, base={"model.n_embd": "32", "model.n_kv_head": "2",
                                                         "model.ffn_hidden": "16", "model.num_experts": "8"})


@pytest.mark.parametrize("config, message", [
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type = 'linear' is not "
                                                                                      "supported"),
    ({"topk_group": 5}, "describes a model meshtrain cannot build: model.topk_group = 5 must be in [1, model.n_group"),
])
def test_a_folder_meshtrain_cannot_build_is_one_line_before_launch(config, message, tmp_path, capsys):
    """``meshtrain plan`` (the cheapest command that reads ``model.init_from``) refuses the folder in one line."""
    assert_folder_refused(saved, config, message, tmp_path, capsys)


# --- layouts: one launch of two 2-rank runs, each against one process ----------------------------------------

LAYOUTS = {
    "ep2-dp2-bias": {"parallel.ep": "2", "batch.micro_batch_size": "2", "model.router_bias_update_rate": "0.05"},
    "tp2-sp": {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"},
}
"""ep2 over DDP dp2 (the routing biases moved after every step by counts summed over dp) and tp2 with sequence
parallelism (q, k, v split by head with their biases, the per-head q/k norms, the shared experts split, each MoE layer
gathering the whole sequence); the global batch is the reference's, a load-balancing weight of 1
(:data:`test_moe.BALANCED`) so that a count summed over the wrong ranks moves the loss."""
LAYOUT_MODEL = dict(use_qk_norm=True, n_group=4, topk_group=2)
"""GLM-4.5's shape (q/k/v biases, half RoPE) with q/k norms and group-limited routing: every option a layout splits."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from layout_worker import launch_layouts, reference_run
    from test_hf import model_overrides
    from test_moe import BALANCED

    root = tmp_path_factory.mktemp("glm4_moe_layouts")
    base = {**model_overrides(saved(root / "hf", **LAYOUT_MODEL)), **BALANCED}
    one = {name: reference_run(root / f"one-{name}", {**base, **{k: v for k, v in o.items() if k.startswith("model.")}},
                               config=FINETUNE) for name, o in LAYOUTS.items()}
    (root / "w2").mkdir()
    return launch_layouts(2, root / "w2", {n: {**base, **o} for n, o in LAYOUTS.items()}, config=FINETUNE), one


@pytest.mark.slow  # one 2-rank launch and two references (~1-2 min on 2 cores)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_train_as_one_process(trained, name):
    """Every step's loss and the step-1 gradients equal one process's within the contract's tolerance
    (:func:`conftest.assert_close_losses`, :func:`conftest.assert_close_grads`)."""
    from conftest import assert_close_grads, assert_close_losses

    results, one = trained
    assert_close_losses(results[name][0], one[name][0])
    assert_close_grads(results[name][1], one[name][1])
