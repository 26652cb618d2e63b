"""The generated bad-input matrix: every file meshtrain reads x every damage x every subcommand that reads it.

The artefacts are built once per session (:func:`artefacts`); each case copies the ones it needs into a fresh
folder, damages one file and runs the CLI in this process with torchrun's engine replaced by a trap, so
nothing can start a rank. Each case must end with exit code 2 and one line ``meshtrain CMD: error: ...`` that
names the damaged file (or, for a file that is gone, the folder it belongs to), with no traceback, within
:data:`LIMIT_S` seconds (a FIFO must not block a read), and with every other file of the folder unchanged and
no output written. The line is the one docs/bad_inputs.md gives (:mod:`bad_inputs_doc`).

A new file joins by one :class:`InputFile` line in :data:`FILES`, a new subcommand by one argv in its readers;
a new damage by one entry in :data:`DAMAGES`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from artefacts import LIMIT_S, run_cli_here
from bad_inputs_doc import check, doc_writer  # noqa: F401 (a fixture)

STEP = "run/checkpoints/step_000002"
TRAIN = ("train", "{w}/config.toml", "--nproc", "1", "--out", "{w}/out")
TRAIN2 = ("train", "{w}/config.toml", "--nproc", "2", "--out", "{w}/out")
RESUME = ("train", "{w}/config.toml", "--nproc", "1", "--out", "{w}/run", "--resume", "--steps", "4")
PLAN = ("plan", "{w}/config.toml", "--num-gpus", "1")
GENERATE = ("generate", "--max-new-tokens", "2", "--checkpoint")
EXPORT = ("export", "--out", "{w}/model.safetensors", "--checkpoint")
EXPORT_HF = ("export", "--format", "hf", "--out", "{w}/exported", "--checkpoint")
CHECKPOINT_READERS = {"train --resume": RESUME, "generate": (*GENERATE, "{w}/run"), "export": (*EXPORT, "{w}/run"),
                      "export --format hf": (*EXPORT_HF, "{w}/run")}
HF = ("--model.init_from", "{w}/hf")
HF_READERS = {"train": (*TRAIN, *HF), "train --nproc 2": (*TRAIN2, *HF), "plan": (*PLAN, *HF),
              "generate": (*GENERATE, "{w}/hf")}
PREPARED = ("--data.path", "{w}/prepared")
CORPUS = ("--data.path", "{w}/corpus.txt")
BPE = ("--data.tokenizer", "{w}/bpe/tokenizer.json")
PREPARE = ("prepare", "--tokenizer", "{w}/bpe/tokenizer.json", "--input", "{w}/corpus.txt", "--out", "{w}/prepared_new",
           "--workers", "1", "--doc-split", "blank-line", "--val-fraction", "0.1")


@dataclass(frozen=True)
class InputFile:
    """A file meshtrain reads: its path in the folder of artefacts, its kind ("toml", "text", "json", "binary"),
    the subcommands that read it (name -> argv, ``{w}`` the case's folder), for JSON the fields meshtrain reads
    (dotted key -> a value out of its range, None where every value of the type is valid), and the damages
    that leave a valid input for some readers (damage -> those readers: half a text is a text)."""

    path: str
    kind: str
    readers: dict[str, tuple[str, ...]]
    fields: dict[str, Any] = field(default_factory=dict)
    valid: dict[str, tuple[str, ...]] = field(default_factory=dict)
    data_only: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Damages only the data shows (damage -> readers): they pass every check before launch, and the rank that
    reads the data stops with one line (``tests/test_binary_damage.py`` checks that line)."""
    read_back: bool = False
    """A file meshtrain wrote and reads back (a run's record, a profile, prepared metadata): it also gets
    :data:`READ_BACK_DAMAGES`, which :func:`meshtrain.fileio.read_checked` refuses before anything parses it."""


FINISHED = "finished"
"""A run folder as a finished run leaves it (:func:`artefacts` adds it): metrics.jsonl, summary.json and the
plan_vs_actual.json that ``plan --calibrate-from`` reads."""
CALIBRATE_FROM = (*PLAN, "--calibrate-from", f"{{w}}/{FINISHED}")
PROFILE = "profile/hardware_profile.toml"
"""A calibrated hardware profile (:func:`artefacts` copies the reference machine's, which has its format)."""
EXTRA_KEY = "written_by_a_newer_tool"
EXTRA = f"an extra key ({EXTRA_KEY})"
ALL = ("train", "train --nproc 2", "train --resume", "plan", "prepare", "generate", "export", "export --format hf",
       "plan --calibrate-from", "plan --profile")
"""Every reader (:attr:`InputFile.valid` ``damage -> readers``; a file's own readers are those it lists)."""

FILES = [
    InputFile("config.toml", "toml", {"train": TRAIN, "train --nproc 2": TRAIN2, "train --resume": RESUME, "plan": PLAN}),
    InputFile("corpus.txt", "text", {"train": (*TRAIN, *CORPUS), "train --nproc 2": (*TRAIN2, *CORPUS),
                                     "train --resume": (*RESUME, *CORPUS), "plan": (*PLAN, *CORPUS), "prepare": PREPARE},
              valid={"truncated": ("train", "train --nproc 2", "plan", "prepare")}),
    InputFile("bpe/tokenizer.json", "json", {"train": (*TRAIN, *BPE), "train --nproc 2": (*TRAIN2, *BPE),
                                            "plan": (*PLAN, *BPE), "prepare": PREPARE},
              {"model": None, "model.vocab": None, "model.merges": None, "added_tokens": None},
              valid={"added_tokens: missing": ALL}),
    InputFile("prepared/meta.json", "json", {"train": (*TRAIN, *PREPARED), "train --nproc 2": (*TRAIN2, *PREPARED),
                                            "plan": (*PLAN, *PREPARED)},
              {"format": "meshtrain-other", "format_version": 99, "vocab_size": 0, "dtype": "float64",
               "tokenizer": None, "tokenizer.kind": "bogus", "splits": None, "splits.train": None,
               "splits.train.tokens": -1, "splits.train.documents": -1, "splits.train.shards": None,
               "splits.val.tokens": 10**30}, valid={EXTRA: ALL}, read_back=True),
    InputFile("prepared/train_00000.bin", "binary", {"train": (*TRAIN, *PREPARED), "train --nproc 2": (*TRAIN2, *PREPARED)},
              data_only={"garbage of its size": ("train", "train --nproc 2")}),
    InputFile("prepared/val_00000.bin", "binary", {"train": (*TRAIN, *PREPARED), "train --nproc 2": (*TRAIN2, *PREPARED)},
              data_only={"garbage of its size": ("train", "train --nproc 2")}),
    InputFile(f"{STEP}/meta.json", "json", CHECKPOINT_READERS,
              {"step": 0, "vocab_size": 0, "files": {}, "tokenizer": None, "tokenizer.kind": "bogus",
               "tokenizer.chars": "", "sampler.samples_seen": -1, "global_batch_size": 0, "config": None,
               "config.model": None, "config.model.type": "rnn", "config.model.n_layer": 0,
               "config.model.n_head": 0, "config.model.n_embd": 0, "config.model.block_size": 0,
               "config.model.dropout": 1.5, "config.model.norm_eps": -1.0, "config.model.bias": None,
               "config.model.activation": "relu", "config.data.val_fraction": 2.0, "config.train.seed": -1},
              valid={EXTRA: ALL, **{f"config.model.{key}: missing": ALL  # keys added since the first checkpoints
                                    for key in ("dropout", "norm_eps", "bias", "activation")}}),
    InputFile("run/metrics.jsonl", "text", {"train --resume": RESUME},  # rank 0 keeps the records up to the step
              valid={"missing": ("train --resume",), "empty": ("train --resume",)}, read_back=True),
    InputFile(f"{STEP}/.metadata", "binary", CHECKPOINT_READERS),
    InputFile(f"{STEP}/__0_0.distcp", "binary", CHECKPOINT_READERS),
    InputFile("hf/config.json", "json", HF_READERS,
              {"architectures": ["MistralForCausalLM"], "n_layer": 0, "n_head": 0, "n_embd": 0, "n_positions": 0,
               "vocab_size": 0, "layer_norm_epsilon": -1.0, "activation_function": "relu"},
              valid={EXTRA: ALL, **{f"{key}: missing": ALL  # transformers' defaults; the family from model_type
                                    for key in ("architectures", "layer_norm_epsilon", "activation_function")},
                     "vocab_size: missing": ("plan",)}),  # plan reads config.json alone: GPT-2's default 50257
    InputFile("hf/model.safetensors.index.json", "json", {"train": (*TRAIN, *HF), "train --nproc 2": (*TRAIN2, *HF),
                                                          "generate": (*GENERATE, "{w}/hf")},
              {"weight_map": {}}, valid={EXTRA: ALL}),
    InputFile("hf/model-00001-of-00003.safetensors", "binary",
              {"train": (*TRAIN, *HF), "train --nproc 2": (*TRAIN2, *HF), "generate": (*GENERATE, "{w}/hf")}),
    InputFile("hf/tokenizer.json", "json", {"generate": (*GENERATE, "{w}/hf")},
              {"model": None, "model.vocab": None}),
    InputFile("export/model.safetensors", "binary", {"generate": (*GENERATE, "{w}/export/model.safetensors")}),
    InputFile(f"{FINISHED}/plan_vs_actual.json", "json", {"plan --calibrate-from": CALIBRATE_FROM},
              {"predicted": None, "predicted.time_breakdown_s": None, "predicted.time_breakdown_s.compute": -1.0,
               "predicted.time_breakdown_s.total": 0, "predicted.layout": None, "predicted.device": "cuda",
               "measured": None, "measured.step_time_s": 1e6},
              valid={EXTRA: ALL, "predicted.layout: missing": ALL,  # records name the layout for the user only
                     "predicted.device: missing": ALL},  # records before the field: the profile's name says cpu
              read_back=True),
    InputFile(PROFILE, "toml", {"plan --profile": (*PLAN, "--profile", f"{{w}}/{PROFILE}")},
              valid={"missing": ALL},  # no profile: the reference machine's (meshtrain plan --calibrate writes one)
              read_back=True),
]
ACCEPTED = "accepted: still a valid input of this command"
"""The doc's line for a damage that leaves a valid input (:attr:`InputFile.valid`)."""
DATA_ONLY = ("accepted: passes every check before launch (sizes and headers are right), and the rank that reads it "
             "stops with one line, e.g. prepared data '~/work/prepared' (train split) holds token id 51234 at token 17, outside "
             "its vocabulary of 300 (meta.json): a shard is damaged; run meshtrain prepare again")
"""The doc's line for a damage only the data shows (:attr:`InputFile.data_only`)."""


# --- damages -----------------------------------------------------------------------------------------------

def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


GARBAGE = random.Random(0).randbytes(4096)
DAMAGES = {
    "missing": lambda p: p.unlink(),
    "empty": lambda p: p.write_bytes(b""),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "not UTF-8": lambda p: p.write_bytes(p.read_bytes()[:40] + b"\xe9" + p.read_bytes()[40:]),
    "binary garbage": lambda p: p.write_bytes(GARBAGE),
    "a folder": lambda p: _replace(p, Path.mkdir),
    "a FIFO": lambda p: _replace(p, os.mkfifo),
    "a dangling symlink": lambda p: _replace(p, lambda q: q.symlink_to(q.with_name(q.name + ".gone"))),
    "/dev/null": lambda p: _replace(p, lambda q: q.symlink_to("/dev/null")),
    "a byte appended": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
    "garbage of its size": lambda p: p.write_bytes(random.Random(1).randbytes(p.stat().st_size)),
}
"""Damage name -> what it does to the file. "not UTF-8" applies to text kinds only, "a byte appended" to binary
ones, "garbage of its size" to the files whose :attr:`InputFile.data_only` names it."""


def _sparse_garbage(path: Path) -> None:
    path.write_bytes(GARBAGE)
    os.truncate(path, 2**30)


READ_BACK_DAMAGES = {
    "/dev/zero": lambda p: _replace(p, lambda q: q.symlink_to("/dev/zero")),
    "a symlink loop": lambda p: _replace(p, lambda q: q.symlink_to(q.name)),
    "unreadable": lambda p: p.chmod(0),
    "1 GiB of garbage (sparse)": _sparse_garbage,
}
"""Damages of the files meshtrain reads back (:attr:`InputFile.read_back`), besides :data:`DAMAGES` (a FIFO and a
folder among them): a device that never ends, a link to itself, a file no one may read (refused for root too, who
could read it), and a file far larger than any record, made sparse so that it costs no disk."""


def _wrong_type(value: Any) -> Any:
    """A JSON value of another type than ``value``'s."""
    if isinstance(value, dict):
        return [1, 2]
    if isinstance(value, list):
        return {"a": 1}
    if isinstance(value, str):
        return 7
    return "7"


def _set_field(path: Path, dotted: str, value: Any) -> None:
    data = json.loads(path.read_text())
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[key]
    target[last] = value(target[last]) if callable(value) else value
    path.write_text(json.dumps(data))


def _drop_field(path: Path, dotted: str) -> None:
    data = json.loads(path.read_text())
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[key]
    del target[last]
    path.write_text(json.dumps(data))


def _add_key(path: Path) -> None:
    data = json.loads(path.read_text())
    data[EXTRA_KEY] = 1
    path.write_text(json.dumps(data))


def damages(f: InputFile) -> dict[str, Any]:
    """The damages of ``f``: name -> a function of the file's path. A JSON file also gets, per field it lists, the
    field of a wrong type, out of range (its listed value), and missing, and one extra top-level key."""
    only = {"not UTF-8": f.kind != "binary", "a byte appended": f.kind == "binary",
            "garbage of its size": "garbage of its size" in f.data_only}
    out = {name: hurt for name, hurt in DAMAGES.items() if only.get(name, True)}
    if f.read_back:
        out.update(READ_BACK_DAMAGES)
    for dotted, bad in f.fields.items():
        out[f"{dotted}: wrong type"] = lambda p, d=dotted: _set_field(p, d, _wrong_type)
        if bad is not None:
            out[f"{dotted}: {json.dumps(bad)}"] = lambda p, d=dotted, v=bad: _set_field(p, d, v)
        out[f"{dotted}: missing"] = lambda p, d=dotted: _drop_field(p, d)
    if f.kind == "json":
        out[EXTRA] = _add_key
    return out


def command_lines() -> dict[str, dict[str, str]]:
    """{file: {subcommand: its command line}}, as the doc shows them (``~/work`` the case's folder)."""
    return {f.path: {name: "meshtrain " + " ".join(argv).replace("{w}", "~/work") for name, argv in f.readers.items()}
            for f in FILES}


def case_keys() -> list[tuple[str, str, str]]:
    """(file, damage, command) of every case, in the doc's order."""
    return [(f.path, damage, command) for f in FILES for damage in damages(f) for command in f.readers]


CASES = [pytest.param(f, damage, command, id=f"{f.path}|{damage}|{command}")
         for f in FILES for damage in damages(f) for command in f.readers]


# --- the files a finished run leaves -----------------------------------------------------------------------

@pytest.fixture(scope="session")
def artefacts(artefacts: Path) -> Path:  # noqa: F811 (conftest's, plus what a finished run and a calibration leave)
    """conftest's artefacts plus :data:`FINISHED` (the 2-step run's metrics.jsonl and summary.json, and the
    plan_vs_actual.json meshtrain train writes after a run, predicted for its config and measured at twice the
    prediction) and :data:`PROFILE` (the reference machine's profile, in the format plan --calibrate writes)."""
    from meshtrain.config.load import load_config
    from meshtrain.planner.actual import predict_for_run, write_plan_vs_actual
    from meshtrain.planner.hardware import CPU_REFERENCE

    finished = artefacts / FINISHED
    if not finished.exists():
        finished.mkdir()
        for name in ("metrics.jsonl", "summary.json"):
            shutil.copy2(artefacts / "run" / name, finished / name)
        summary = json.loads((finished / "summary.json").read_text())
        cfg = load_config(artefacts / "config.toml")
        predicted = predict_for_run(cfg, 1, summary["vocab_size"], "cpu", artefacts / "no_profile.toml", threads=1)
        write_plan_vs_actual(predicted, {"step_time_s": 2 * predicted["step_time_s"],
                                         "peak_memory_bytes": summary["peak_memory_bytes"]}, finished)
        (artefacts / PROFILE).parent.mkdir()
        shutil.copy2(CPU_REFERENCE, artefacts / PROFILE)
    return artefacts


# --- running a case ----------------------------------------------------------------------------------------

def workspace(artefacts: Path, to: Path, f: InputFile, argv: tuple[str, ...]) -> Path:
    """A copy of the artefacts ``f`` and ``argv`` name, at ``to``."""
    names = {"config.toml", f.path.split("/")[0]} | {a.split("/")[1] for a in argv if a.startswith("{w}/")}
    for name in names:
        src = artefacts / name
        if src.is_dir():
            shutil.copytree(src, to / name, symlinks=True)
        elif src.exists():
            to.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, to / name)
    return to


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``folder``: (mode, size, mtime) from ``lstat`` (a FIFO or a link is not followed)."""
    out = {}
    for p in folder.rglob("*"):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_mode, 0 if p.is_dir() else st.st_size,
                                           0 if p.is_dir() else st.st_mtime_ns)
    return out


def normalise(line: str, w: Path, artefacts: Path) -> str:
    return line.replace(str(w), "~/work").replace(str(artefacts), "~/artefacts")


@pytest.mark.parametrize("f, damage, command", CASES)
def test_a_damaged_file_is_one_line_exit_2_and_changes_nothing(artefacts, doc_writer, tmp_path, f, damage, command):  # noqa: F811
    argv = f.readers[command]
    w = workspace(artefacts, tmp_path / "w", f, argv)
    target = w / f.path
    damages(f)[damage](target)
    before = snapshot(w)
    code, err, out = run_cli_here([a.replace("{w}", str(w)) for a in argv])
    lines = err.strip().splitlines()
    assert not str(code).startswith("traceback"), f"TRACEBACK {code}"
    assert code != "hang", f"HANG: no answer in {LIMIT_S} s"
    if command in f.valid.get(damage, ()):
        assert code in (0, "launched"), err[-2000:]
        check(("matrix", f.path, damage, command), ACCEPTED)
        return
    if command in f.data_only.get(damage, ()):
        assert code == "launched", err[-2000:]
        check(("matrix", f.path, damage, command), DATA_ONLY)
        return
    assert code not in (0, "launched"), f"ACCEPTED ({code}): {err[-2000:]}"
    assert snapshot(w) == before, f"WROTE: {sorted(set(snapshot(w).items()) ^ set(before.items()))}"
    assert code == 2 and len(lines) == 1 and out == "", f"NOT ONE LINE (exit {code}): {err[-2000:]}"
    line = lines[0]
    assert line.startswith(f"meshtrain {command.split()[0]}: error: ") and "Traceback" not in err, line
    named = target.name in line or (damage == "missing" and str(target.parent) in line)
    assert named, f"NO FILE NAME: {line}"
    check(("matrix", f.path, damage, command), normalise(line, w, artefacts))


@pytest.mark.parametrize("f, command", [pytest.param(f, c, id=f"{f.path}|{c}") for f in FILES for c in f.readers])
def test_the_undamaged_artefacts_pass_every_reader(artefacts, tmp_path, f, command):
    """The control: without the damage each command gets past every check (so each refusal is the damage's)."""
    argv = f.readers[command]
    w = workspace(artefacts, tmp_path / "w", f, argv)
    code, err, _ = run_cli_here([a.replace("{w}", str(w)) for a in argv])
    assert code in (0, "launched"), f"{code}: {err[-3000:]}"


def test_the_doc_lists_every_case_and_the_readme_counts_them():
    """docs/bad_inputs.md has a line for each case of the matrix and the catalogue (and no other), none left
    "(not run)", and README.md's counts are the doc's (regenerate both with tests/gen_bad_inputs_doc.py)."""
    import re

    from bad_inputs_doc import DOC, README_COUNTS, ROOT, documented_count, parse

    text = DOC.read_text()
    documented = {key[1:] for key in parse(text) if key[0] == "matrix"}
    assert documented == set(case_keys()), f"{sorted(documented ^ set(case_keys()))[:5]}: run tests/gen_bad_inputs_doc.py"
    assert "(not run)" not in text, "run python tests/gen_bad_inputs_doc.py"
    catalogue, matrix = documented_count(text)
    found = re.search(README_COUNTS, (ROOT / "README.md").read_text())
    assert found and tuple(map(int, found.groups())) == (catalogue + matrix, catalogue, matrix), found


@pytest.mark.slow
@pytest.mark.parametrize("f, command", [pytest.param(f, c, id=f"{f.path}|{c}") for f in FILES for c in f.readers])
def test_the_installed_cli_says_the_same_line(artefacts, tmp_path, f, command):
    """The real command in a fresh interpreter, torchrun's engine included, on one damage per (file, command)
    (binary garbage in its place): the same single line and exit code 2 as in this process, nothing written."""
    from conftest import run_cli

    argv = [a.replace("{w}", str(tmp_path / "w")) for a in f.readers[command]]
    w = workspace(artefacts, tmp_path / "w", f, f.readers[command])
    DAMAGES["binary garbage"](w / f.path)
    before = snapshot(w)
    proc = run_cli(*argv, timeout=LIMIT_S * 4)
    _, err, _ = run_cli_here(argv)
    assert proc.returncode == 2 and proc.stderr.strip() == err.strip() and proc.stdout == "", proc.stderr[-2000:]
    assert snapshot(w) == before


# --- each reader of a file meshtrain reads back, called directly ----------------------------------------------

def _readers() -> dict[str, tuple[str, Any]]:
    """Reader name -> (the file it reads, in the artefacts; a function of that file's path that reads it)."""
    from meshtrain.data.shards import read_prepared_meta
    from meshtrain.metrics import read_metrics
    from meshtrain.planner.hardware import get_hardware, load_hardware_file
    from meshtrain.planner.stack import run_dir_speed

    return {"read_metrics": (f"{FINISHED}/metrics.jsonl", lambda p: read_metrics(p.parent)),
            "run_dir_speed": (f"{FINISHED}/plan_vs_actual.json", lambda p: run_dir_speed(p.parent, "cpu")),
            "get_hardware --profile": (PROFILE, lambda p: get_hardware("cpu", profile=p)),
            "load_hardware_file": (PROFILE, load_hardware_file),
            "read_prepared_meta": ("prepared/meta.json", lambda p: read_prepared_meta(p.parent))}


FILE_DAMAGES = ("a FIFO", "a folder", *READ_BACK_DAMAGES)
"""What each reader of :func:`_readers` meets in place of its file: every one is refused before it is parsed."""


@pytest.mark.parametrize("damage", FILE_DAMAGES)
@pytest.mark.parametrize("reader", list(_readers()))
def test_each_reader_checks_its_file_before_parsing_it(artefacts, tmp_path, reader, damage):
    """The reader raises ConfigError, one line naming the file, within 10 s (a FIFO would block a read, and
    /dev/zero or 1 GiB of garbage fill the memory), and leaves the folder as it was; undamaged, it reads the file."""
    import signal

    from meshtrain.errors import ConfigError

    name, read = _readers()[reader]
    folder = tmp_path / name.split("/")[0]
    shutil.copytree(artefacts / name.split("/")[0], folder, symlinks=True)
    target = tmp_path / name
    read(target)  # the control
    (DAMAGES | READ_BACK_DAMAGES)[damage](target)
    before = snapshot(folder)

    def up(signum, frame):
        raise TimeoutError(f"HANG: {reader} on {damage}")

    old = signal.signal(signal.SIGALRM, up)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        with pytest.raises(ConfigError) as raised:
            read(target)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    line = str(raised.value)
    assert "\n" not in line and target.name in line, line
    assert snapshot(folder) == before
