"""LoRA combinations ``tests/test_lora.py`` leaves out: a tied embedding trained in full (``adapter.modules_to_save``)
under a pipeline and under tensor parallelism, each equal to one process; DoRA compiled (``train.compile``) equal to
DoRA eager; the merged LoRA path (fp32, :class:`meshtrain.adapters.lora._MergedLoRA`) and the fused one (bf16,
:class:`meshtrain.adapters.lora._FusedLoRA`) equal to the plain one, and each taken exactly where it may be.

The layouts train ``tests/test_lora.py``'s 4-layer Llama (rank 4, alpha 8) for 3 steps and are held to the
correctness contract by ``conftest.check_layout`` (every step's loss, the step-1 gradients, every parameter at the
end), whose tolerances are derived there.
"""

from __future__ import annotations

import contextlib
import copy

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


def _adapted_layer(bias: bool = True, b_scale: float = 0.1):
    """A frozen ``nn.Linear(64, 48)`` with a rank-4 adapter (scaling 2) whose ``B`` is nonzero (unit normal times
    ``b_scale``) and a unit normal bias (as large as the output, so that a lost bias shows), an input ``x`` (2, 12, 64)
    and an output gradient ``g`` (2, 12, 48), unit normal, seeded."""
    import meshtrain.adapters.lora as lora

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=bias).requires_grad_(False)
    lora.add_lora(layer, rank=4, scaling=2.0, dropout=0.0, seed=1)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * b_scale)
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator))
    return layer, torch.randn(2, 12, 64, generator=generator), torch.randn(2, 12, 48, generator=generator)


def _forward_backward(layer, x, g, context=None):
    """``layer(x)`` (in ``context``, e.g. autocast) and its backward from ``g`` (cast to the output's dtype): the
    output, the gradients of ``x``, ``A`` and ``B``, and the output's autograd node; the adapter's gradients reset."""
    xi = x.clone().requires_grad_(True)
    with context or contextlib.nullcontext():
        y = layer(xi)
    y.backward(g.to(y.dtype))
    got = (y.detach(), xi.grad, layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone())
    layer.lora_A.weight.grad = layer.lora_B.weight.grad = None
    return got, type(y.grad_fn).__name__


def _magnitudes(layer, x, g):
    """The output and the gradients of ``x``, ``A`` and ``B`` that ``layer`` (fp32, before any cast) computes from
    ``|x|``, ``|g|`` and the absolute values of its parameters, in fp64: each element's sum of magnitudes, the scale
    of its rounding errors."""
    magnitude = copy.deepcopy(layer).double()
    for param in magnitude.parameters():
        param.data.abs_()
    return _forward_backward(magnitude, x.double().abs(), g.double().abs())[0]


def _assert_within(got, want, factor, bounds) -> None:
    """Each of ``got`` (output, gradients) has ``want``'s dtype and is within ``factor`` times the matching tensor of
    ``bounds`` of it, element by element."""
    for a, b, bound in zip(got, want, bounds, strict=True):
        assert a.dtype == b.dtype
        excess = (a.double() - b.double()).abs() - factor * bound
        assert float(excess.max()) <= 0, float(excess.max())


def test_merged_path_equals_the_unmerged_one():
    """One LoRA layer, fp32: :class:`_MergedLoRA`'s output and the gradients of ``x``, ``A`` and ``B`` against the
    unmerged ``W x + b + s B (A x)`` (``MERGED_FORWARD = False``), with A and B both nonzero and a bias.

    Tolerance: each output sums ``in`` products of values of size ~1 (unit normal ``x``, ``W`` and ``A``, ``B`` at
    0.1); the two orders differ by at most ``in * eps`` relative to the sum of magnitudes, ``in * eps * sqrt(in)`` for
    normal data, ~1e-4 at in = 64; the gradients sum N = 24 or ``out`` products the same way."""
    import meshtrain.adapters.lora as lora

    layer, x, g = _adapted_layer()
    results = []
    for merged in (True, False):
        lora.MERGED_FORWARD = merged
        try:
            assert layer._mergeable(x) is merged
            results.append(_forward_backward(layer, x, g)[0])
        finally:
            lora.MERGED_FORWARD = True
    eps = torch.finfo(torch.float32).eps
    for got, want, n in zip(results[0], results[1], (64, 48, 24, 24)):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=4 * n * eps * n ** 0.5 * max(scale, 1.0))
    assert layer.weight.grad is None and layer.bias.grad is None  # the base stays frozen


