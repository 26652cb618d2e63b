"""Loading a checkpoint never runs code from it (DCP's ``.metadata`` is a pickle).

A planted ``.metadata`` whose unpickling calls ``os.system`` (proved live: plain ``pickle.loads`` of
it creates a marker file) is refused by ``meshtrain generate`` and ``meshtrain train --resume`` with
one line and exit 2, and the marker never appears. A real checkpoint's metadata passes the same
reader (every global it names is on the allow-list), and a truncated one is one line too.

Commands that start no rank run in this process (``conftest.cli_here``: a fresh interpreter costs seconds of imports
a command); the resume that falls back to an older checkpoint is a real launch (from this process: its rank is a
fresh one).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from conftest import CONFIG, TINY, cli_here, launch_here, override_args, train_here


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("safety") / "run"
    train_here(out, **{"train.steps": "2"})
    return out


def _checkpoint(run):
    from meshtrain.checkpoint import store as ckpt

    return ckpt.resolve_checkpoint(run)


def _rerecord(step_folder) -> None:
    """Make meta.json's recorded sizes and digests match the folder's current files."""
    import json

    from meshtrain.checkpoint import store as ckpt

    meta = json.loads((step_folder / "meta.json").read_text())
    meta["files"] = ckpt.file_digests(step_folder)
    (step_folder / "meta.json").write_text(json.dumps(meta))


def test_a_real_checkpoint_names_only_allowed_globals(run):
    from meshtrain.checkpoint import store as ckpt

    metadata = ckpt.read_metadata(_checkpoint(run))
    assert "model.tok_emb.weight" in metadata.state_dict_metadata


def test_planted_pickle_is_refused_and_runs_nothing(run, tmp_path):
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(run, evil)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(str(marker)))
    live = tmp_path / "live"
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({pickle.dumps(_Payload(str(live)))!r})"],
                   check=True)
    assert live.exists()  # the payload really runs under plain pickle.load, as torch's reader would call it
    (_checkpoint(evil) / ".metadata").write_bytes(payload)
    _rerecord(_checkpoint(evil))  # an attacker rewrites meta.json's digests too: the unpickler must stop it
    before = sorted(p.relative_to(evil) for p in evil.rglob("*"))
    for args in (["generate", "--checkpoint", str(evil), "--max-new-tokens", "5"],
                 ["train", str(CONFIG), "--nproc", "1", "--out", str(evil), "--resume", "--steps", "4",
                  *override_args(TINY | {"train.steps": "4"})]):
        proc = cli_here(*args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "was not loaded: its .metadata names posix.system" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert sorted(p.relative_to(evil) for p in evil.rglob("*")) == before  # nothing of the user's changed


def test_truncated_metadata_is_one_line(run, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    path = _checkpoint(broken) / ".metadata"
    path.write_bytes(path.read_bytes()[:40])
    _rerecord(_checkpoint(broken))  # past the digest check: the reader itself must say it in one line
    proc = cli_here("generate", "--checkpoint", str(broken), "--max-new-tokens", "5")
    assert proc.returncode == 2 and "is missing or unreadable" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_export_holds_the_checkpoints_weights_and_samples_the_same_text(run, tmp_path):
    """The export is the checkpoint's model bit for bit (fp32 bytes copied), so sampling with one seed
    gives the same text from either; the header carries the config and tokenizer; nothing is overwritten."""
    import json

    import torch

    from meshtrain.checkpoint import store as ckpt
    from meshtrain.models.registry import ModelConfig
    from meshtrain.cli.export import load_export
    from meshtrain.models.build import build_model

    out = tmp_path / "model.safetensors"
    proc = cli_here("export", "--checkpoint", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    exported, info = load_export(out)
    meta = ckpt.read_meta(_checkpoint(run))
    model = build_model(ModelConfig(**meta["config"]["model"]), meta["vocab_size"])
    ckpt.load(_checkpoint(run), model, None)
    for (name, a), (_, b) in zip(model.state_dict().items(), exported.state_dict().items()):
        assert torch.equal(a, b), name
    assert info["tokenizer"] == meta["tokenizer"] and json.loads(out.with_suffix(".json").read_text()) == info
    texts = [cli_here("generate", "--checkpoint", str(src), "--prompt", "ROMEO:", "--max-new-tokens", "30").stdout
             for src in (run, out)]
    assert texts[0] == texts[1] and texts[0].startswith("ROMEO:")
    again = cli_here("export", "--checkpoint", str(run), "--out", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.parametrize("out, message", [("model.pt", "must end in .safetensors"),
                                           ("missing/model.safetensors", "does not exist")])
def test_export_refuses_bad_outputs(run, tmp_path, out, message):
    proc = cli_here("export", "--checkpoint", str(run), "--out", str(tmp_path / out))
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def _shard(step_folder):
    return sorted(step_folder.glob("*.distcp"))[0]


@pytest.mark.parametrize("damage, message", [  # a cut and a missing shard in make test-slow: make test's input matrix
    # (tests/test_input_matrix.py) damages the same shard every way for every reader
    ("flip", "the bytes of"), pytest.param("truncate", "bytes when saved", marks=pytest.mark.slow),
    pytest.param("delete", "is missing", marks=pytest.mark.slow)])
def test_a_damaged_shard_is_refused_before_sampling(run, tmp_path, damage, message):
    """Every file's size and SHA-256 are recorded at save; a flipped byte, a cut or a missing shard is one
    line (a checkpoint with zeroed bytes used to sample garbage silently)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    shard = _shard(_checkpoint(broken))
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        shard.unlink()
    proc = cli_here("generate", "--checkpoint", str(_checkpoint(broken)), "--max-new-tokens", "5")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capfd):
    """The launcher and its rank (a real launch from this process, ``conftest.launch_here``; ``capfd`` reads both, as
    a terminal would show them) say it once, and the run resumes from the older checkpoint."""
    from meshtrain.checkpoint import store as ckpt

    run = tmp_path / "run"
    train_here(run, **{"train.steps": "2", "checkpoint.interval": "1", "checkpoint.keep": "2"})
    older, newest = ckpt.list_checkpoints(run)
    shard = _shard(newest)
    shard.write_bytes(shard.read_bytes()[:100])
    capfd.readouterr()
    code = launch_here("train", str(CONFIG), "--nproc", "1", "--out", str(run), "--resume",
                       *override_args({**TINY, "train.steps": "3"}))
    stderr = capfd.readouterr().err
    assert code == 0, stderr[-3000:]
    warning = [line for line in stderr.splitlines() if line.startswith("meshtrain: warning:")]
    assert len(warning) == 1 and str(newest) in warning[0] and f"using {older} instead" in warning[0]
    assert "resumed from step 1 of" in stderr


