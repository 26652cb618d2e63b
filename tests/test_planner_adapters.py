"""The planner with LoRA and QLoRA (``[adapter]``): frozen parameters hold weights only (no gradients, no optimizer
states, no gradient traffic), adapters are counted as the trainer builds them, an NF4 base at 0.516 bytes a weight,
and the QLoRA paper's headline (Dettmers et al. 2023, abstract and Sec. 1: a 65B model fine-tuned on one 48 GB GPU,
where 16-bit full fine-tuning needs more than 780 GB)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshtrain.config.load import load_config
from meshtrain.planner.hardware import get_hardware
from meshtrain.planner.layout import FRAMEWORKS, Layout
from meshtrain.planner.memory import PRECISIONS, Precision, memory_breakdown
from meshtrain.planner.model_specs import NF4_BYTES, from_config

TINY = {"model.type": "llama", "model.n_layer": "2", "model.n_head": "4", "model.n_kv_head": "2",
        "model.n_embd": "64", "model.ffn_hidden": "128", "model.vocab_size": "128"}
ADAPTERS = {"plain": {}, "lora-qv": {"adapter.lora_rank": "8"},
            "lora-all": {"adapter.lora_rank": "4", "adapter.lora_targets": "all-linear"},
            "qlora-all": {"adapter.lora_rank": "4", "adapter.lora_targets": "all-linear", "adapter.quantize_base": "nf4"},
            "dora-all": {"adapter.lora_rank": "4", "adapter.lora_targets": "all-linear", "adapter.use_dora": "true"},
            "lora-saved": {"adapter.lora_rank": "8", "adapter.modules_to_save": "embed_tokens,lm_head"},
            "lora-saved-tied": {"adapter.lora_rank": "8", "adapter.modules_to_save": "lm_head",
                                "model.tie_embeddings": "true"}}


@pytest.mark.parametrize("case", ADAPTERS)
def test_the_planner_counts_the_parameters_the_trainer_trains_and_quantizes(case):
    """ModelSpec's adapter (DoRA's magnitudes included), ``modules_to_save`` and NF4 counts against the built model:
    its parameters with ``requires_grad`` (a tied pair once) and the weights it stores as NF4 (two 4-bit values a byte
    of ``nf4_data``)."""
    if "qlora" in case:
        pytest.importorskip("bitsandbytes")
    from meshtrain.adapters.apply import adapt
    from meshtrain.models.build import build_model

    cfg = load_config(None, {**TINY, **ADAPTERS[case]})
    spec = from_config(cfg)
    model = build_model(cfg.model, 128)
    if cfg.adapter.lora_rank:
        adapt(model, cfg.adapter, cfg.model)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # parameters() lists a tied one once
    quantized = 2 * sum(p.numel() for n, p in model.named_parameters() if n.endswith("nf4_data"))
    assert spec.adapter_layer_params * spec.layers + spec.saved_params == (trained if cfg.adapter.lora_rank else 0)
    assert spec.saved_params == (128 * 64 * (1 if "tied" in case else 2) if "saved" in case else 0)
    assert spec.nf4_layer_params * spec.layers == quantized


def _states(spec, layout, precision="fp32"):
    return memory_breakdown(spec, layout, get_hardware("A100-80GB"), PRECISIONS[precision], FRAMEWORKS["meshtrain"])


@pytest.mark.parametrize("layout", [Layout(dp=1), Layout(dp=4), Layout(dp=4, zero_stage=1), Layout(dp=4, zero_stage=3),
                                    Layout(dp=2, pp=2, micro_batch_size=1, gradient_accumulation_steps=4)],
                         ids=["one", "ddp4", "zero1", "fsdp4", "pp2-dp2"])
def test_only_adapters_hold_gradients_and_optimizer_states(layout):
    """With LoRA, gradients and optimizer states are the adapters' bytes (their share on this rank), whatever the layout;
    the weights are the base's plus the adapters'."""
    cfg = load_config(None, {**TINY, **ADAPTERS["lora-all"]})
    full, lora = from_config(load_config(None, TINY)), from_config(cfg)
    f, a = _states(full, layout), _states(lora, layout)
    shard = layout.dp * layout.sp
    adapters = lora.adapter_layer_params * -(-lora.layers // layout.pp)  # the busiest stage's
    assert a.gradients == pytest.approx(adapters * 4 / (shard if layout.zero_stage >= 2 else 1))
    assert a.optimizer == pytest.approx(adapters * 8 / (shard if layout.zero_stage >= 1 else 1))
    assert a.weights == pytest.approx(f.weights + adapters * 4 / (shard if layout.zero_stage >= 3 else 1))
    assert a.total < f.total


@pytest.mark.parametrize("layout", [Layout(dp=1), Layout(dp=4, zero_stage=3), Layout(dp=2, tp=2)],
                         ids=["one", "fsdp4", "tp2"])
def test_modules_to_save_hold_gradients_and_optimizer_states_but_no_second_weight(layout):
    """The embedding and head of ``modules_to_save`` (V x C each, split over tp) add their fp32 gradients (4 bytes)
    and AdamW's two states (8) to the adapters', on this rank's ZeRO shard; their weights are the base's, counted once."""
    lora = from_config(load_config(None, {**TINY, "adapter.lora_rank": "8"}))
    saved = from_config(load_config(None, {**TINY, **ADAPTERS["lora-saved"]}))
    a, b = _states(lora, layout), _states(saved, layout)
    shard, per_rank = layout.dp * layout.sp, saved.saved_params / layout.tp
    assert b.gradients - a.gradients == pytest.approx(per_rank * 4 / (shard if layout.zero_stage >= 2 else 1))
    assert b.optimizer - a.optimizer == pytest.approx(per_rank * 8 / (shard if layout.zero_stage >= 1 else 1))
    assert b.weights == pytest.approx(a.weights)


def test_an_nf4_base_weighs_half_a_byte_a_weight_and_tp_is_never_ranked():
    from meshtrain.planner.estimate import Job
    from meshtrain.planner.search import search

    cfg = load_config(None, {**TINY, **ADAPTERS["qlora-all"]})
    lora, qlora = from_config(load_config(None, {**TINY, **ADAPTERS["lora-all"]})), from_config(cfg)
    saved = _states(lora, Layout(dp=1)).weights - _states(qlora, Layout(dp=1)).weights
    assert saved == pytest.approx(qlora.nf4_layer_params * qlora.layers * (4 - NF4_BYTES))
    ranked = search(qlora, get_hardware("A100-80GB"), PRECISIONS["fp32"], FRAMEWORKS["meshtrain"], Job(8, 64), top=50)
    assert ranked and all(plan.layout.tp == 1 for plan in ranked)
    full = search(from_config(load_config(None, TINY)), get_hardware("A100-80GB"), PRECISIONS["fp32"],
                  FRAMEWORKS["meshtrain"], Job(8, 64), top=50)
    assert any(plan.layout.tp > 1 for plan in full)  # the same job without NF4 does rank tp


LLAMA_65B = dict(type="llama", n_layer=80, n_head=64, n_kv_head=64, n_embd=8192, ffn_hidden=22016, vocab_size=32000,
                 block_size=512, tie_embeddings=False)
"""LLaMA-65B (Touvron et al. 2023, Table 2: 80 layers, width 8192, 64 heads; SwiGLU 22016), at Guanaco's 512 tokens."""
QLORA_PAPER = Precision("qlora-paper", 2, 2, 8, 2, "bfloat16")
"""QLoRA's own training state (Sec. 3 and 4): bf16 adapters and gradients, 32-bit AdamW states (m and v, no fp32
master copy), bf16 activations."""


