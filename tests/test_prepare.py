"""``meshtrain prepare`` and the reader of its output (:mod:`meshtrain.data.preprocess`, :mod:`meshtrain.data.shards`).

The reference for every token is the ``tokenizers`` library's own encoding of each document plus EOS, and the
split rule written out here in plain Python. A tiny byte-level BPE (vocabulary 400, ``<|endoftext|>`` special)
is trained on a few KB of Tiny Shakespeare for the module.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, damaged_json_copy, run_cli
from meshtrain.cli.main import main
from meshtrain.errors import ConfigError
from meshtrain.data import preprocess as prep
from meshtrain.data.shards import PreparedData

SHAKESPEARE = ROOT / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"
VAL = 0.05
"""One document in 20 to val: the 84 documents below give val 4."""


def train_tokenizer(path: Path, special: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SHAKESPEARE.read_text()[:6000]], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", ["<|endoftext|>"])


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """84 documents: the blank-line blocks of the first 12 KB of Tiny Shakespeare, each ending in a newline."""
    blocks = SHAKESPEARE.read_text()[:12000].split("\n\n")[:-1]
    return [b.strip("\n") + "\n" for b in blocks]


def write_inputs(folder: Path, kind: str, docs: list[str]) -> list[str]:
    """``docs`` as inputs of ``kind``; returns the --input arguments (blank-line text, jsonl, parquet, one file
    per document as text files matched by a glob)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        (folder / "corpus.txt").write_text("\n".join(docs))  # a blank line between documents
        return [str(folder / "corpus.txt")]
    if kind == "files":
        for i, d in enumerate(docs):
            (folder / f"doc_{i:04d}.txt").write_text(d)
        return [str(folder / "doc_*.txt")]
    half = len(docs) // 2
    if kind == "jsonl":
        for name, part in (("a.jsonl", docs[:half]), ("b.jsonl", docs[half:])):
            (folder / name).write_text("".join(json.dumps({"id": 1, "text": d}) + "\n" for d in part))
        return [str(folder / "*.jsonl")]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"n": list(range(len(docs))), "text": docs}), folder / "docs.parquet", row_group_size=50)
    return [str(folder / "docs.parquet")]


def expected(tok_path: Path, docs: list[str], f: float) -> dict[str, tuple[list[int], list[int]]]:
    """{split: (tokens, document starts)} by the tokenizers library and the documented split rule."""
    from tokenizers import Tokenizer

    lib = Tokenizer.from_file(str(tok_path))
    eos = lib.token_to_id("<|endoftext|>")
    out = {"train": ([], []), "val": ([], [])}
    for i, d in enumerate(docs):
        tokens, starts = out["val" if math.floor((i + 1) * f) > math.floor(i * f) else "train"]
        starts.append(len(tokens))
        tokens += lib.encode(d, add_special_tokens=False).ids + [eos]
    return out


def run_prepare(tok_path: Path, inputs: list[str], out: Path, **kw) -> prep.Result:
    kw = {"val_fraction": VAL, "doc_split": "blank-line", **kw}
    return prep.prepare(str(tok_path), inputs, out, **kw)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["text", "files", "jsonl", "parquet"])
def test_tokens_are_each_document_encoded_plus_eos(tmp_path, tok_path, docs, kind):
    inputs = write_inputs(tmp_path / "in", kind, docs)
    run_prepare(tok_path, inputs, tmp_path / "out", shard_tokens=997,
                doc_split="file" if kind == "files" else "blank-line")
    data = PreparedData.open(tmp_path / "out")
    for split, (tokens, starts) in expected(tok_path, docs, VAL).items():
        view = data.tokens(split)
        assert data.num_tokens(split) == len(view) == len(tokens)
        assert view.window(0, len(view)).tolist() == tokens
        assert data.documents(split).tolist() == starts
    assert data.meta["splits"]["val"]["documents"] == sum(math.floor((i + 1) * VAL) > math.floor(i * VAL)
                                                          for i in range(len(docs)))
    assert data.meta["dtype"] == "uint16" and data.meta["eos_id"] == 0
    assert [s["sha256"] for s in data.meta["inputs"]]  # inputs are fingerprinted


def test_workers_give_the_same_bytes(tmp_path, tok_path, docs, monkeypatch):
    monkeypatch.setattr(prep, "TASK_CHARS", 1500)  # many tasks, so both workers get some
    inputs = write_inputs(tmp_path / "in", "jsonl", docs)
    run_prepare(tok_path, inputs, tmp_path / "w1", workers=1, shard_tokens=1000)
    run_prepare(tok_path, inputs, tmp_path / "w2", workers=2, shard_tokens=1000)
    one, two = folder_bytes(tmp_path / "w1"), folder_bytes(tmp_path / "w2")
    assert len(one) > 6 and one == two


