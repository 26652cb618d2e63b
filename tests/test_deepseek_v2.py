"""DeepSeek-V2 (``models/deepseek_v2``), checked against ``transformers``' ``DeepseekV2ForCausalLM``.

``transformers`` builds tiny random models offline in V2-Lite's shape (q projected directly, greedy softmax routing over
8 experts, 2 shared, one dense first layer) and V2's (q's low-rank path, "group_limited_greedy" over 4 groups of which
2 may be used), in the published and the fused expert layout; norms and routers are made non-trivial:

- imported logits equal ``transformers``' within :func:`test_hf.logits_tolerance`;
- every MoE layer routes every token to the same experts with the same weights;
- greedy ``generate`` equals ``transformers``';
- import -> export is bit-identical with no missing key (V2 has no selection bias: none is written);
- bad keys are one line each before launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshtrain.cli.export import load_hf_model
from meshtrain.models.hf import write_hf_folder
from test_deepseek_v3 import (assert_bad_key, assert_folder_refused, assert_greedy_equal, assert_round_trip,
                              assert_routing_equal, randomised, tolerance_width)
from test_hf import FINETUNE, V, logits_tolerance, reference
from test_moe import save_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
             routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=12,
             qk_nope_head_dim=8, topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=1,
             max_position_embeddings=32, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)
"""DeepSeek-V2-Lite in miniature: dn + dr = 12 and dv = 12 unequal to the width's C / nh = 8."""
CASES = {
    "v2-lite": {},
    "v2-groups": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2),
}


