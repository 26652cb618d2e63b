"""DeepSeek-V3 (``models/deepseek_v3``), checked against ``transformers``' ``DeepseekV3ForCausalLM``.

``transformers`` builds tiny random models offline, in DeepSeek-V3's shape (q through the low-rank path, 8 experts in
4 groups of which 2 may be used, one dense first layer, interleaved RoPE), Kimi K2's and Moonlight's in miniature (one
group, many experts, q projected directly), with YaRN's scaling, and in ``transformers``' fused expert layout; their
norms, routing biases and routers are made non-trivial (the init sets them to 1, 0 and small values, which would hide
a norm or bias loaded into the wrong place and leave routing to rounding):

- imported logits equal ``transformers``' within :func:`test_hf.logits_tolerance`, the routing width counted
  (:func:`tolerance_width`);
- every MoE layer routes every token to the same experts with the same weights;
- greedy ``generate`` equals ``transformers``' greedy decoding (which runs its latent cache);
- import -> export is bit-identical with no missing key, a fused import exports the published form, and a
  meshtrain-built model (routing biases trained) exports as ``transformers`` computes it;
- the parameter count of ``spec.py`` is the built model's;
- keys meshtrain cannot build are one line each before launch, and ``meshtrain plan`` says it does not model the
  family yet in one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from meshtrain.cli.export import load_hf_model
from meshtrain.errors import ConfigError
from meshtrain.models import hf_io as hf
from meshtrain.models.hf import write_hf_folder
from test_hf import EPS32, FINETUNE, V, logits_tolerance, one_line_error, reference
from test_moe import save_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=12,
             qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
             max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
"""DeepSeek-V3 in miniature: dn + dr = 12 and dv = 12 unequal to the width's C / nh = 8."""
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
CASES = {
    "v3": {},
    "kimi-k2": dict(n_routed_experts=16, n_group=1, topk_group=1, num_experts_per_tok=4, q_lora_rank=None),
    "moonlight": dict(n_routed_experts=12, n_group=1, topk_group=1, q_lora_rank=None, rope_interleave=False,
                      tie_word_embeddings=True, n_shared_experts=2, first_k_dense_replace=2),
    "v3-yarn": dict(rope_parameters=YARN),
}


