"""GPT: shapes, causality, weight tying, parameter count, deterministic (meta-device) init, generation."""

from __future__ import annotations

import pytest
import torch

from meshtrain.models.registry import ModelConfig
from meshtrain.models.gpt.model import GPT

V = 11
CFG = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=0.0)


def build(seed: int = 0, cfg: ModelConfig = CFG) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg, V)


def test_forward_shape():
    model = build()
    idx = torch.randint(V, (3, 5))
    assert model(idx).shape == (3, 5, V)


def test_causality():
    model = build().eval()
    idx = torch.randint(V, (2, CFG.block_size))
    base = model(idx)
    t = 5
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    out = model(changed)
    torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=0)
    assert not torch.allclose(out[:, t], base[:, t])


def test_tied_weights_share_storage():
    model = build()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


@pytest.mark.parametrize("cfg", [CFG, ModelConfig(n_layer=3, n_head=4, n_embd=32, block_size=12),
                                 ModelConfig(n_layer=3, n_head=4, n_embd=32, block_size=12, bias=True)])
def test_num_params_formula(cfg):
    """The module docstring's N, b = 1 with ``bias``: 9C Linear biases and 2C LayerNorm shifts per block, C final."""
    model = build(cfg=cfg)
    C, T, L, b = cfg.n_embd, cfg.block_size, cfg.n_layer, int(cfg.bias)
    expected = V * C + T * C + L * (12 * C**2 + 2 * C + b * 11 * C) + C + b * C
    assert model.num_params() == expected
    assert model.num_params(exclude_embeddings=True) == expected - V * C - T * C


def test_init_is_deterministic_and_scaled():
    a, b = build(seed=3), build(seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, build(seed=4).tok_emb.weight)
    assert torch.all(a.blocks["0"].ln_1.weight == 1)
    # residual projections use std 0.02 / sqrt(2 * n_layer); compare against the unscaled q
    big = build(cfg=ModelConfig(n_layer=2, n_head=2, n_embd=128, block_size=8))
    ratio = big.blocks["0"].mlp.proj.weight.std() / big.blocks["0"].attn.q.weight.std()
    assert ratio.item() == pytest.approx(1 / 2, rel=0.05)


def test_meta_build_then_init_matches_normal_build():
    normal = build(seed=7)
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = GPT(CFG, V)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert meta.lm_head.weight is meta.tok_emb.weight
    for (name, want), got in zip(normal.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(got, want), name
    # init_weights is idempotent: calling it again restores the same weights
    with torch.no_grad():
        normal.tok_emb.weight.zero_()
    normal.init_weights()
    assert torch.equal(normal.tok_emb.weight, meta.tok_emb.weight)


GPT2_CFG = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=True, activation="gelu_tanh")
"""GPT-2's options (``GPT2LMHeadModel``): biases in every Linear but the head and in every LayerNorm, gelu_new."""


def test_bias_model_has_zero_biases_and_the_same_weights():
    """GPT-2's init: every bias 0 (also after a meta build, whose ``to_empty`` leaves garbage); biases draw
    nothing from the init generator, so every weight equals the bias-free model's of the same seed."""
    with_bias, without = build(seed=5, cfg=GPT2_CFG), build(seed=5)
    biases = {n: p for n, p in with_bias.named_parameters() if n.endswith(".bias")}
    per_block = {"ln_1", "ln_2", "attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"}
    assert set(biases) == {f"blocks.{i}.{m}.bias" for i in range(2) for m in per_block} | {"norm.bias"}
    assert all(torch.equal(p, torch.zeros_like(p)) for p in biases.values())
    assert with_bias.lm_head.bias is None and not any(n.endswith(".bias") for n, _ in without.named_parameters())
    for name, want in without.state_dict().items():
        assert torch.equal(with_bias.state_dict()[name], want), name
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = GPT(GPT2_CFG, V)
    meta.to_empty(device="cpu")
    meta.init_weights()
    for (name, want), got in zip(with_bias.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(got, want), name


def test_gelu_tanh_is_gpt2s_gelu_new():
    """``activation = "gelu_tanh"``: ``0.5 h (1 + tanh(sqrt(2/pi) (h + 0.044715 h**3)))`` (Hendrycks & Gimpel 2016)
    on the MLP's hidden activation h, and the MLP's output is ``proj`` of it; the exact GELU fails the bound."""
    from meshtrain.models.gpt.model import GELU_APPROXIMATIONS
    from meshtrain.models.gpt.spec import ACTIVATIONS

    assert tuple(GELU_APPROXIMATIONS) == ACTIVATIONS  # every valid model.activation builds
    eps = torch.finfo(torch.float32).eps
    mlp = build(cfg=GPT2_CFG).blocks["0"].mlp
    x = 25 * torch.randn(4, 8, GPT2_CFG.n_embd, generator=torch.Generator().manual_seed(0))  # h ~ N(0, 2^2)
    with torch.no_grad():
        h = mlp.fc(x)  # (B, T, 4C)
        hand = 0.5 * h * (1 + torch.tanh(((2 / torch.pi) ** 0.5) * (h + 0.044715 * h**3)))
        # Elementwise bound: the inner term z has ~4 roundings (relative 4 eps), tanh turns that into at most
        # sech(z)^2 * 4 eps |z| <= 1.8 eps (sech^2(z)|z| <= 0.45) plus its own ~1 ulp; 1 + tanh and the products add
        # ~3 eps more, all times 0.5|h|: |act - hand| <= 3 eps |h|, kept at 8 eps |h| for kernels' polynomial tanh.
        bound = 8 * eps * h.abs()
        assert ((mlp.act(h) - hand).abs() <= bound).all()
        assert ((torch.nn.functional.gelu(h) - hand).abs() > bound).any()  # the bound tells exact GELU apart
        # MLP output: the activations differ by <= 8 eps |h_j|, and each of the two 4C-term matmuls rounds by at most
        # 4C eps sum_j |W_ij| |h_j| (|a_j| <= |h_j|): |mlp(x) - proj(hand)| <= (8 + 8C) eps (|W| @ |h|), elementwise.
        want = mlp.proj(hand)  # (B, T, C); the biases are 0 after init
        out_bound = (8 + 8 * GPT2_CFG.n_embd) * eps * (h.abs() @ mlp.proj.weight.abs().T)
        assert ((mlp(x) - want).abs() <= out_bound).all()
        assert ((mlp.proj(torch.nn.functional.gelu(h)) - want).abs() > out_bound).any()


def test_generate_length_and_determinism():
    model = build().eval()
    idx = torch.randint(V, (2, 3))
    n = 2 * CFG.block_size  # longer than the context: exercises cropping
    out1 = model.generate(idx, n, temperature=0.8, top_k=4, generator=torch.Generator().manual_seed(1))
    out2 = model.generate(idx, n, temperature=0.8, top_k=4, generator=torch.Generator().manual_seed(1))
    assert out1.shape == (2, 3 + n)
    assert torch.equal(out1[:, :3], idx)
    assert torch.equal(out1, out2)
    assert int(out1.max()) < V and int(out1.min()) >= 0


def test_sequence_longer_than_block_size_raises():
    with pytest.raises(ValueError, match="block_size"):
        build()(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))