def test_an_error_midway_leaves_nothing(tmp_path, tok_path, docs, monkeypatch):
    monkeypatch.setattr(prep, "TASK_CHARS", 1500)
    calls = []
    write = prep.ShardWriter.write

    def failing(self, ids, lengths):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        write(self, ids, lengths)

    monkeypatch.setattr(prep.ShardWriter, "write", failing)
    with pytest.raises(RuntimeError):
        run_prepare(tok_path, write_inputs(tmp_path / "in", "text", docs), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


KILL_MIDWAY = """
import os, signal, sys
from meshtrain.data import preprocess as prep
prep.TASK_CHARS = 1500
write, calls = prep.ShardWriter.write, []
def killing(self, ids, lengths):
    write(self, ids, lengths)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
prep.ShardWriter.write = killing
prep.prepare(sys.argv[1], [sys.argv[2]], sys.argv[3], val_fraction=0.05, doc_split="blank-line", shard_tokens=500)
"""


def test_a_killed_prepare_is_never_read_as_complete_and_a_rerun_redoes_it(tmp_path, tok_path, docs):
    inputs = write_inputs(tmp_path / "in", "text", docs)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILL_MIDWAY, str(tok_path), inputs[0], str(out)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    tmp = tmp_path / "out.tmp"
    assert not out.exists() and any(tmp.glob("train_*.bin")) and not (tmp / "meta.json").exists()
    with pytest.raises(ConfigError, match="not a complete prepared dataset"):
        PreparedData.open(tmp)
    result = run_prepare(tok_path, inputs, out, shard_tokens=500)
    assert result.removed_leftover and not tmp.exists()
    run_prepare(tok_path, inputs, tmp_path / "clean", shard_tokens=500)
    assert folder_bytes(out) == folder_bytes(tmp_path / "clean")


def test_a_running_prepare_or_a_foreign_tmp_folder_is_left_alone(tmp_path, tok_path, docs):
    inputs = write_inputs(tmp_path / "in", "text", docs)
    tmp = tmp_path / "out.tmp"
    tmp.mkdir()
    (tmp / "mine.txt").write_text("user data")
    with pytest.raises(ConfigError, match="was not made by meshtrain prepare"):
        run_prepare(tok_path, inputs, tmp_path / "out")
    (tmp / prep.LOCK_FILE).touch()
    with open(tmp / prep.LOCK_FILE) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="another meshtrain prepare is writing"):
            run_prepare(tok_path, inputs, tmp_path / "out")
    assert (tmp / "mine.txt").exists() and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tok_path, docs) -> PreparedData:
    folder = tmp_path_factory.mktemp("sharded")
    run_prepare(tok_path, write_inputs(folder / "in", "text", docs), folder / "out", shard_tokens=97)
    return PreparedData.open(folder / "out")


def test_windows_across_shard_boundaries_equal_the_concatenation(sharded):
    view = sharded.tokens("train")
    assert len(view.paths) > 20
    whole = np.concatenate([np.fromfile(p, dtype="<u2") for p in view.paths]).astype(np.int64)
    assert len(whole) == len(view)
    rng = np.random.default_rng(0)
    starts = list(rng.integers(0, len(view) - 300, 50)) + [0, 96, 97, 193, len(view) - 300]
    for s in starts:
        for length in (1, 97, 98, 300):
            np.testing.assert_array_equal(view.window(s, length), whole[s:s + length])
    batch = view.windows(starts, 65)  # (B, block_size + 1)
    assert batch.shape == (len(starts), 65) and batch.dtype == np.int64
    np.testing.assert_array_equal(batch[3], whole[starts[3]:starts[3] + 65])
    for bad in ((-1, 5), (len(view) - 4, 5)):
        with pytest.raises(IndexError):
            view.window(*bad)


