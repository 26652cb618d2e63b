"""Property tests over the readers of binary files users bring and pass on (issue 37, Sec. 2): an export's
safetensors file, a Hugging Face folder's weights and tokenizer.json, a prepared folder's shards and a tokenizer
file, each damaged by hypothesis (cut short at any byte, any bytes written at any offset, any bytes appended, or
all of it garbage of the same length), read by what the subcommands read before a rank starts. Each gives one
ConfigError line or accepts the file (data-only damage: a weight's bytes are any float, a shard's any token id
that the rank then checks); never another exception.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import JSON_VALUES, json_paths
from meshtrain.errors import ConfigError

DAMAGES = st.one_of(
    st.tuples(st.just("cut"), st.floats(0, 1)),
    st.tuples(st.just("write"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("garbage"), st.integers(0, 2**32 - 1)),
)
"""How a file is damaged: cut at a fraction of its length, bytes written at a fraction of it, bytes appended, or
replaced by random bytes of the same length (the seed)."""
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def damage(path: Path, how: tuple) -> None:
    """Apply one of :data:`DAMAGES` to the file at ``path`` in place."""
    import random

    data = path.read_bytes()
    kind = how[0]
    if kind == "cut":
        data = data[: int(how[1] * len(data))]
    elif kind == "write":
        at = int(how[1] * len(data))
        data = data[:at] + how[2] + data[at + len(how[2]):]
    elif kind == "append":
        data += how[1]
    else:
        data = random.Random(how[1]).randbytes(len(data))
    path.write_bytes(data)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """Where the damaged copies go: one folder for the module (hypothesis draws many examples per test function, so
    the per-function tmp_path cannot hold them apart); pytest removes it with its other old temporary folders."""
    return tmp_path_factory.mktemp("damaged")


def damaged_copy(scratch: Path, source: Path, relative: str, how: tuple) -> Path:
    """A fresh copy under ``scratch`` of the folder (or file) ``source`` with its file ``relative`` damaged; returns
    the copy."""
    copy = Path(tempfile.mkdtemp(prefix="damaged_", dir=scratch)) / source.name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, copy)
    damage(copy / relative if relative else copy, how)
    return copy


def one_line_or_accepted(read) -> None:
    try:
        read()
    except ConfigError as e:
        assert "\n" not in str(e).strip(), str(e)


@SETTINGS
@given(how=DAMAGES)
@example(how=("write", 0.005015196448476812, b"!"))  # the header's JSON broken: json.loads' traceback before
@example(how=("write", 0.005859375, b" "))  # a model key renamed: ModelConfig's TypeError before
def test_a_damaged_export_is_one_line_for_generate(scratch, artefacts, how):
    """``meshtrain generate --checkpoint model.safetensors``'s reader (the header's config, then the weights). The two
    examples are what hypothesis found in CI: the header entry is checked as a checkpoint's meta.json is."""
    from meshtrain.cli.generate import _load

    copy = damaged_copy(scratch, artefacts / "export" / "model.safetensors", "", how)
    one_line_or_accepted(lambda: _load(copy))


def _hf_files(artefacts: Path) -> list[str]:
    return sorted(p.name for p in (artefacts / "hf").iterdir() if p.suffix in (".safetensors", ".json"))


@SETTINGS
@given(data=st.data(), how=DAMAGES)
def test_a_damaged_hugging_face_folder_is_one_line_for_generate_and_train(scratch, artefacts, data, how):
    """Any file of a Hugging Face folder (a weights shard, the index, config.json, tokenizer.json): what ``generate``
    loads, and what ``train`` with ``model.init_from`` checks before launch (headers only)."""
    from meshtrain.cli.generate import _load
    from meshtrain.config.load import load_config
    from meshtrain.preflight import check_init_from

    name = data.draw(st.sampled_from(_hf_files(artefacts)))
    copy = damaged_copy(scratch, artefacts / "hf", name, how)
    one_line_or_accepted(lambda: _load(copy))

    def check() -> None:
        cfg = load_config(None, {"model.init_from": str(copy)})
        check_init_from(cfg, 65)

    one_line_or_accepted(check)


