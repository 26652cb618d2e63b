"""Training on a folder ``meshtrain prepare`` wrote (``data.path = DATA_DIR``): the sampler reads windows from the
memory-mapped shards -- the same samples as from the tokens in memory, never the whole corpus -- a run resumes at
another layout on it exactly, and a resume on data prepared with another tokenizer is refused in one line.

The tokenizer is a small byte-level BPE trained here (``meshtrain tokenizer train``); nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, TINY, assert_resumed_losses, launch_here, losses, read_records, train_here
from meshtrain.cli.main import main as cli_main

TEXT = ROOT / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
LLAMA = ROOT / "configs" / "llama_tiny.toml"


def prepare(tmp, name: str, vocab: int, shard_tokens: int = 20_000):
    """(tokenizer.json, DATA_DIR): a BPE of ``vocab`` ids on the first 120 KB of Tiny Shakespeare, and that text
    prepared with it, one document per blank-line-separated block, in shards of ``shard_tokens`` tokens."""
    text = tmp / f"{name}.txt"
    text.write_text(TEXT.read_text()[:120_000])
    tok, data = tmp / f"{name}.json", tmp / f"{name}-data"
    assert cli_main(["tokenizer", "train", "--input", str(text), "--vocab-size", str(vocab), "--out", str(tok)]) == 0
    assert cli_main(["prepare", "--tokenizer", str(tok), "--input", str(text), "--out", str(data),
                     "--doc-split", "blank-line", "--val-fraction", "0.1", "--workers", "1",
                     "--shard-tokens", str(shard_tokens)]) == 0
    return tok, data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("prepared"), "bpe", 300)


class CountingSource:
    """A :class:`meshtrain.data.sampler.TokenSource` over a prepared split that counts the tokens it hands out
    and refuses any other access (indexing, conversion to an array): what a sampler that read the whole corpus
    would need."""

    def __init__(self, inner) -> None:
        self.inner, self.read = inner, 0

    def __len__(self) -> int:
        return len(self.inner)

    def gather(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        self.read += len(starts) * length
        return self.inner.gather(starts, length)

    def __getitem__(self, item):
        raise AssertionError("the sampler indexed the whole split")

    def __array__(self, *args, **kwargs):
        raise AssertionError("the sampler converted the whole split to an array")


def test_sampler_reads_windows_not_the_corpus(prepared):
    """Over the memory-mapped split, a step's batches are the split's tokens at the sampler's window starts (the
    dp ranks' windows disjoint), and the sampler reads exactly G * (T + 1) tokens per step and the eval set
    once, whatever the split's size."""
    from meshtrain.data.corpus import load_corpus
    from meshtrain.data.sampler import ShardedSampler, eval_batches

    _, data = prepared
    corpus = load_corpus(data, 0.1, 32)
    train = CountingSource(corpus.train)
    in_memory = corpus.train.gather(torch.zeros(1, dtype=torch.long), len(corpus.train))[0]  # (N,) the whole split
    assert len(corpus.train.view.counts) > 1  # windows cross shard boundaries
    seen = []
    for dp_rank in range(2):
        sampler = ShardedSampler(train, 32, 4, 2, 2, dp_rank, seed=7)
        for step in range(3):
            begin = step * 16 + dp_rank * 8
            starts = sampler.stream_starts(begin, begin + 8)  # (mbs * GA,)
            seen += starts.tolist()
            x = torch.cat([x for x, _ in sampler.next_step()])  # (8, T)
            assert torch.equal(x, in_memory[starts[:, None] + torch.arange(32)])
    assert len(set(seen)) == len(seen)  # one epoch: every window once
    assert train.read == 2 * 3 * (4 * 2) * 33  # 2 ranks x 3 steps x mbs * GA windows x (T + 1) tokens
    val = CountingSource(corpus.val)
    batches = eval_batches(val, 32, 4, 5, 2, 0, seed=7)
    assert len(batches) == 5 and val.read == 5 * 4 * 33


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), key=st.integers(0, 2**62))
def test_feistel_permutation_is_a_permutation(n, key):
    """The order a sampler draws on-disk windows in is a bijection of ``[0, n)``, and a function of the key alone."""
    from meshtrain.data.sampler import feistel_permutation

    out = feistel_permutation(torch.arange(n), n, key)
    assert torch.equal(out.sort().values, torch.arange(n))
    assert torch.equal(feistel_permutation(torch.arange(n - 1, -1, -1), n, key), out.flip(0))