def saved(folder: Path, fused: bool = False, **overrides) -> Path:
    """A random tiny ``DeepseekV3ForCausalLM`` saved into ``folder`` (``save_pretrained``'s per-expert tensors, or with
    ``fused`` the state dict ``transformers`` keeps in memory); norms perturbed, routers decisive, biases random."""
    config = transformers.DeepseekV3Config(**{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    return save_hf(randomised(model), folder, fused)


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a ``transformers`` MoE model fresh from its config) with every norm and bias moved off its default by
    0.1 x N(0, 1), its routers' weights N(0, 0.5) so that routing is decisive, and its selection biases 0.2 x N(0, 1):
    a weight loaded into the wrong place then moves the logits far beyond their rounding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def tolerance_width(cfg) -> int:
    """The widest sum of a block, for :func:`test_hf.logits_tolerance`: C, the dense and expert widths, the latent
    ranks, the T keys of a softmax, and the k routed plus one shared output a token adds."""
    return max(cfg.n_embd, cfg.dense_ffn_hidden, cfg.ffn_hidden, cfg.kv_lora_rank, cfg.q_lora_rank,
               cfg.block_size) + cfg.num_experts_per_tok + 1


def batch(T: int) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [False, True], ids=["published", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(case, fused, tmp_path):
    """Each logit is within ``2 * n_layer * width * eps * max|logit|`` of ``transformers``' (the summation bound of
    :func:`test_hf.logits_tolerance`; both compute in fp32, in other orders). A latent norm's epsilon, the RoPE pair
    layout, YaRN's two mscales or a bias used to weigh the experts are each orders of magnitude more."""
    folder = saved(tmp_path / "hf", fused, **CASES[case])
    ours, cfg = load_hf_model(folder)
    assert cfg.type == "deepseek_v3" and cfg.first_k_dense_replace == SHAPE["first_k_dense_replace"] + (
        case == "moonlight")
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), reference(folder)(x).logits
    tol = logits_tolerance(cfg.n_layer, tolerance_width(cfg), float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def their_routing(model, x: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (experts (N, k), weights (N, k))} of ``transformers``' routers over ``x``, each row in expert order."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: found.__setitem__(i, (out[2], out[1])))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return {i: by_expert(*found[i]) for i in found}


def by_expert(experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return experts.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("case", ["v3", "kimi-k2"])
def test_every_token_is_routed_as_transformers_routes_it(case, tmp_path):
    """Same experts for every token of every MoE layer, and the same weights within the rounding of a sigmoid of a
    C-term dot product times the scaling factor (``2 * C * eps`` relative, C = 32); the choice margins of these seeds
    are far above the hidden states' rounding, so no near-tie decides a test run."""
    assert_routing_equal(saved(tmp_path / "hf", **CASES[case]))


def assert_routing_equal(folder: Path) -> None:
    """meshtrain's import of ``folder`` routes every token of every MoE layer to ``transformers``' experts, with the
    weights within the rounding of a C-term dot product through the score function, times the scaling factor
    (``2 * C * eps`` relative)."""
    ours, cfg = load_hf_model(folder)
    x = batch(cfg.block_size)
    theirs = their_routing(reference(folder), x)
    with torch.no_grad():
        ours.eval()(x)
    assert sorted(theirs) == list(range(cfg.first_k_dense_replace, cfg.n_layer))
    for i, (experts, weights) in theirs.items():
        mlp = ours.blocks[str(i)].mlp
        _, our_weights, our_experts = mlp.route(ours_hidden(ours, x, i))
        assert torch.equal(mlp.last_experts.sort(dim=-1).values, experts), f"layer {i}"
        got_experts, got_weights = by_expert(our_experts, our_weights)
        assert torch.equal(got_experts, experts)
        torch.testing.assert_close(got_weights, weights, rtol=2 * cfg.n_embd * EPS32 * cfg.routed_scaling_factor,
                                   atol=0)


def ours_hidden(model, x: torch.Tensor, layer: int) -> torch.Tensor:
    """The (N, C) input of block ``layer``'s MLP (after its ``ln_2``) in ``model`` over ``x``."""
    seen = {}
    h = model.blocks[str(layer)].mlp.register_forward_hook(lambda mod, args, out: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(x)
    h.remove()
    return seen["x"].reshape(-1, seen["x"].shape[-1])


@pytest.mark.parametrize("case", ["v3", "moonlight"])
def test_greedy_generate_equals_transformers(case, tmp_path):
    """16 greedy tokens after a prompt: meshtrain recomputes the whole context each step, ``transformers`` runs its
    cache of the compressed latent; the argmax of logits equal within the bound above is the same token."""
    assert_greedy_equal(saved(tmp_path / "hf", **CASES[case]))


def assert_greedy_equal(folder: Path) -> None:
    """16 greedy tokens after a 6-token prompt: meshtrain's import of ``folder`` (the whole context recomputed each
    step) and ``transformers``' model of it (its cache) pick the same tokens."""
    ours, _ = load_hf_model(folder)
    prompt = batch(6)[:1]
    got = ours.eval().generate(prompt, 16, temperature=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = reference(folder).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                          do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def assert_round_trip(saved: Callable[..., Path], case: dict, tmp_path: Path) -> Any:
    """Import -> export of the folder ``saved(folder, fused, **case)`` writes, per-expert and fused: every tensor
    written back bit for bit under the published names, and ``transformers`` loading the export with no missing,
    unexpected or mismatched key. Returns transformers' model of the export."""
    folder = saved(tmp_path / "hf", **case)
    original = tensors(folder / hf.SINGLE_FILE)
    for name, fused in (("out", False), ("out-fused", True)):
        source = saved(tmp_path / f"hf-{name}", fused, **case) if fused else folder
        ours, cfg = load_hf_model(source)
        write_hf_folder(tmp_path / name, ours.state_dict(), cfg, cfg.vocab_size, None, max_shard_bytes=2**30)
        exported = tensors(tmp_path / name / hf.SINGLE_FILE)
        assert exported.keys() == original.keys(), (name, exported.keys() ^ original.keys())
        for key, t in original.items():
            assert torch.equal(exported[key], t), (name, key)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return theirs


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("case", ["v3", "moonlight"])
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes every tensor back bit for bit under the same names, routing biases included; an import
    of the fused form exports the same published tensors; ``transformers`` loads the export with no missing,
    unexpected or mismatched key."""
    assert_round_trip(saved, CASES[case], tmp_path)


@pytest.mark.parametrize("model", [
    dict(q_lora_rank=24, n_group=2, topk_group=1, router_bias_update_rate=0.01),
    dict(rope_interleave=False, tie_embeddings=True, n_shared_experts=2, dense_ffn_hidden=40),
    dict(yarn_factor=4.0, rope_original_max_positions=8, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)])
def test_a_built_model_exports_as_transformers_computes_it(model, tmp_path):
    """A meshtrain-built model, its routing biases moved (as ``router_bias_update_rate`` moves them), exports to a
    folder ``transformers`` loads with no missing key and the same logits (the bound of the import test)."""
    from meshtrain.models.build import build_model
    from meshtrain.models.registry import ModelConfig, check_model

    cfg = ModelConfig(type="deepseek_v3", n_layer=3, n_head=4, n_embd=32, block_size=32, ffn_hidden=16,
                      num_experts=8, num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=12, **model)
    check_model(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    with torch.no_grad():
        for name, b in ours.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, V, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), theirs.eval()(x).logits
    width = max(32, 40, cfg.block_size) + cfg.num_experts_per_tok + 2
    torch.testing.assert_close(got, want, rtol=0, atol=logits_tolerance(cfg.n_layer, width, float(want.abs().max())))


@pytest.mark.parametrize("model", [{}, dict(q_lora_rank=24, first_k_dense_replace=0, n_shared_experts=0),
                                   dict(tie_embeddings=True, first_k_dense_replace=2)])
def test_parameter_count_of_the_spec_equals_the_built_model(model):
    from meshtrain.models.build import build_model
    from meshtrain.models.deepseek_v3 import spec
    from meshtrain.models.registry import ModelConfig

    cfg = ModelConfig(type="deepseek_v3", n_layer=3, n_head=4, n_embd=32, block_size=32, ffn_hidden=16,
                      num_experts=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, **model)
    torch.manual_seed(0)
    built = build_model(cfg, V)
    embeddings = V * cfg.n_embd * (1 if cfg.tie_embeddings else 2) + cfg.n_embd
    assert built.num_params() == embeddings + sum(spec.block_params(cfg, i) for i in range(cfg.n_layer))


BAD_KEYS = [
    ({"model.n_group": "2", "model.topk_group": "3"}, "model.topk_group = 3 must be in [1, model.n_group = 2]"),
    ({"model.num_experts": "6", "model.n_group": "4"}, "model.num_experts = 6 must be divisible by model.n_group = 4"),
    ({"model.num_experts": "4", "model.n_group": "4"}, "must be >= 2: a group is ranked by the sum of its two best"),
    ({"model.qk_rope_head_dim": "5"}, "model.qk_rope_head_dim = 5 must be even"),
    ({"model.num_nextn_predict_layers": "-1"}, "model.num_nextn_predict_layers = -1 must be >= 0"),
    ({"model.mtp_loss_weight": "-0.1"}, "model.mtp_loss_weight = -0.1 must be a finite number >= 0"),
    ({"model.n_kv_head": "2"}, "model.n_kv_head = 2 is not supported by model.type = 'deepseek_v3'"),
    ({"model.first_k_dense_replace": "4"}, "model.first_k_dense_replace = 4 must be in [0, model.n_layer = 4)"),
    ({"model.n_group": "4", "model.topk_group": "1", "model.num_experts_per_tok": "3"},
     "model.num_experts_per_tok = 3 must be <= the 2 experts of model.topk_group = 1 groups"),
]


@pytest.mark.parametrize("overrides, message", BAD_KEYS)
def test_bad_keys_are_one_line_before_launch(overrides, message):
    assert_bad_key("deepseek_v3", overrides, message)


MLA_KEYS = {"model.n_embd": "32", "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "8", "model.v_head_dim": "8",
            "model.ffn_hidden": "16"}
"""A tiny latent-attention model's keys (deepseek_v3, deepseek_v2)."""


def assert_bad_key(model_type: str, overrides: dict[str, str], message: str, base: dict[str, str] = MLA_KEYS) -> None:
    """A tiny ``model_type`` model (``base``'s keys) with ``overrides``: config loading raises one line holding
    ``message``."""
    from meshtrain.config.load import load_config

    base = {"model.type": model_type, **base}
    with pytest.raises(ConfigError) as e:
        load_config(None, {**base, **overrides})
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize("config, message", [
    ({"attention_bias": True}, "attention_bias = True is not supported (MLA's projections have no biases)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'linear' is not "
                                                                                      "supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "of rope_type 'yarn' has no factor"),
    ({"topk_group": 5}, "describes a model meshtrain cannot build: model.topk_group = 5 must be in [1, model.n_group"),
])
def test_a_folder_meshtrain_cannot_build_is_one_line_before_launch(config, message, tmp_path, capsys):
    """``meshtrain plan`` (the cheapest command that reads ``model.init_from``) refuses the folder in one line."""
    assert_folder_refused(saved, config, message, tmp_path, capsys)


def assert_folder_refused(saved: Callable[..., Path], config: dict, message: str, tmp_path: Path, capsys) -> None:
    """The folder ``saved`` writes, its config.json updated with ``config``: ``meshtrain plan`` (the cheapest command
    that reads ``model.init_from``) refuses it in one line holding ``message``."""
    import json

    folder = saved(tmp_path / "hf")
    data = json.loads((folder / hf.CONFIG_FILE).read_text())
    data.pop("rope_scaling", None)  # the legacy twin of rope_parameters, which some cases set
    (folder / hf.CONFIG_FILE).write_text(json.dumps({**data, **config}))
    one_line_error(capsys, ["plan", str(FINETUNE), "--model.init_from", str(folder), "--num-gpus", "1"], message)


# `meshtrain plan` on this family: tests/test_planner_deepseek_v3.py (the planner models it now).


# --- data parallelism: DDP and FSDP2 equal one process ---------------------------------------------------------

LAYOUTS = {
    "ddp-dp2-bias": {"batch.micro_batch_size": "2", "model.router_bias_update_rate": "0.05"},
    "fsdp2-dp2": {"parallel.zero_stage": "3", "batch.micro_batch_size": "2"},
}
"""Each layout's global batch is the reference's 4 samples (``STEPS``: micro-batches of 4); a load-balancing weight
of 1 (:data:`test_moe.BALANCED`) so that a count summed over the wrong ranks moves the loss; the routing biases
move after every step by counts summed over dp (``router_bias_update_rate``), which a rank's own count would not."""
MTP = {"model.mtp_loss_weight": "1.0", "model.router_aux_loss_coef": "0"}
MTP_LAYOUTS = {
    "ddp-dp2-ga2-mtp": {"batch.micro_batch_size": "1", "batch.gradient_accumulation_steps": "2", **MTP},
    "fsdp2-dp2-mtp": {"parallel.zero_stage": "3", "batch.micro_batch_size": "2", **MTP},
}
"""The same from a checkpoint with one multi-token prediction layer (:func:`test_deepseek_v3_mtp.with_mtp`), its loss at
weight 1 so that an MTP loss normalised per micro-batch or per rank, or left out of a micro-batch, moves the
gradients; no load-balancing loss, whose per-micro-batch statistics differ at another micro-batch size by design."""


@pytest.fixture(scope="module")
def dp_trained(tmp_path_factory):
    from test_hf import model_overrides
    from test_moe import BALANCED
    from layout_worker import launch_layouts, reference_run

    from test_deepseek_v3_mtp import with_mtp

    root = tmp_path_factory.mktemp("deepseek_layouts")
    folder = saved(root / "hf")
    base = {**model_overrides(folder), **BALANCED}
    mtp = {"model.init_from": str(with_mtp(folder, root / "hf-mtp"))}
    layouts = {**LAYOUTS, **{name: {**o, **mtp} for name, o in MTP_LAYOUTS.items()}}
    one = {name: reference_run(root / f"one-{name}", {**base, **{k: v for k, v in o.items() if k.startswith("model.")}},
                               config=FINETUNE) for name, o in layouts.items()}
    (root / "w2").mkdir()
    return launch_layouts(2, root / "w2", {n: {**base, **o} for n, o in layouts.items()}, config=FINETUNE), one, root


@pytest.mark.slow  # one 2-rank launch and four references (~2 min on 2 cores)
@pytest.mark.parametrize("name", [*LAYOUTS, *MTP_LAYOUTS])
def test_data_parallel_training_equals_one_process(dp_trained, name):
    """Every step's loss and the step-1 gradients equal one process's within the contract's tolerance
    (:func:`conftest.assert_close_losses`, :func:`conftest.assert_close_grads`); with multi-token prediction, so does
    every step's ``mtp_loss`` record (the same relative tolerance as the loss's: the same sums, reduced alike)."""
    from conftest import assert_close_grads, assert_close_losses, read_records

    results, one, root = dp_trained
    assert_close_losses(results[name][0], one[name][0])
    assert_close_grads(results[name][1], one[name][1])
    if name in MTP_LAYOUTS:
        got, want = ({r["step"]: r["mtp_loss"] for r in read_records(out) if "mtp_loss" in r}
                     for out in (root / "w2" / name, root / f"one-{name}"))
        assert want and got.keys() == want.keys()
        assert_close_losses(got, want)