def rewrite_header(path: Path, edit) -> None:
    """Rewrite the JSON header of the safetensors file at ``path`` as ``edit(header)`` returns it, its length
    field updated and the tensor bytes kept: a well-formed file whose header says something else."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])


@SETTINGS
@given(data=st.data())
def test_an_edited_safetensors_header_is_refused_before_launch_or_loads(scratch, artefacts, data):
    """A Hugging Face shard whose header is valid JSON but lies: one tensor's ``dtype``, ``shape`` or
    ``data_offsets`` (or its whole entry) set to any JSON value, or the tensors' byte ranges dealt out again among
    them (the file's total size right). The check ``train`` runs before launch (headers only) refuses it in one line,
    or it is a file ``generate`` then loads whole: no header damage is left for a rank to find."""
    from meshtrain.cli.generate import _load
    from meshtrain.config.load import load_config
    from meshtrain.preflight import check_init_from

    shard = data.draw(st.sampled_from([n for n in _hf_files(artefacts) if n.endswith(".safetensors")]))
    copy = damaged_copy(scratch, artefacts / "hf", shard, ("append", b""))
    if data.draw(st.booleans(), label="deal the byte ranges out again"):
        def edit(header):
            names = sorted(k for k in header if k != "__metadata__")
            ranges = [header[k]["data_offsets"] for k in names]
            for name, offsets in zip(names, data.draw(st.permutations(ranges), label="ranges")):
                header[name]["data_offsets"] = offsets
            return header
    else:
        def edit(header):
            name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")), label="tensor")
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]), label="field")
            value = data.draw(JSON_VALUES, label="value")
            if key is None:
                header[name] = value
            else:
                header[name][key] = value
            return header
    rewrite_header(copy / shard, edit)
    cfg = load_config(None, {"model.init_from": str(copy)})
    try:
        check_init_from(cfg, 65)
    except ConfigError as e:
        assert "\n" not in str(e).strip(), str(e)
        return
    _load(copy)  # passed the check before launch: it must load


@SETTINGS
@given(data=st.data())
def test_any_value_in_any_field_of_an_exports_header_entry_is_one_line_for_generate(scratch, artefacts, data):
    """An export's ``meshtrain`` header entry (its model config, vocabulary, tokenizer, step) with any JSON value at
    any key path, or that key removed: ``generate`` loads it or refuses it in one line (:func:`read_export`)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from meshtrain.cli.export import METADATA_KEY
    from meshtrain.cli.generate import _load

    source = artefacts / "export" / "model.safetensors"
    with safe_open(str(source), "pt") as f:
        metadata = f.metadata()
    entry = json.loads(metadata[METADATA_KEY])
    path = data.draw(st.sampled_from(json_paths(entry)), label="key path")
    target = entry
    for key in path[:-1]:
        target = target[key]
    if isinstance(target, dict) and data.draw(st.booleans(), label="remove it"):
        del target[path[-1]]
    else:
        target[path[-1]] = data.draw(JSON_VALUES, label="value")
    copy = Path(tempfile.mkdtemp(prefix="header_", dir=scratch)) / "model.safetensors"
    save_file(load_file(str(source)), str(copy), metadata={**metadata, METADATA_KEY: json.dumps(entry)})
    one_line_or_accepted(lambda: _load(copy))


def test_byte_ranges_swapped_between_tensors_of_two_sizes_are_refused_before_launch(scratch, artefacts):
    """The lie a byte-level check cannot see: two tensors of different sizes trade their byte ranges, each range
    shifted so that the ranges still tile the file (its size is right). Before launch the header check names the
    tensor whose range does not hold its shape."""
    from meshtrain.config.load import load_config
    from meshtrain.preflight import check_init_from

    shard = [n for n in _hf_files(artefacts) if n.endswith(".safetensors")][0]
    copy = damaged_copy(scratch, artefacts / "hf", shard, ("append", b""))

    def edit(header):
        (a, first), (b, second) = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                         key=lambda kv: kv[1]["data_offsets"])[:2]
        size_a = first["data_offsets"][1] - first["data_offsets"][0]
        size_b = second["data_offsets"][1] - second["data_offsets"][0]
        assert size_a != size_b, "the test needs the shard's first two tensors to differ in size"
        start = first["data_offsets"][0]
        first["data_offsets"], second["data_offsets"] = [start, start + size_b], [start + size_b, start + size_a + size_b]
        return header

    rewrite_header(copy / shard, edit)
    cfg = load_config(None, {"model.init_from": str(copy)})
    with pytest.raises(ConfigError, match="its header lies"):
        check_init_from(cfg, 65)