def test_prepared_run_resumes_at_another_layout(prepared, tmp_path):
    """A tiny Llama on the prepared data: one process to step 4 (checkpoint at 2), then the step-2 checkpoint
    resumed on 2 ranks (dp = 2): steps 3 and 4 as the uninterrupted run (conftest's resumed-loss contract)."""
    _, data = prepared
    common = {**TINY, "model.type": "llama", "model.n_head": "4", "model.n_kv_head": "2", "model.multiple_of": "16",
              "data.path": str(data), "train.steps": "4", "checkpoint.interval": "2", "checkpoint.keep": "2",
              "batch.micro_batch_size": "4"}
    whole = losses(train_here(tmp_path / "whole", **common))
    from meshtrain.checkpoint import store as ckpt

    step2 = ckpt.step_dir(tmp_path / "whole", 2)
    args = [tok for k, v in {**common, "batch.micro_batch_size": "2", "train.out_dir": str(tmp_path / "resumed"),
                             "checkpoint.resume": str(step2)}.items() for tok in (f"--{k}", v)]
    assert launch_here("train", str(ROOT / "configs" / "shakespeare_char.toml"), "--nproc", "2", *args) == 0
    got = losses(read_records(tmp_path / "resumed"))
    assert_resumed_losses(got, {s: whole[s] for s in (3, 4)})


def test_resume_on_data_prepared_with_another_tokenizer_is_refused(prepared, tmp_path, capsys):
    _, data = prepared
    _, other = prepare(tmp_path, "other", 280)
    run = tmp_path / "run"
    base = ["train", str(LLAMA), "--nproc", "1", "--steps", "2", "--train.dtype", "float32",
            "--batch.micro_batch_size", "2", "--model.block_size", "32"]
    assert cli_main([*base, "--data.path", str(data), "--out", str(run)]) == 0
    capsys.readouterr()
    code = cli_main([*base, "--data.path", str(other), "--out", str(run), "--resume", "--steps", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "tokenizer" in err, err


def break_folder(kind: str, data, tmp):
    """A copy of the prepared folder ``data`` damaged as ``kind``; returns (path, extra args)."""
    import json
    import shutil

    copy = tmp / "data"
    shutil.copytree(data, copy)
    if kind == "half-written":
        (copy / "meta.json").unlink()
    elif kind == "other-version":
        meta = json.loads((copy / "meta.json").read_text())
        (copy / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    elif kind == "short-shard":
        shard = copy / "train_00000.bin"
        shard.write_bytes(shard.read_bytes()[:-2])
    elif kind == "empty":
        shutil.rmtree(copy)
        copy.mkdir()
    return copy, (["--model.vocab_size", "100"] if kind == "vocab-too-small" else [])


@pytest.mark.parametrize("kind, expected", [
    ("half-written", "not a complete prepared dataset"), ("other-version", "format version 99"),
    ("short-shard", "meta.json says"), ("empty", "not a complete prepared dataset"),
    ("vocab-too-small", "model.vocab_size = 100 is smaller than the vocabulary"),
])
def test_bad_prepared_folder_is_one_line_before_launch(prepared, tmp_path, capsys, kind, expected):
    """Each damage: one line, exit code 2, before any rank starts, no output folder."""
    _, data = prepared
    folder, extra = break_folder(kind, data, tmp_path)
    capsys.readouterr()
    code = cli_main(["train", str(LLAMA), "--nproc", "1", "--data.path", str(folder), "--out", str(tmp_path / "run"),
                     *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err and expected in err, err
    assert not (tmp_path / "run").exists()
