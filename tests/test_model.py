"""GPT: shapes, causality, weight tying, parameter count, deterministic (meta-device) init, generation."""

from __future__ import annotations

import pytest
import torch

from meshtrain.config import ModelConfig
from meshtrain.models.gpt import GPT

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


@pytest.mark.parametrize("cfg", [CFG, ModelConfig(n_layer=3, n_head=4, n_embd=32, block_size=12)])
def test_num_params_formula(cfg):
    model = build(cfg=cfg)
    C, T, L = cfg.n_embd, cfg.block_size, cfg.n_layer
    expected = V * C + T * C + L * (12 * C**2 + 2 * C) + C
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