def test_a_window_reads_o_window_not_o_corpus(tmp_path, tok_path, docs):
    run_prepare(tok_path, write_inputs(tmp_path / "in", "text", docs * 20), tmp_path / "out")  # one big shard
    corpus_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("train_*.bin"))
    assert corpus_bytes > 200_000
    tracemalloc.start()
    data = PreparedData.open(tmp_path / "out")
    view = data.tokens("train")
    w = view.window(len(view) // 2, 64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert isinstance(view.shard(0), np.memmap)
    assert len(w) == 64 and peak < 32_000, f"a 64-token window allocated {peak} bytes of a {corpus_bytes}-byte corpus"


def damage_meta(folder: Path, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    for key, value in changes.items():
        target = meta
        *path, last = key.split(".")
        for part in path:
            target = target[part]
        target[last] = value
    (folder / "meta.json").write_text(json.dumps(meta))


READER_DAMAGE = {
    "no-meta": (lambda d: (d / "meta.json").unlink(), "is not a complete prepared dataset (no meta.json): run "
                                                      "meshtrain prepare again"),
    "other-version": (lambda d: damage_meta(d, format_version=99), "has format version 99; this meshtrain reads "
                                                                    "version 1"),
    "empty-val": (lambda d: damage_meta(d, **{"splits.val.documents": 0, "splits.val.tokens": 0}),
                  "has an empty val split"),
    "short-shard": (lambda d: os.truncate(d / "train_00001.bin", 10), "shard train_00001.bin has 10 bytes, meta.json "
                                                                       "says 194 (97 tokens)"),
    "missing-shard": (lambda d: (d / "train_00002.bin").unlink(), "shard train_00002.bin is missing"),
}


@pytest.mark.parametrize("damage", READER_DAMAGE)
def test_the_reader_refuses_damaged_folders_in_one_line(tmp_path, sharded, damage):
    folder = tmp_path / "copy"
    shutil.copytree(sharded.folder, folder)
    hurt, fragment = READER_DAMAGE[damage]
    hurt(folder)
    with pytest.raises(ConfigError) as e:
        PreparedData.open(folder)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_an_existing_out_is_reused_only_when_it_is_this_very_dataset(tmp_path, tok_path, docs, capsys):
    inputs = write_inputs(tmp_path / "in", "jsonl", docs)
    args = ["prepare", "--tokenizer", str(tok_path), "--input", *inputs, "--out", str(tmp_path / "out"),
            "--val-fraction", str(VAL), "--workers", "1"]
    assert main(args) == 0
    before = folder_bytes(tmp_path / "out")
    assert main(args) == 0
    assert "already holds these inputs" in capsys.readouterr().out
    assert main([*args, "--shard-tokens", "1000"]) == 2
    assert "holds a dataset prepared with other options" in capsys.readouterr().err
    (tmp_path / "in" / "b.jsonl").write_text(json.dumps({"text": "changed"}) + "\n")
    assert main(args) == 2
    assert "holds a dataset prepared with other inputs" in capsys.readouterr().err
    assert folder_bytes(tmp_path / "out") == before


def _text(folder: Path, data: bytes) -> Path:
    (folder / "in.txt").write_bytes(data)
    return folder / "in.txt"


def _jsonl(folder: Path, *lines: bytes) -> Path:
    (folder / "in.jsonl").write_bytes(b'{"text": "fine"}\n' + b"\n".join(lines) + b"\n")
    return folder / "in.jsonl"


def _empty(path: Path) -> Path:
    """An empty file; for parquet, a file of no rows with a string ``text`` column."""
    if path.suffix != ".parquet":
        path.touch()
        return path
    import pyarrow as pa

    return _parquet(path.parent, text=pa.array([], pa.string()))


def _parquet(folder: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), folder / "in.parquet")
    return folder / "in.parquet"


# Damage by input kind: {kind: {damage: (write the input, fragment of the one-line error)}}; each writer returns
# the --input argument. "missing" and "empty" apply to every kind.
DAMAGES = {
    "text": {"not-utf8": (lambda d: _text(d, b"fine\n\nbad \xff byte\n"), "is not UTF-8 text at byte 10")},
    "jsonl": {
        "not-json": (lambda d: _jsonl(d, b"not json"), "in.jsonl' line 2 is not JSON"),
        "no-text-field": (lambda d: _jsonl(d, b"", b'{"body": "x"}'), "in.jsonl' line 3 has no 'text' field (its "
                                                                         "fields: body)"),
        "text-not-string": (lambda d: _jsonl(d, b'{"text": 5}'), "line 2: 'text' is 5, not a string"),
        "text-null": (lambda d: _jsonl(d, b'{"text": null}'), "line 2: 'text' is null, not a string"),
        "not-object": (lambda d: _jsonl(d, b'["text"]'), "line 2 is a JSON list, not an object"),
        "not-utf8": (lambda d: _jsonl(d, b'{"text": "\xff"}'), "line 2 is not UTF-8"),
    },
    "parquet": {
        "no-text-column": (lambda d: _parquet(d, body=["a"]), "has no column 'text' (its columns: body)"),
        "text-not-string": (lambda d: _parquet(d, text=[1, 2]), "column 'text' holds int64, not strings"),
        "null-row": (lambda d: _parquet(d, text=["a", None]), "in.parquet' row 1 has no text ('text' is null)"),
        "not-parquet": (lambda d: (d / "in.parquet").write_bytes(b"PAR1 garbage") and d / "in.parquet",
                        "is not a readable parquet file"),
    },
}
SUFFIX = {"text": "txt", "jsonl": "jsonl", "parquet": "parquet"}
for _kind, _suffix in SUFFIX.items():
    DAMAGES[_kind]["missing"] = (lambda d, s=_suffix: d / f"nope.{s}", "does not exist")
    DAMAGES[_kind]["glob-matches-nothing"] = (lambda d, s=_suffix: f"{d}/*.{s}", "matches no file")
    DAMAGES[_kind]["empty"] = (lambda d, s=_suffix: _empty(d / f"in.{s}"), "no document (empty")
    DAMAGES[_kind]["fifo"] = (lambda d, s=_suffix: (os.mkfifo(d / f"in.{s}"), d / f"in.{s}")[1], "is a FIFO, not a file")
    DAMAGES[_kind]["dangling-link"] = (lambda d, s=_suffix: ((d / f"in.{s}").symlink_to(d / "gone"), d / f"in.{s}")[1],
                                       "is a symbolic link to")


@pytest.mark.parametrize("kind,damage", [(k, d) for k in DAMAGES for d in DAMAGES[k]])
def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, tok_path, capsys, kind, damage):
    make, fragment = DAMAGES[kind][damage]
    folder = tmp_path / "in"
    folder.mkdir()
    arg = make(folder)
    rc = main(["prepare", "--tokenizer", str(tok_path), "--input", str(arg), "--out", str(tmp_path / "out"),
               "--workers", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("meshtrain prepare: error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.fixture(scope="module")
def no_eos_tok(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("noeos") / "tokenizer.json", [])


OPTION_DAMAGES = {
    "tokenizer-missing": ({"--tokenizer": "{tmp}/nope.json"}, "--tokenizer = '{tmp}/nope.json' does not exist"),
    "tokenizer-char": ({"--tokenizer": "char"}, "cannot prepare shards: train a tokenizer.json with meshtrain "
                                                "tokenizer train"),
    "tokenizer-without-eos": ({"--tokenizer": "{noeos}"}, "has no end-of-text token"),
    "val-fraction-one": ({"--val-fraction": "1"}, "--val-fraction = 1.0 must be in (0, 1)"),
    "val-split-empty": ({"--val-fraction": "0.001"}, "the val split is empty: 60 document(s) at --val-fraction 0.001"),
    "out-exists": ({"--out": "{tmp}/in"}, "exists and is not a complete prepared dataset"),
    "input-folder": ({"--input": "{tmp}/in"}, "is a folder"),
}


@pytest.mark.parametrize("damage", OPTION_DAMAGES)
def test_bad_options_are_one_line_and_write_nothing(tmp_path, tok_path, no_eos_tok, docs, capsys, damage):
    inputs = write_inputs(tmp_path / "in", "jsonl", docs[:60])
    options = {"--tokenizer": str(tok_path), "--input": inputs[0], "--out": f"{tmp_path}/out"}
    changes, fragment = OPTION_DAMAGES[damage]
    options.update({k: v.format(tmp=tmp_path, noeos=no_eos_tok) for k, v in changes.items()})
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["prepare", *[t for kv in options.items() for t in kv], "--doc-split", "blank-line"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment.format(tmp=tmp_path) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_command_line_gives_exit_2_and_no_traceback(tmp_path, tok_path):
    bad = _jsonl(tmp_path, b"{oops")
    proc = run_cli("prepare", "--tokenizer", str(tok_path), "--input", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"'{bad}' line 2 is not JSON" in proc.stderr and not (tmp_path / "out").exists()


class BigVocab:
    """A tokenizer of 70,000 ids (past uint16) that maps each character to an id above 65,535."""

    kind, vocab_size, bos_id, eos_id = "hf", 70_000, None, 69_999

    def encode(self, text: str) -> list[int]:
        return [65_536 + ord(ch) % 1000 for ch in text]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": "unused", "sha256": "0" * 64, "vocab_size": self.vocab_size}


def test_a_vocabulary_past_uint16_gives_uint32_shards(tmp_path, docs, monkeypatch):
    monkeypatch.setattr(prep, "_load_tokenizer", lambda spec: BigVocab())
    run_prepare(Path("unused"), write_inputs(tmp_path / "in", "text", docs), tmp_path / "out", shard_tokens=1000)
    data = PreparedData.open(tmp_path / "out")
    assert data.meta["dtype"] == "uint32" and (tmp_path / "out" / "train_00000.bin").stat().st_size == 4000
    train = [d for i, d in enumerate(docs) if not math.floor((i + 1) * VAL) > math.floor(i * VAL)]
    want = [t for d in train for t in BigVocab().encode(d) + [BigVocab.eos_id]]
    assert data.tokens("train").window(0, data.num_tokens("train")).tolist() == want


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_in_any_field_of_a_prepared_meta_is_one_config_error(sharded, tmp_path, data):
    """Opening a prepared folder whose meta.json has any JSON value at any key path (or the key removed) raises
    ConfigError or opens a valid folder: never another exception."""
    folder = damaged_json_copy(data, sharded.folder, "meta.json", tmp_path)
    try:
        PreparedData.open(folder)
    except ConfigError as e:
        assert "\n" not in str(e)
