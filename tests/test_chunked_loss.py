"""The chunked cross-entropy (:mod:`meshtrain.cross_entropy`, ``train.loss_chunk_mb``) equals ``F.cross_entropy`` and
holds no (tokens x vocabulary) fp32 tensor beyond one chunk's.

Layouts with chunks of two tokens against one process's plain loss: ``tests/test_packing.py`` (ring sp2, pp2); every
other layout test runs the default chunk against one process's default chunk.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.cross_entropy import IGNORE_INDEX, chunk_rows, token_nll
from meshtrain.parallel.reduce import cross_entropy, row_logps

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: the unit roundoff is EPS32 / 2; one ulp at magnitude x is <= EPS32 * |x|
BF16_ULP = 2.0**-7  # bf16's spacing relative to a value: 7 stored mantissa bits


def chunk_mb(rows: int, vocab: int) -> float:
    """The ``chunk_mb`` whose chunks are exactly ``rows`` tokens of ``vocab`` fp32 logits."""
    return rows * 4 * vocab / 2**20


def nll_bound(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """|chunked - plain| per token, derived: both take the same fp32 logits z (N, V). Plain computes
    ``-((z_t - m) - log s)``, chunked ``(m + log s') - z_t``, with m = max z and s, s' = sum exp(z - m) summed in possibly
    different orders: |s - s'| <= 2 (V - 1) u s (two recursive sums, Higham 2002, Eq. 4.4, u = EPS32 / 2), so
    |log s - log s'| <= (V - 1) EPS32 (+ one rounding of each log, EPS32 |log s|); each of the two roundings of the
    adds/subtracts is at most EPS32 times the magnitudes it combines."""
    m = z.amax(dim=-1)
    log_s = torch.log(torch.exp(z - m[:, None]).sum(dim=-1))
    picked = z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    scale = m.abs() + picked.abs() + log_s.abs()
    return (z.size(1) + 1) * EPS32 + 4 * EPS32 * scale


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 96), rows=st.integers(1, 45), spread=st.floats(0.1, 30.0),
       ignored=st.floats(0.0, 1.0), seed=st.integers(0, 2**16), bf16=st.booleans())
def test_chunked_nll_and_gradient_equal_f_cross_entropy(n, vocab, rows, spread, ignored, seed, bf16):
    """Any tokens, vocabulary, chunk (larger than the tokens included), scale of logits, share of ignored targets and
    dtype: the per-token loss within :func:`nll_bound`, the gradient within its consequence (below)."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, vocab, generator=g) * spread).to(torch.bfloat16 if bf16 else torch.float32)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
    weights = torch.randn(n, generator=g)  # an upstream gradient that differs per token
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    plain = F.cross_entropy(a.float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    chunked = token_nll(b, targets, chunk_mb(rows, vocab))
    (plain * weights).sum().backward()
    (chunked * weights).sum().backward()

    bound = nll_bound(z.float(), targets)
    assert chunked.dtype == torch.float32 and b.grad.dtype == z.dtype
    assert torch.all((chunked - plain).abs() <= bound), (chunked - plain).abs().max()
    assert torch.all(chunked[targets == IGNORE_INDEX] == 0)
    # d/dz_v = w (p_v - [v = t]): p_v = exp(z_v - lse) and exp(log-softmax_v) differ in their argument by at most the
    # nll bound delta, so |dp_v| <= p_v (delta + 2 EPS32) (exp's own rounding, Higham Sec. 1.18); subtracting the one-hot
    # adds EPS32; a bf16 gradient is rounded once more from the fp32 values: one bf16 spacing of the value
    p = torch.softmax(z.float(), dim=-1)
    w = torch.where(targets != IGNORE_INDEX, weights, 0.0)[:, None].abs()
    grad_bound = w * (p * (bound[:, None] + 2 * EPS32) + EPS32)
    if bf16:
        grad_bound = grad_bound + BF16_ULP * a.grad.float().abs()
    assert torch.all((b.grad.float() - a.grad.float()).abs() <= grad_bound)


def test_cross_entropy_sum_mean_and_rows_equal_the_plain_loss():
    """:func:`meshtrain.parallel.reduce.cross_entropy` and :func:`row_logps` with chunks (of 3 tokens) against
    ``chunk_mb = 0`` (``F.cross_entropy`` at once): sums of N per-token values each within :func:`nll_bound`, summed in
    another order (N EPS32 times the sum of magnitudes, Higham Eq. 4.4)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 10, 33, generator=g) * 4  # (B, T, V)
    y = torch.randint(0, 33, (4, 10), generator=g)
    y[1, :4] = IGNORE_INDEX
    y[2] = IGNORE_INDEX  # a row with nothing supervised
    per_token = F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none")
    bound = nll_bound(z.flatten(0, 1), y.flatten()).sum() + y.numel() * EPS32 * per_token.abs().sum()
    mb = chunk_mb(3, 33)
    for reduction, divide in (("sum", 1), ("mean", int((y != IGNORE_INDEX).sum()))):
        got, want = cross_entropy(z, y, reduction=reduction, chunk_mb=mb), cross_entropy(z, y, reduction=reduction, chunk_mb=0)
        assert abs(float(got - want)) <= float(bound) / divide
    rows, want_rows = row_logps(z, y, chunk_mb=mb), row_logps(z, y, chunk_mb=0)
    assert rows[2] == 0 and want_rows[2] == 0
    assert torch.all((rows - want_rows).abs() <= bound)
    nothing = torch.full_like(y, IGNORE_INDEX)  # no supervised token: sum 0, mean NaN, as F.cross_entropy
    assert float(cross_entropy(z, nothing, reduction="sum", chunk_mb=mb)) == 0.0
    assert math.isnan(float(cross_entropy(z, nothing, chunk_mb=mb)))
    assert math.isnan(float(cross_entropy(z, nothing, chunk_mb=0)))


def test_chunk_rows():
    """64 MiB of fp32 logits: 2^24 values, so 2^24 / V tokens; at least one token; 0 MiB: no chunking."""
    assert chunk_rows(2**14, 64) == 2**10
    assert chunk_rows(151_936, 64) == 2**24 // 151_936
    assert chunk_rows(2**30, 64) == 1
    assert chunk_rows(65, 0) == 0


@pytest.mark.parametrize("dtype, element", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_loss_holds_no_full_fp32_logits(dtype, element):
    """Peak bytes of a head GEMM + loss + backward, tracked tensor by tensor (torch's ``MemTracker``): the chunked loss
    holds the logits and their gradient (2 x N V x element bytes) and one chunk's fp32 temporaries (at most 4 x rows x V
    x 4: the upcast, the shifted softmax, the gather/scatter's and logsumexp's), beside the GEMM's inputs; the plain
    loss holds more (its fp32 log-softmax and two fp32 gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    n, vocab, width, rows = 1024, 2048, 16, 64
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, width, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, width, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)

    def peak(chunk: float) -> float:
        tracker = MemTracker()
        tracker.track_external(h, w)
        with tracker:
            loss = cross_entropy((h @ w.t()).unsqueeze(0), y.unsqueeze(0), reduction="sum", chunk_mb=chunk)
            loss.backward()
        h.grad = w.grad = None
        return sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())

    inputs = 2 * (h.numel() + w.numel()) * element  # h, w and their gradients
    logits = n * vocab * element
    chunked, plain = peak(chunk_mb(rows, vocab)), peak(0)
    assert chunked <= inputs + 2 * logits + 4 * rows * vocab * 4 + 64 * n  # + per-token (N,) vectors: lse, nll, grad
    assert chunked < plain