@pytest.mark.parametrize("scheme", ["autocast", "bf16 weights"])
def test_fused_path_equals_the_plain_one(scheme):
    """One LoRA layer in bf16 compute (``scheme``: bf16 autocast over fp32 weights and an fp32 ``x``, as
    ``train.dtype = "bfloat16"`` runs; or weights, ``x`` and ``g`` all bf16): :class:`_FusedLoRA`'s output and the
    gradients of ``x``, ``A`` and ``B`` against the plain path's (``FUSED_FORWARD = False``), with a bias and an
    adapter term as large as the base's (``B`` at 0.5), so that a lost term, scaling or bias shows.

    Tolerance, elementwise, from bf16's unit roundoff u = 2^-8: both paths multiply the same bf16 inputs with fp32
    accumulation (its error, in * 2^-24, is negligible) and round each result to bf16. Each output element is a sum
    of two products, ``x W^T (+ b)`` and ``h (s B)^T``, or ``g W`` and ``e A`` for ``dL/dx``, whose inner factor
    (``h`` or ``e = g s B``) is itself a rounded product; each path rounds at most three times on the way (that
    factor, a product, the sum), each by at most u times the sum of magnitudes M (the same formulas on absolute
    values, in fp64). So each is within 3u M of the exact value, and the two within 6u M = 3 eps M (eps = 2u)."""
    import meshtrain.adapters.lora as lora

    layer, x, g = _adapted_layer(b_scale=0.5)
    bounds = _magnitudes(layer, x, g)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if scheme == "autocast" else None
    if scheme != "autocast":
        layer, x, g = layer.to(torch.bfloat16), x.bfloat16(), g.bfloat16()
    results = {}
    for fused in (True, False):
        lora.FUSED_FORWARD = fused
        try:
            results[fused], node = _forward_backward(layer, x, g, context)
        finally:
            lora.FUSED_FORWARD = True
        assert ("_FusedLoRA" in node) is fused, node
    _assert_within(results[True], results[False], 3 * torch.finfo(torch.bfloat16).eps, bounds)
    assert layer.weight.grad is None and layer.bias.grad is None  # the base stays frozen


def test_fast_paths_are_taken_exactly_where_they_can_be():
    """fp32 without autocast takes the merged path, bf16 (autocast over fp32 weights, or bf16 weights) the fused one;
    dropout on the adapter's input while training, a trainable base, DoRA (and an NF4 base, another class) take
    neither (the merged weight would drop the mask, and neither computes the base's gradient nor DoRA's norm);
    ``MERGED_FORWARD`` / ``FUSED_FORWARD`` turn each off."""
    import meshtrain.adapters.lora as lora
    from meshtrain.adapters.dora import add_dora

    x = torch.randn(3, 16)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    dropped = lora.add_lora(torch.nn.Linear(16, 8), rank=2, scaling=1.0, dropout=0.1, seed=0).requires_grad_(False)
    assert not dropped.train()._mergeable(x) and dropped.eval()._mergeable(x)
    with bf16:
        assert not dropped.train()._fusable(x) and dropped.eval()._fusable(x)
    trainable = lora.add_lora(torch.nn.Linear(16, 8), rank=2, scaling=1.0, dropout=0.0, seed=0)
    assert not trainable._mergeable(x)  # the base's weight requires grad: the plain path computes its gradient
    with bf16:
        assert not trainable._fusable(x)
    frozen = lora.add_lora(torch.nn.Linear(16, 8).requires_grad_(False), rank=2, scaling=1.0, dropout=0.0, seed=0)
    assert frozen._mergeable(x) and not frozen._fusable(x)
    with bf16:  # bf16 products: W + s B A would round the update away; the fused path keeps s B A x a term
        assert not frozen._mergeable(x) and frozen._fusable(x)
    lora.FUSED_FORWARD = lora.MERGED_FORWARD = False
    try:
        assert not frozen._mergeable(x)
        with bf16:
            assert not frozen._fusable(x)
    finally:
        lora.FUSED_FORWARD = lora.MERGED_FORWARD = True
    frozen.to(torch.bfloat16)
    assert not frozen._mergeable(x.bfloat16()) and frozen._fusable(x.bfloat16())
    assert not frozen._fusable(x)  # fp32 input, bf16 weights, no autocast: F.linear's own dtype error
    dora = add_dora(frozen.float())
    assert not dora._mergeable(x)
    with bf16:
        assert not dora._fusable(x)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp32", "bf16 autocast"])
def test_fast_paths_compile_to_the_eager_numbers(scheme):
    """``torch.compile`` of a frozen layer with a LoRA adapter (the merged path in fp32, the fused one under bf16
    autocast: custom autograd functions that dynamo traces) gives eager's output and gradients: the same operations,
    so to the rounding of inductor's reordered sums, whose bounds are those of
    :func:`test_merged_path_equals_the_unmerged_one` (fp32) and :func:`test_fused_path_equals_the_plain_one`
    (bf16: 3 eps times the sums of magnitudes)."""
    layer, x, g = _adapted_layer(bias=False)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if scheme != "fp32" else contextlib.nullcontext
    eager, node = _forward_backward(layer, x, g, context())
    assert node == ("_MergedLoRABackward" if scheme == "fp32" else "_FusedLoRABackward"), node
    compiled = _forward_backward(torch.compile(layer), x, g, context())[0]
    if scheme != "fp32":
        return _assert_within(compiled, eager, 3 * torch.finfo(torch.bfloat16).eps, _magnitudes(layer, x, g))
    eps = torch.finfo(torch.float32).eps
    for got, want, n in zip(compiled, eager, (64, 48, 24, 24)):
        torch.testing.assert_close(got, want, rtol=0, atol=4 * n * eps * n ** 0.5 * max(float(want.abs().max()), 1.0))
