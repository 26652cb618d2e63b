"""Prepared conversations as samples (meshtrain.data.conversations) and the loss over the global batch's supervised
tokens (meshtrain.parallel.reduce.loss_scale), on one process: properties over generated conversations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.data.conversations import IGNORE_INDEX, Conversations, pack_windows
from meshtrain.data.sampler import ShardedSampler, eval_batches

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, length=st.integers(2, 33), packing=st.sampled_from(["document", "pad"]))
def test_windows_hold_every_conversation_once_whole_and_in_order(lengths, length, packing):
    windows = pack_windows(np.array(lengths), length, packing)
    assert windows[0, 0] == 0 and windows[-1, 1] == len(lengths)
    assert (windows[1:, 0] == windows[:-1, 1]).all()  # consecutive, none skipped, none twice
    for first, end in windows:
        used = sum(lengths[first:end])
        assert end > first
        assert used <= length or end - first == 1  # fits, or a long one alone (cut at its tail)
        if packing == "pad":
            assert end - first == 1
    if packing == "document":  # greedy: the next window's first conversation did not fit in this one
        for (first, end), (nxt, _) in zip(windows[:-1], windows[1:]):
            assert sum(lengths[first:end]) + lengths[nxt] > length


def _split(lengths, seed=0):
    """A token stream of conversations of ``lengths`` with random ids 1..50 and a random loss mask."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    tokens = torch.randint(1, 50, (n,), generator=gen)
    masks = (torch.rand(n, generator=gen) < 0.5).to(torch.uint8)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return tokens, masks, starts


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, block_size=st.integers(1, 32), packing=st.sampled_from(["document", "pad"]))
def test_targets_are_the_next_supervised_token_of_the_same_conversation(lengths, block_size, packing):
    tokens, masks, starts = _split(lengths)
    data = Conversations(tokens, masks, starts, block_size, packing, pad_id=0)
    x, y, doc = data.samples(torch.arange(len(data)))  # (W, T) each
    bounds = np.append(starts, len(tokens))
    for k, (first, end) in enumerate(data.windows):
        lo = int(bounds[first])
        hi = min(int(bounds[end]), lo + block_size + 1)
        span = hi - lo
        assert torch.equal(x[k, :min(span, block_size)], tokens[lo:lo + min(span, block_size)])
        for t in range(block_size):
            i, j = lo + t, lo + t + 1  # the input token and its target in the stream
            inside = t + 1 < span and np.searchsorted(bounds, i, "right") == np.searchsorted(bounds, j, "right")
            want = int(tokens[j]) if inside and masks[j] else IGNORE_INDEX
            assert int(y[k, t]) == want
        assert (doc[k, span:] == doc[k, :span].max() + 1).all() if span < block_size else True  # padding apart
        assert (doc[k, 1:] >= doc[k, :-1]).all()
    assert data.truncated == sum(n > block_size + 1 for n in lengths)


def test_sampler_takes_conversation_windows_in_any_layout():
    """The same global batch of windows whatever (dp, micro_batch_size, GA), each window exactly once an epoch."""
    tokens, masks, starts = _split([7, 3, 12, 5, 9, 2, 8, 11, 4, 6, 3, 10] * 3)
    data = Conversations(tokens, masks, starts, 16, "document")
    one = ShardedSampler(data, 16, 4, 2, 1, 0, seed=3)
    batches = one.next_step()
    assert len(batches) == 2 and all(len(mb) == 3 for mb in batches)  # (x, y, doc_ids): packed
    whole = torch.cat([mb[1] for mb in batches])
    split = [ShardedSampler(data, 16, 2, 1, 4, r, seed=3).next_step() for r in range(4)]
    assert torch.equal(whole, torch.cat([mb[1] for rank in split for mb in rank]))
    epoch = ShardedSampler(data, 16, 1, 1, 1, 0, seed=3)
    seen = torch.cat([epoch.next_step()[0][0] for _ in range(len(data))])  # (W, T): one epoch
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, data.samples(torch.arange(len(data)))[0].tolist()))
    pad = Conversations(tokens, masks, starts, 16, "pad")
    assert all(len(mb) == 2 for mb in ShardedSampler(pad, 16, 2, 1, 1, 0, seed=3).next_step())  # no document ids
    assert len(eval_batches(pad, 16, 2, 3, 1, 0, seed=3)) == 3


def test_bad_packing_and_starts_are_refused():
    tokens, masks, starts = _split([4, 4])
    with pytest.raises(ValueError, match="packing"):
        Conversations(tokens, masks, starts, 8, "concat")
    with pytest.raises(ValueError, match="starts"):
        Conversations(tokens, masks, np.array([1, 5]), 8, "pad")