# meta.json's schema (meshtrain.checkpoint.schema): each required key missing, of a wrong type, out of range
WRONG_TYPE = {"config": [], "tokenizer": "char", "corpus_sha256": 5, "sampler": [], "files": []}
OUT_OF_RANGE = {"step": 0, "config": {}, "tokenizer": {}, "corpus_sha256": "xyz", "vocab_size": 0,
                "sampler": {"samples_seen": -1}, "world_size": 0, "dp": 0, "tp": -1, "sp": 0, "pp": 0,
                "global_batch_size": 0, "files": {}}


def _meta_cases():
    from meshtrain.checkpoint.schema import META_SCHEMA

    cases = []
    for key in META_SCHEMA:
        cases.append(pytest.param(key, "missing", None, id=f"{key}-missing"))
        cases.append(pytest.param(key, "wrong-type", WRONG_TYPE.get(key, "1"), id=f"{key}-wrong-type"))
        cases.append(pytest.param(key, "out-of-range", OUT_OF_RANGE[key], id=f"{key}-out-of-range"))
    cases.append(pytest.param("step", "wrong-type", True, id="step-bool"))
    cases.append(pytest.param("files", "out-of-range", {".metadata": {"bytes": 1, "sha256": "0" * 64},
                                                        "../../escape": {"bytes": 1, "sha256": "0" * 64}},
                              id="files-outside-the-folder"))
    return cases


@pytest.fixture(scope="module")
def meta_copy(run, tmp_path_factory):
    """A copy of the run's checkpoint whose meta.json each case rewrites (shards are never read here)."""
    import shutil

    folder = tmp_path_factory.mktemp("meta") / "step_000002"
    shutil.copytree(_checkpoint(run), folder)
    return folder


@pytest.mark.parametrize("key, damage, value", _meta_cases())
def test_meta_json_is_checked_against_its_schema(meta_copy, key, damage, value):
    import json

    from meshtrain.checkpoint import store as ckpt
    from meshtrain.errors import ConfigError

    path = meta_copy / "meta.json"
    good = path.read_text()
    meta = json.loads(good)
    ckpt.read_meta(meta_copy)  # the saved one passes
    if damage == "missing":
        del meta[key]
    else:
        meta[key] = value
    path.write_text(json.dumps(meta))
    try:
        with pytest.raises(ConfigError) as e:
            ckpt.resolve_checkpoint(meta_copy, verify=True)
    finally:
        path.write_text(good)
    line = str(e.value)
    assert "\n" not in line and str(path) in line and f"'{key}'" in line, line
    assert ("has no key" in line) == (damage == "missing"), line


def test_a_checkpoint_without_its_files_manifest_is_refused_in_one_line(run, tmp_path):
    """Deleting ``files`` from meta.json does not turn the shard check off: the resume stops before launch."""
    import json
    import shutil

    copy = tmp_path / "step_000002"
    shutil.copytree(_checkpoint(run), copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["files"]
    (copy / "meta.json").write_text(json.dumps(meta))
    proc = cli_here("generate", "--checkpoint", str(copy), "--max-new-tokens", "5")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"meshtrain generate: error: checkpoint file {copy / 'meta.json'} has no key 'files': the checkpoint is "
        f"incomplete or was edited; resume from another one"], proc.stderr


def test_an_uncommitted_tmp_step_folder_is_never_resumed(run, tmp_path):
    """A save cut short leaves ``step_N.tmp`` with a complete-looking meta.json; neither a run folder's
    resume nor a resume naming it uses it."""
    import shutil

    from meshtrain.checkpoint import store as ckpt
    from meshtrain.errors import ConfigError

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    committed = _checkpoint(copy)
    tmp = committed.with_name("step_000009.tmp")
    shutil.copytree(committed, tmp)
    assert ckpt.resolve_checkpoint(copy, verify=True) == committed
    with pytest.raises(ConfigError, match=r"is a checkpoint that was never committed"):
        ckpt.resolve_checkpoint(tmp)
