"""Corpus, tokenizer, the sharded resumable sampler and the validation set."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.data.corpus import CharTokenizer, load_corpus
from meshtrain.data.sampler import ShardedSampler, eval_batches

BS = 8
DATA = torch.arange(403)  # token i is i, so a window is identified by its first token


def rows(batches):
    """Samples of a list of (x, y) micro-batches, as (x, y) tuples of ints, in order."""
    out = []
    for x, y in batches:
        assert torch.equal(x[:, 1:], y[:, :-1])
        out += [(tuple(a.tolist()), tuple(b.tolist())) for a, b in zip(x, y)]
    return out


def global_step(dp, mbs, ga, state=None, seed=0):
    """One step over all dp ranks (samplers built from the same state): the samples, in rank order."""
    samples = []
    for r in range(dp):
        s = ShardedSampler(DATA, BS, mbs, ga, dp, r, seed)
        if state is not None:
            s.load_state_dict(state)
        batches = s.next_step()
        assert len(batches) == ga and all(x.shape == (mbs, BS) for x, _ in batches)
        samples += rows(batches)
    return samples, s.state_dict()


def test_tokenizer_round_trip_and_json():
    tok = CharTokenizer.from_text("hello, world\n")
    assert tok.vocab_size == len(set("hello, world\n"))
    assert tok.decode(tok.encode("low, hell")) == "low, hell"
    again = CharTokenizer.from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.encode("world") == tok.encode("world")


def test_tokenizer_unknown_character():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")


def test_load_corpus_split(tmp_path):
    path = tmp_path / "t.txt"
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    path.write_text(text, encoding="utf-8")
    c = load_corpus(path, 0.1, 16)
    assert (len(c.train), len(c.val)) == (900, 100)
    assert c.train.dtype == torch.long and c.tokenizer.vocab_size == 26
    assert c.tokenizer.decode(c.train.tolist() + c.val.tolist()) == text


@pytest.mark.parametrize("content", [b"", b"\xff\xfe bad", b"ab" * 10])
def test_load_corpus_errors(tmp_path, content):
    path = tmp_path / "t.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="data.path"):
        load_corpus(path, 0.1, 16)


@pytest.mark.parametrize("ga", [1, 2])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_union_over_ranks_equals_one_process(dp, ga):
    ref, _ = global_step(1, 8, ga)  # one process with the same global batch 8 * ga
    got, _ = global_step(dp, 8 // dp, ga)
    assert Counter(got) == Counter(ref)
    assert got == ref  # the stream order is the rank-major layout of the contract


def test_each_window_once_per_epoch_across_three_epochs():
    s = ShardedSampler(DATA, BS, 3, 2, 1, 0, seed=5)  # G = 6 does not divide num_samples: steps straddle epochs
    n = s.num_samples
    assert n == (len(DATA) - BS) // BS
    seen = []
    while len(seen) < 3 * n:
        seen += [x[0] for x, _ in rows(s.next_step())]
    for e in range(3):
        epoch = seen[e * n:(e + 1) * n]
        assert len(set(epoch)) == n  # no window repeated within an epoch
        assert len({first % BS for first in epoch}) == 1  # one offset per epoch
        assert all(first + BS < len(DATA) for first in epoch)
    assert s.epoch == pytest.approx(len(seen) / n)


@pytest.mark.parametrize("layout", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (8, 1, 1)])
def test_resume_continues_the_stream(layout):
    k, more = 7, 5
    ref = ShardedSampler(DATA, BS, 4, 2, 1, 0, seed=9)  # dp=1, mbs 4, GA 2: G = 8
    for _ in range(k):
        ref.next_step()
    state = json.loads(json.dumps(ref.state_dict()))
    want = [rows(ref.next_step()) for _ in range(more)]
    dp, mbs, ga = layout
    got = []
    for _ in range(more):
        samples, state = global_step(dp, mbs, ga, state, seed=9)
        got.append(samples)
    assert got == want


def test_resume_rejects_other_seed():
    state = ShardedSampler(DATA, BS, 2, 1, 1, 0, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ShardedSampler(DATA, BS, 2, 1, 1, 0, seed=2).load_state_dict(state)


def test_seed_changes_order():
    a = rows(ShardedSampler(DATA, BS, 8, 1, 1, 0, seed=1).next_step())
    b = rows(ShardedSampler(DATA, BS, 8, 1, 1, 0, seed=2).next_step())
    assert a != b


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_batches_union_independent_of_dp(dp):
    def union(dp, mbs):
        out = []
        for r in range(dp):
            batches = eval_batches(DATA, BS, mbs, 3, dp, r, seed=4)
            assert len(batches) == 3 and all(x.shape == (mbs, BS) for x, _ in batches)
            out += rows(batches)
        return out

    assert Counter(union(dp, 8 // dp)) == Counter(union(1, 8))


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="dp_rank"):
        ShardedSampler(DATA, BS, 2, 1, 2, 2, seed=0)
    with pytest.raises(ValueError, match="block_size"):
        ShardedSampler(DATA[:BS], BS, 2, 1, 1, 0, seed=0)