def test_the_qlora_papers_65b_fits_48_gb_where_full_finetuning_needs_780():
    """Rank-64 adapters on every linear map (Sec. 4: "LoRA r = 64 ... on all layers"), micro-batch 1 with gradient
    checkpointing (Sec. 4), the device's fixed runtime overhead left out: QLoRA's precision under 48 GB (on one GPU of
    48 GB, the abstract's claim), 16-bit full fine-tuning (weights, gradients and AdamW) over 780 GB (Sec. 1)."""
    overrides = {f"model.{k}": str(v) for k, v in LLAMA_65B.items()}
    qlora = from_config(load_config(None, {**overrides, "adapter.lora_rank": "64", "adapter.lora_alpha": "16",
                                           "adapter.lora_targets": "all-linear", "adapter.quantize_base": "nf4"}))
    full = from_config(load_config(None, overrides))
    layout = Layout(dp=1, micro_batch_size=1, recompute="full")
    q = memory_breakdown(qlora, layout, get_hardware("A100-80GB"), QLORA_PAPER, FRAMEWORKS["meshtrain"])
    f = memory_breakdown(full, layout, get_hardware("A100-80GB"), PRECISIONS["fp16"], FRAMEWORKS["meshtrain"])
    assert 30e9 < q.total - q.overhead < 48e9, q  # above the NF4 weights alone (65B x 0.516 B = 33.7 GB)
    assert f.weights + f.gradients + f.optimizer > 780e9, f
    assert replace(q, overhead=0).total < replace(f, overhead=0).total / 16
