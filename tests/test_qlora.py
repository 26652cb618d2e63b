"""QLoRA (``adapter.quantize_base = "nf4"``): the frozen base stored as bitsandbytes' NF4 with double-quantized scales.

- the weights the model computes with equal bitsandbytes' own ``dequantize_4bit(quantize_4bit(W))`` bit for bit
  (its compiled CPU kernel; meshtrain dequantizes with its portable torch kernels), for generated shapes;
- a QLoRA model computes what a LoRA model computes on those dequantized weights;
- DDP, FSDP2 (the 4-bit data and scales sharded by rows), pp2 and Ulysses sp2 equal one process (the contract);
- a merged export holds the dequantized base plus the adapters; tp and widths NF4's blocks do not divide are refused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY, check_layout
from layout_worker import layout_launcher, reference_run

bnb = pytest.importorskip("bitsandbytes")

MODEL = {**TINY, "model.type": "llama", "model.n_layer": "2", "model.n_head": "4", "model.n_kv_head": "2",
         "model.n_embd": "64", "model.ffn_hidden": "128", "train.steps": "3", "batch.micro_batch_size": "8",
         "adapter.lora_rank": "4", "adapter.lora_alpha": "8", "adapter.lora_targets": "all-linear",
         "adapter.quantize_base": "nf4"}
"""Every linear map's input width a multiple of NF4's 64-weight blocks: 64 (q, k, v, gate, up, o) and 128 (down)."""
LAYOUTS = {
    "ddp-dp2": (2, {"batch.micro_batch_size": "4"}),
    "fsdp2-zero3": (2, {"parallel.zero_stage": "3", "batch.micro_batch_size": "4"}),
    "pp2-1f1b": (2, {"parallel.pp": "2", "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"}),
    "sp2-ulysses": (2, {"parallel.sp": "2"}),
}


def _reference_weight(weight: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' public round trip, its compiled kernels, as QLoRA's code does it (blocks of 64, nested 256)."""
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    return F.dequantize_4bit(packed, state)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 6), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_dequantized_weights_equal_bitsandbytes_bit_for_bit(rows, blocks, scale, seed):
    from meshtrain.adapters.nf4 import dequantized, quantize_linear

    linear = torch.nn.Linear(64 * blocks, rows, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows, 64 * blocks, generator=torch.Generator().manual_seed(seed)) * scale)
    want = _reference_weight(linear.weight.detach().clone())
    quantize_linear(linear)
    assert {n for n, _ in linear.named_parameters()} == {"nf4_data", "nf4_scales"}
    assert linear.nf4_data.dtype == linear.nf4_scales.dtype == torch.uint8
    assert torch.equal(dequantized(linear), want)


def test_a_qlora_model_computes_lora_on_the_dequantized_base():
    from meshtrain.adapters.apply import adapt
    from meshtrain.config.load import load_config
    from meshtrain.config.sections import AdapterConfig
    from meshtrain.models.build import build_model

    cfg = load_config(None, {k: v for k, v in MODEL.items() if k.startswith("model.")}).model
    models = {}
    for kind in ("none", "nf4"):
        torch.manual_seed(0)
        models[kind] = build_model(cfg, 80)
        if kind == "none":  # the base the NF4 model will compute with
            with torch.no_grad():
                for name, p in models[kind].named_parameters():
                    if name.startswith("blocks.") and p.dim() == 2:
                        p.copy_(_reference_weight(p.detach().clone()))
        adapt(models[kind], AdapterConfig(lora_rank=4, lora_targets=["all-linear"], quantize_base=kind), cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        adapters = {n: p for n, p in models["nf4"].named_parameters() if ".lora_" in n}
        for name, p in models["none"].named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
                adapters[name].copy_(p)
    x = torch.randint(0, 80, (2, cfg.block_size), generator=generator)
    import meshtrain.adapters.lora as lora

    lora.MERGED_FORWARD = False  # the plain base unmerged, W x + s B (A x): the NF4 layer's own operations
    try:
        got, want = models["nf4"](x), models["none"](x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same operations on the same numbers
        got.sum().backward()
        want.sum().backward()
    finally:
        lora.MERGED_FORWARD = True
    nf4_grads = {n: p.grad for n, p in models["nf4"].named_parameters() if p.grad is not None}
    assert nf4_grads.keys() == adapters.keys()
    for name, p in models["none"].named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(nf4_grads[name], p.grad, rtol=0, atol=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("qlora-ref"), MODEL)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return layout_launcher(tmp_path_factory, MODEL, LAYOUTS, "qlora")


@pytest.mark.parametrize("name", LAYOUTS)
def test_qlora_layout_matches_one_process(reference, launched, name):
    world, overrides = LAYOUTS[name]
    got = launched(world)[name]
    assert got[1] and all(".lora_" in n for n in got[1])
    check_layout(got, reference, {**MODEL, **overrides})


@pytest.mark.parametrize("overrides, named", [
    ({"parallel.tp": "2"}, "adapter.quantize_base = 'nf4' with parallel.tp = 2"),
    ({"model.ffn_hidden": "96"}, "blocks.*.mlp.down takes 96 inputs"),
    ({"adapter.lora_rank": "0"}, "adapter.lora_rank = 0 trains every parameter"),
    ({"adapter.quantize_base": "int4"}, "adapter.quantize_base = 'int4' is not one of"),
], ids=["tp2", "width-96", "no-adapters", "unknown"])
def test_what_nf4_cannot_do_is_one_line_before_launch(overrides, named, tmp_path):
    from test_lora import assert_refused_before_launch

    assert_refused_before_launch({**MODEL, **overrides}, named, tmp_path)
