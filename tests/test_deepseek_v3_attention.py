"""Multi-head latent attention (``MLAttention``) against the DeepSeek-V2 report's equations (arXiv:2405.04434,
Sec. 2.1, Eq. 9-19) computed here in float64 from the layer's own weights.

The layer zero-pads v (dv features) to q's and k's width dn + dr before ``scaled_dot_product_attention`` (so that
torch's CPU flash kernel runs) and slices the output back; the reference attends with the unpadded v and the
softmax scale written out (``1/sqrt(dn+dr)``, times YaRN's ``mscale^2`` as ``transformers``' ``yarn_get_mscale``
computes it), so a padding that leaked into the output, or moved the scale, is O(1) off. Cases: q's low-rank path
on and off, interleaved and half-split RoPE, YaRN's mscale, a document mask, and v wider than q (nothing padded).
"""

from __future__ import annotations

import math

import pytest
import torch

from meshtrain.models.attention import DocumentMask
from meshtrain.models.deepseek_v3.model import MLAttention
from meshtrain.models.registry import ModelConfig

EPS32 = torch.finfo(torch.float32).eps
B, T, C, NH = 2, 16, 32, 4
BASE = dict(type="deepseek_v3", n_layer=2, n_head=NH, n_embd=C, block_size=T, ffn_hidden=16, num_experts=4,
            num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6)
"""dn + dr = 12 for q and k, dv = 6: v is padded with 6 zero features."""
CASES = {
    "q-lora": {},
    "no-q-lora-half-split-rope": dict(q_lora_rank=0, rope_interleave=False),
    "yarn-mscale": dict(yarn_factor=4.0, rope_original_max_positions=8, yarn_mscale=0.707, yarn_mscale_all_dim=1.0),
    "document-mask": {},
    "v-wider-than-q": dict(v_head_dim=16),
}


def rope_tables(dr: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` (T, dr) at theta 10000, each angle twice (Su et al. 2021, Eq. 15): the layout the layer takes."""
    angles = torch.arange(T).double()[:, None] * 10000.0 ** (-torch.arange(0, dr, 2).double() / dr)  # (T, dr/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, dr)
    return angles.cos(), angles.sin()


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of ``x`` (B, h, T, dr): pairs ``(x_2i, x_2i+1)`` (DeepSeek's layout) or halves ``(x_i, x_i+dr/2)``, each
    rotated by its angle (Su et al. 2021, Eq. 34). A permutation of the features common to q and k leaves q.k as is."""
    half = x.shape[-1] // 2
    c, s = cos[:, :half], sin[:, :half]  # (T, dr/2)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def mla_reference(layer: MLAttention, cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  allowed: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(y (B, T, C), the float64 weights by name) of Eq. 9-19 with ``layer``'s weights, in float64; ``allowed``
    (B, 1, T, T) bool: where query i may see key j."""
    w = {name: p.detach().double().requires_grad_() for name, p in layer.named_parameters()}
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # Zhang & Sennrich 2019, Eq. 4
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    if cfg.q_lora_rank:
        q = rms(x @ w["q_a.weight"].T, w["q_norm.weight"]) @ w["q_b.weight"].T  # Eq. 12-13: (B, T, nh*(dn+dr))
    else:
        q = x @ w["q.weight"].T
    q = q.view(B, T, NH, dn + dr).transpose(1, 2)  # (B, nh, T, dn+dr)
    ckv_kr = x @ w["kv_a.weight"].T  # (B, T, rkv+dr): c_KV (Eq. 9) and k_R before RoPE (Eq. 17)
    ckv, kr = ckv_kr[..., :cfg.kv_lora_rank], ckv_kr[..., cfg.kv_lora_rank:]
    kv = (rms(ckv, w["kv_norm.weight"]) @ w["kv_b.weight"].T).view(B, T, NH, dn + dv).transpose(1, 2)  # Eq. 10-11
    k_nope, v = kv[..., :dn], kv[..., dn:]  # (B, nh, T, dn), (B, nh, T, dv): v unpadded
    q = torch.cat([q[..., :dn], rope_reference(q[..., dn:], cos, sin, cfg.rope_interleave)], dim=-1)  # Eq. 16, 18
    kr = rope_reference(kr[:, None], cos, sin, cfg.rope_interleave).expand(-1, NH, -1, -1)  # (B, nh, T, dr), Eq. 17
    k = torch.cat([k_nope, kr], dim=-1)  # Eq. 18
    mscale = (0.1 * cfg.yarn_mscale_all_dim * math.log(cfg.yarn_factor) + 1) if cfg.yarn_factor else 1.0
    scale = mscale**2 / math.sqrt(dn + dr)  # transformers' DeepseekV3Attention.scaling
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))  # (B, nh, T, T)
    o = torch.softmax(scores, dim=-1) @ v  # (B, nh, T, dv), Eq. 19
    return o.transpose(1, 2).reshape(B, T, NH * dv) @ w["proj.weight"].T, w


@pytest.mark.parametrize("case", CASES)
def test_padded_attention_equals_the_equations(case):
    """Output and every gradient (input and weights) of the fp32 layer equal the float64 equations within
    ``2 * 5 * width * eps32 * max|value|``: five sums in series (q_a, q_b, the scores, the softmax-weighted sum of v,
    proj), each at most ``width`` = max(C, ranks, T, nh*dv) products, whose fp32 rounding bounds each by
    ``width * eps`` of its magnitude (Higham 2002, Sec. 4.2), doubled for the backward's own sums; the float64
    reference's rounding is 2^-29 times smaller. A wrong scale or a padded feature reaching the output is O(1) off."""
    cfg = ModelConfig(**{**BASE, **CASES[case]})
    torch.manual_seed(0)
    layer = MLAttention(cfg)
    with torch.no_grad():  # norms away from 1, so a swapped or skipped norm weight shows
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    x64 = torch.randn(B, T, C, dtype=torch.float64)
    g = torch.randn(B, T, C, dtype=torch.float64)  # the output's gradient: loss = sum(y * g)
    cos, sin = rope_tables(cfg.qk_rope_head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    mask, allowed = None, causal
    if case == "document-mask":
        doc = (torch.arange(T) >= 5).long() + (torch.arange(T) >= 11).long()  # three documents: 0-4, 5-10, 11-15
        mask = DocumentMask(doc.expand(B, T))
        allowed = mask.dense
    x = x64.float().requires_grad_()
    y = layer(x, cos.float(), sin.float(), mask=mask)
    (y * g.float()).sum().backward()
    x_ref = x64.clone().requires_grad_()
    y_ref, w = mla_reference(layer, cfg, x_ref, cos, sin, allowed)
    (y_ref * g).sum().backward()
    width = max(C, cfg.q_lora_rank, cfg.kv_lora_rank, T, NH * cfg.v_head_dim)

    def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        tol = 2 * 5 * width * EPS32 * float(want.abs().max())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol, msg=lambda m: f"{what}: {m}")

    close(y, y_ref.detach(), "output")
    close(x.grad, x_ref.grad, "input gradient")
    for name, p in layer.named_parameters():
        close(p.grad, w[name].grad, f"{name} gradient")
