"""LoRA combinations ``tests/test_lora.py`` leaves out: a tied embedding trained in full (``adapter.modules_to_save``)
under a pipeline and under tensor parallelism, each equal to one process; DoRA compiled (``train.compile``) equal to
DoRA eager; and the merged LoRA path (:class:`meshtrain.adapters.lora._MergedLoRA`) equal to the unmerged one.

The layouts train ``tests/test_lora.py``'s 4-layer Llama (rank 4, alpha 8) for 3 steps and are held to the
correctness contract by ``conftest.check_layout`` (every step's loss, the step-1 gradients, every parameter at the
end), whose tolerances are derived there.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TINY, check_layout
from layout_worker import layout_launcher, reference_run

MODEL = {**TINY, "model.type": "llama", "model.n_layer": "4", "model.n_head": "4", "model.n_kv_head": "2",
         "model.multiple_of": "16", "train.steps": "3", "batch.micro_batch_size": "8",
         "adapter.lora_rank": "4", "adapter.lora_alpha": "8", "adapter.lora_targets": "all-linear"}
TIED = {"model.tie_embeddings": "true", "adapter.modules_to_save": "embed_tokens",
        "adapter.lora_targets": "q_proj,v_proj"}
"""A tied head (one matrix: the embedding's) trained in full beside q and v adapters (peft's ``modules_to_save`` with
``ensure_weight_tying``)."""
PIPE = {"parallel.pp": "2", "batch.micro_batch_size": "2", "batch.gradient_accumulation_steps": "4"}
LAYOUTS = {
    "pp2-1f1b-tied-saved": (2, {**TIED, **PIPE}),
    "tp2-seqpar-tied-saved": (2, {**TIED, "parallel.tp": "2", "parallel.tp_sequence_parallel": "true"}),
}
DORA = {"adapter.use_dora": "true"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return layout_launcher(tmp_path_factory, MODEL, LAYOUTS, "lora-more")


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    return reference_run(tmp_path_factory.mktemp("lora-more-ref") / "tied", {**MODEL, **TIED})


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_tied_embedding_trained_in_full_matches_one_process(tied_reference, launched, name):
    """The tied embedding gets gradients (its step-1 gradient compared: the embedding's and the head's uses summed)
    and, with the adapters, is the only thing that trains; then the contract against one process."""
    world, overrides = LAYOUTS[name]
    got = launched(world)[name]
    assert {n for n in got[1] if ".lora_" not in n} == {"tok_emb.weight"}, sorted(got[1])[:4]
    assert "lm_head.weight" not in got[2] or torch.equal(got[2]["lm_head.weight"], got[2]["tok_emb.weight"])
    check_layout(got, tied_reference, {**MODEL, **overrides})


@pytest.mark.slow
def test_dora_compiled_matches_eager(tmp_path):
    """``train.compile = on`` with DoRA (its weight norm, detached, inside the compiled blocks) against eager DoRA,
    one process each: the contract's tolerances (compile reorders fp32 sums as a layout does)."""
    eager = reference_run(tmp_path / "eager", {**MODEL, **DORA})
    compiled = reference_run(tmp_path / "compiled", {**MODEL, **DORA, "train.compile": "on"})
    assert any(n.endswith("lora_magnitude_vector") for n in compiled[1])
    check_layout(compiled, eager, {**MODEL, **DORA})


def test_merged_path_equals_the_unmerged_one():
    """One LoRA layer, fp32: :class:`_MergedLoRA`'s output and the gradients of ``x``, ``A`` and ``B`` against the
    unmerged ``W x + b + s B (A x)`` (``MERGED_FORWARD = False``), with A and B both nonzero and a bias.

    Tolerance: each output sums ``in`` products of values of size ~1 (unit normal ``x``, ``W`` and ``A``, ``B`` at
    0.1); the two orders differ by at most ``in * eps`` relative to the sum of magnitudes, ``in * eps * sqrt(in)`` for
    normal data, ~1e-4 at in = 64; the gradients sum N = 24 or ``out`` products the same way."""
    import meshtrain.adapters.lora as lora

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    lora.add_lora(layer, rank=4, scaling=2.0, dropout=0.0, seed=1)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.1)
    x = torch.randn(2, 12, 64, generator=generator)
    g = torch.randn(2, 12, 48, generator=generator)
    results = []
    for merged in (True, False):
        lora.MERGED_FORWARD = merged
        try:
            xi = x.clone().requires_grad_(True)
            assert layer._mergeable(xi) is merged
            y = layer(xi)
            (y * g).sum().backward()
            results.append((y.detach(), xi.grad, layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()))
            layer.lora_A.weight.grad = layer.lora_B.weight.grad = None
        finally:
            lora.MERGED_FORWARD = True
    eps = torch.finfo(torch.float32).eps
    for got, want, n in zip(results[0], results[1], (64, 48, 24, 24)):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=4 * n * eps * n ** 0.5 * max(scale, 1.0))
    assert layer.weight.grad is None and layer.bias.grad is None  # the base stays frozen


def test_merged_path_is_not_taken_where_it_cannot_be():
    """Dropout on the adapter's input while training, a trainable base, bf16 (autocast or bf16 weights) and DoRA keep
    their own forward (the merged weight would drop the mask, the base's gradient, the update's low bits or DoRA's
    norm); so does an NF4 base, another class."""
    import meshtrain.adapters.lora as lora
    from meshtrain.adapters.dora import add_dora

    x = torch.randn(3, 16)
    dropped = lora.add_lora(torch.nn.Linear(16, 8), rank=2, scaling=1.0, dropout=0.1, seed=0).requires_grad_(False)
    assert not dropped.train()._mergeable(x) and dropped.eval()._mergeable(x)
    trainable = lora.add_lora(torch.nn.Linear(16, 8), rank=2, scaling=1.0, dropout=0.0, seed=0)
    assert not trainable._mergeable(x)  # the base's weight requires grad: the unmerged path computes its gradient
    frozen = lora.add_lora(torch.nn.Linear(16, 8).requires_grad_(False), rank=2, scaling=1.0, dropout=0.0, seed=0)
    assert frozen._mergeable(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 products: W + s B A would round the update away
        assert not frozen._mergeable(x)
    assert not frozen.to(torch.bfloat16)._mergeable(x.bfloat16())
    assert not add_dora(frozen.float())._mergeable(x)


@pytest.mark.slow
def test_merged_path_compiles_to_the_eager_numbers():
    """``torch.compile`` of a frozen layer with a LoRA adapter (the merged path, a custom autograd function that
    dynamo traces) gives eager's output and adapter gradients: the same operations, so to the rounding of inductor's
    reordered sums (the bound of :func:`test_merged_path_equals_the_unmerged_one`)."""
    import meshtrain.adapters.lora as lora

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=False).requires_grad_(False)
    lora.add_lora(layer, rank=4, scaling=2.0, dropout=0.0, seed=1)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.1)
    x = torch.randn(2, 12, 64, generator=generator)
    g = torch.randn(2, 12, 48, generator=generator)
    results = []
    for fn in (layer, torch.compile(layer)):
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        (y * g).sum().backward()
        results.append((y.detach(), xi.grad, layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()))
        layer.lora_A.weight.grad = layer.lora_B.weight.grad = None
    eps = torch.finfo(torch.float32).eps
    for got, want, n in zip(results[1], results[0], (64, 48, 24, 24)):
        torch.testing.assert_close(got, want, rtol=0, atol=4 * n * eps * n ** 0.5 * max(float(want.abs().max()), 1.0))