@SETTINGS
@given(how=DAMAGES)
def test_a_damaged_tokenizer_file_is_one_line(scratch, artefacts, how):
    """``data.tokenizer`` / ``prepare --tokenizer`` at a damaged tokenizer.json."""
    from meshtrain.data.tokenizers import load_tokenizer

    copy = damaged_copy(scratch, artefacts / "bpe" / "tokenizer.json", "", how)
    one_line_or_accepted(lambda: load_tokenizer(str(copy)))


@SETTINGS
@given(data=st.data(), how=DAMAGES)
def test_a_damaged_prepared_folder_is_one_line_before_launch_or_from_the_rank(scratch, artefacts, data, how):
    """Any file of a prepared folder (meta.json, a shard, a document index): opening it as the launcher and each
    rank do (``data.path`` at the folder), then the rank's reads of windows covering every token of each split,
    where a shard of garbage bytes of the right size shows (an id outside the vocabulary: a DataError line)."""
    import torch

    from meshtrain.data.corpus import load_prepared

    folder = artefacts / "prepared"
    name = data.draw(st.sampled_from(sorted(p.name for p in folder.iterdir() if p.is_file())))
    copy = damaged_copy(scratch, folder, name, how)

    def read() -> None:
        corpus = load_prepared(copy, 16)
        for split in (corpus.train, corpus.val):
            split.gather(torch.arange(0, len(split) - 16, 16), 17)

    one_line_or_accepted(read)


def test_a_shard_of_garbage_is_named_by_the_rank_that_reads_it(scratch, artefacts):
    """Random bytes of a shard's exact size pass every check before launch (sizes match meta.json); the rank's read
    names the split, the position and the vocabulary (uint16 ids of random bytes: most are >= the 300 of this
    tokenizer)."""
    import torch

    from meshtrain.data.corpus import load_prepared
    from meshtrain.errors import DataError

    folder = artefacts / "prepared"
    shard = sorted(p.name for p in folder.iterdir() if p.name.startswith("train") and p.suffix == ".bin")[0]
    corpus = load_prepared(damaged_copy(scratch, folder, shard, ("garbage", 3)), 16)
    with pytest.raises(DataError, match=r"\(train split\) holds token id \d+ at token \d+, outside its vocabulary"):
        corpus.train.gather(torch.arange(0, len(corpus.train) - 16, 16), 17)


@pytest.mark.parametrize("kind", ["cut", "garbage"])
def test_the_damages_are_drawn(scratch, artefacts, kind):
    """The strategies do damage: a cut file is shorter, a garbage one differs at the same length."""
    source = artefacts / "export" / "model.safetensors"
    copy = damaged_copy(scratch, source, "", ("cut", 0.5) if kind == "cut" else ("garbage", 7))
    if kind == "cut":
        assert copy.stat().st_size == source.stat().st_size // 2
    else:
        assert copy.stat().st_size == source.stat().st_size and copy.read_bytes() != source.read_bytes()


@pytest.mark.slow  # a real launch, ~15 s a rank count
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_on_a_garbage_shard_stops_with_one_line_from_the_rank(scratch, artefacts, tmp_path, nproc):
    """End to end: ``meshtrain train --data.path`` at a folder whose train shard is garbage of the right size starts
    (nothing before launch can see it), and the first read of a rank that meets it stops the run: exit code 2, that
    rank's one line, no traceback (at 2 ranks the other stops with it). The output folder can be re-run as it is:
    with the shards prepared again, the same command passes every check before launch."""
    from artefacts import run_cli_here
    from conftest import run_cli

    folder = artefacts / "prepared"
    shard = sorted(p.name for p in folder.iterdir() if p.name.startswith("train") and p.suffix == ".bin")[0]
    copy = damaged_copy(scratch, folder, shard, ("garbage", 3))
    # every shard garbage, so that the first window drawn shows it wherever it falls
    for other in sorted(copy.glob("*.bin")):
        damage(other, ("garbage", 5))
    argv = ["train", str(artefacts / "config.toml"), "--nproc", str(nproc), "--out", str(tmp_path / "out"),
            "--data.path", str(copy), "--train.steps", "2"]
    proc = run_cli(*argv, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and all(line.startswith("meshtrain train: error: rank ") and "outside its vocabulary" in line
                         for line in lines), proc.stderr[-3000:]
    shutil.rmtree(copy)
    shutil.copytree(folder, copy)  # prepared again
    code, err, _ = run_cli_here(argv)
    assert code == "launched", err[-2000:]