def saved(folder: Path, fused: bool = False, **overrides) -> Path:
    """A random tiny ``DeepseekV2ForCausalLM`` saved into ``folder``; norms perturbed, routers decisive."""
    config = transformers.DeepseekV2Config(**{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(config)
    return save_hf(randomised(model), folder, fused)


def batch(T: int) -> torch.Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [False, True], ids=["published", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(case, fused, tmp_path):
    """Each logit is within ``2 * n_layer * width * eps * max|logit|`` of ``transformers``' (the summation bound of
    :func:`test_hf.logits_tolerance`, the width of :func:`test_deepseek_v3.tolerance_width`; both in fp32, in other
    orders). Sigmoid instead of softmax scores, a group ranked by another rule, or renormalised weights are each
    orders of magnitude more."""
    folder = saved(tmp_path / "hf", fused, **CASES[case])
    ours, cfg = load_hf_model(folder)
    assert cfg.type == "deepseek_v2" and cfg.topk_method == CASES[case].get("topk_method", "greedy")
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), reference(folder)(x).logits
    tol = logits_tolerance(cfg.n_layer, tolerance_width(cfg), float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("case", CASES)
def test_every_token_is_routed_as_transformers_routes_it(case, tmp_path):
    """Same experts for every token of every MoE layer, and the same weights within the rounding of a softmax of
    C-term dot products times the scaling factor (``2 * C * eps`` relative, C = 32)."""
    assert_routing_equal(saved(tmp_path / "hf", **CASES[case]))


@pytest.mark.parametrize("case", CASES)
def test_greedy_generate_equals_transformers(case, tmp_path):
    """16 greedy tokens after a prompt: meshtrain recomputes the whole context each step, ``transformers`` runs its
    latent cache; the argmax of logits equal within the bound above is the same token."""
    assert_greedy_equal(saved(tmp_path / "hf", **CASES[case]))


@pytest.mark.parametrize("case", CASES)
def test_import_export_round_trip_is_bit_identical(case, tmp_path):
    """Import -> export writes every tensor back bit for bit under the same names (no selection bias added); an import
    of the fused form exports the same published tensors; ``transformers`` loads the export with no missing,
    unexpected or mismatched key."""
    theirs = assert_round_trip(saved, CASES[case], tmp_path)
    assert type(theirs).__name__ == "DeepseekV2ForCausalLM"
    assert theirs.config.topk_method == CASES[case].get("topk_method", "greedy")


def test_a_built_model_exports_as_transformers_computes_it(tmp_path):
    """A meshtrain-built V2 (q's low-rank path, group-limited routing) exports to a folder ``transformers`` loads with no
    missing key and the same logits (the bound of the import test)."""
    from meshtrain.models.build import build_model
    from meshtrain.models.registry import ModelConfig, check_model

    cfg = ModelConfig(type="deepseek_v2", n_layer=3, n_head=4, n_embd=32, block_size=32, ffn_hidden=16, num_experts=8,
                      num_experts_per_tok=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                      q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
                      routed_scaling_factor=1.5, dense_ffn_hidden=40)
    check_model(cfg)
    torch.manual_seed(0)
    ours = build_model(cfg, V)
    write_hf_folder(tmp_path / "out", ours.state_dict(), cfg, V, None, max_shard_bytes=2**30)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert type(theirs).__name__ == "DeepseekV2ForCausalLM" and theirs.config.topk_method == "group_limited_greedy"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    x = batch(cfg.block_size)
    with torch.no_grad():
        got, want = ours.eval()(x), theirs.eval()(x).logits
    tol = logits_tolerance(cfg.n_layer, tolerance_width(cfg), float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)

BAD_KEYS = [
    ({"model.topk_method": "noaux_tc"}, "model.topk_method = 'noaux_tc' is not valid: use one of greedy, "
                                        "group_limited_greedy"),
    ({"model.n_group": "2"}, "model.n_group = 2 needs model.topk_method = 'group_limited_greedy'"),
    ({"model.router_bias_update_rate": "0.01"}, "model.router_bias_update_rate = 0.01 is not supported by model.type "
                                                "= 'deepseek_v2'"),
    ({"model.num_nextn_predict_layers": "1"}, "model.num_nextn_predict_layers = 1 is not supported by model.type = "
                                              "'deepseek_v2'"),
]


@pytest.mark.parametrize("overrides, message", BAD_KEYS)
def test_bad_keys_are_one_line_before_launch(overrides, message):
    assert_bad_key("deepseek_v2", overrides, message)


@pytest.mark.parametrize("config, message", [
    ({"topk_method": "noaux_tc"}, "topk_method = 'noaux_tc' is not supported (DeepSeek-V2's softmax routers)"),
    ({"norm_topk_prob": True}, "norm_topk_prob = True is not supported"),
    ({"attention_bias": True}, "attention_bias = True is not supported (MLA's projections have no biases)"),
])
def test_a_folder_meshtrain_cannot_build_is_one_line_before_launch(config, message, tmp_path, capsys):
    """``meshtrain plan`` (the cheapest command that reads ``model.init_from``) refuses the folder in one line."""
    assert_folder_refused(saved, config, message, tmp_path, capsys)


def test_the_planner_plans_the_family(capsys):
    """``meshtrain plan`` models deepseek_v2 with DeepSeek-V3's numbers (MLA, shared experts; its parameters and FLOPs
    against the built model: ``tests/test_planner_glm_v2.py``) and ranks layouts for it."""
    import json

    from meshtrain.cli.main import main as cli_main

    config = Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.toml"
    assert cli_main(["plan", str(config), "--model.type", "deepseek_v2", "--num-gpus", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)  # at least one layout ranked

# --- layouts: one launch of two 2-rank runs, each against one process ----------------------------------------

LAYOUTS = {
    "ep2-dp2": {"parallel.ep": "2", "batch.micro_batch_size": "2"},
    "tp2-sp": {"parallel.tp": "2", "parallel.tp_sequence_parallel": "true"},
}
"""ep2 over DDP dp2 (the load-balancing counts summed over dp) and tp2 with sequence parallelism (MLA's heads split,
the shared experts split, each MoE layer gathering the whole sequence), from V2's shape (group-limited routing); the
global batch is the reference's and the load-balancing weight 1 (:data:`test_moe.BALANCED`)."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from layout_worker import launch_layouts, reference_run
    from test_hf import model_overrides
    from test_moe import BALANCED

    root = tmp_path_factory.mktemp("deepseek_v2_layouts")
    base = {**model_overrides(saved(root / "hf", **CASES["v2-groups"])), **BALANCED}
    one = {name: reference_run(root / f"one-{name}", base, config=FINETUNE) for name in LAYOUTS}
    (root / "w2").mkdir()
    return launch_layouts(2, root / "w2", {n: {**base, **o} for n, o in LAYOUTS.items()}, config=FINETUNE), one


@pytest.mark.slow  # one 2-rank launch and two references (~1 min on 2 cores)
@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_train_as_one_process(trained, name):
    """Every step's loss and the step-1 gradients equal one process's within the contract's tolerance
    (:func:`conftest.assert_close_losses`, :func:`conftest.assert_close_grads`)."""
    from conftest import assert_close_grads, assert_close_losses

    results, one = trained
    assert_close_losses(results[name][0], one[name][0])
    assert_close_grads(results[name][1], one[name][1])
