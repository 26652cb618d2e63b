"""Files that were edited to say something else than they hold (issue 37's hand-found cases): each is one line and
exit code 2 before any rank starts, and nothing is written.

- a checkpoint's meta.json whose model config or vocabulary is not the model its weights are (one layer more or
  less, a vocabulary of 10^6): the digests cover every file but meta.json, so the config is checked against DCP's
  ``.metadata`` (``checkpoint.store.check_model_tensors``) for resume, generate and both exports;
- an export whose tensors do not match its header's model (one missing, one extra, one of another shape);
- a prepared folder whose meta.json lies about the vocabulary (70,000 tokens in uint16 shards; 100 when its
  tokenizer has 300) or the dtype (uint32 for uint16 shards);
- and what must be accepted: ``data.packing = "document"`` on a prepared folder with ``data.tokenizer`` left at
  "char" (the folder names its own tokenizer, which has an EOS).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from artefacts import run_cli_here

STEP = "run/checkpoints/step_000002"


def one_line(argv: list[str], *fragments: str) -> str:
    """Run ``meshtrain ARGV`` here; assert exit 2, one line holding every fragment, no traceback; return the line."""
    code, err, out = run_cli_here(argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "" and "Traceback" not in err, f"{code}: {err[-2000:]}"
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def copy_of(artefacts: Path, tmp_path: Path, *names: str) -> Path:
    for name in names:
        (shutil.copytree if (artefacts / name).is_dir() else shutil.copy)(artefacts / name, tmp_path / name)
    return tmp_path


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


EDITS = {
    "one layer more": lambda m: m["config"]["model"].update(n_layer=m["config"]["model"]["n_layer"] + 1),
    "one layer less": lambda m: m["config"]["model"].update(n_layer=m["config"]["model"]["n_layer"] - 1),
    "a vocabulary of 10^6": lambda m: m.update(vocab_size=10**6),
}
READERS = {
    "train --resume": lambda w: ["train", str(w / "config.toml"), "--nproc", "1", "--out", str(w / "run"), "--resume",
                                 "--steps", "4"],
    "generate": lambda w: ["generate", "--max-new-tokens", "2", "--checkpoint", str(w / "run")],
    "export": lambda w: ["export", "--out", str(w / "m.safetensors"), "--checkpoint", str(w / "run")],
    "export --format hf": lambda w: ["export", "--format", "hf", "--out", str(w / "hf"), "--checkpoint", str(w / "run")],
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("edit", EDITS)
def test_a_checkpoint_config_edited_to_another_model_is_one_line(artefacts, tmp_path, edit, reader):
    """Before: DCP's "Missing key in checkpoint state_dict" traceback (a layer more), a 1-layer model loaded silently
    from 2-layer weights (a layer less), a size-mismatch traceback (the vocabulary); a resume given the edited depth
    launched and failed in the rank."""
    w = copy_of(artefacts, tmp_path, "run", "config.toml", "corpus.txt")
    edit_json(w / STEP / "meta.json", EDITS[edit])
    argv = READERS[reader](w)
    if reader == "train --resume":  # the config agrees with the edited meta.json, as a user told to would set it
        meta = json.loads((w / STEP / "meta.json").read_text())
        argv += ["--model.n_layer", str(meta["config"]["model"]["n_layer"])]
    before = sorted(p.relative_to(w) for p in w.rglob("*"))
    one_line(argv, f"{STEP}/meta.json describes another model than the checkpoint holds", "was edited or damaged")
    assert sorted(p.relative_to(w) for p in w.rglob("*")) == before


TENSOR_DAMAGES = {
    "a tensor missing": (lambda t, names: t.pop(names[0]), "is missing"),
    "an extra tensor": (lambda t, names: t.__setitem__("blocks.9.extra", torch.zeros(2)), "it holds blocks.9.extra"),
    "a tensor of another shape": (lambda t, names: t.__setitem__(names[1], torch.zeros(3, 3)), "size mismatch for"),
}


@pytest.mark.parametrize("damage", TENSOR_DAMAGES)
def test_an_export_whose_tensors_are_not_its_models_names_the_tensor(artefacts, tmp_path, damage):
    """``generate`` on an export: before, one vague line ("Error(s) in loading state_dict for GPT:") or a traceback."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    source = artefacts / "export" / "model.safetensors"
    with safe_open(str(source), "pt") as f:
        metadata, names = f.metadata(), sorted(f.keys())
    tensors = load_file(str(source))
    hurt, fragment = TENSOR_DAMAGES[damage]
    hurt(tensors, names)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    one_line(["generate", "--max-new-tokens", "2", "--checkpoint", str(path)],
             "its tensors do not match the model its header describes", fragment)


def _uint32(meta: dict) -> None:
    meta["dtype"] = "uint32"


PREPARED_LIES = {
    "vocab_size 70000 in uint16 shards": (lambda m: m.update(vocab_size=70000), "does not fit its shards' dtype uint16"),
    "vocab_size 100 with a 300-token tokenizer": (lambda m: m.update(vocab_size=100), "is not the 300 tokens of its"),
    "uint32 for uint16 shards": (_uint32, "meta.json says"),
}


@pytest.mark.parametrize("lie, command", [(lie, "train") for lie in PREPARED_LIES]
                         + [("vocab_size 70000 in uint16 shards", "plan")])  # plan reads meta.json alone
def test_a_prepared_meta_that_lies_is_one_line_before_launch(artefacts, tmp_path, lie, command):
    """Before: a 70,000-token model trained on uint16 shards without a word; a vocabulary below the tokenizer's was
    found by the rank's first read only. (``plan`` takes the vocabulary from meta.json without opening the tokenizer
    or the shards: the other two lies reach it as what they say.)"""
    w = copy_of(artefacts, tmp_path, "prepared", "config.toml", "corpus.txt")
    edit, fragment = PREPARED_LIES[lie]
    edit_json(w / "prepared" / "meta.json", edit)
    argv = (["train", str(w / "config.toml"), "--nproc", "1", "--out", str(w / "out")] if command == "train" else
            ["plan", str(w / "config.toml"), "--num-gpus", "1"])
    one_line([*argv, "--data.path", str(w / "prepared")], fragment)
    assert not (w / "out").exists()


def test_document_packing_on_a_prepared_folder_keeps_the_char_default(artefacts, tmp_path):
    """docs/data.md: with a prepared ``data.path``, ``data.tokenizer`` may stay "char", document packing included
    (the folder's tokenizer has its EOS; prepare refuses one without). Before: refused for char's lack of an EOS."""
    w = copy_of(artefacts, tmp_path, "prepared", "config.toml", "corpus.txt")
    code, err, _ = run_cli_here(["train", str(w / "config.toml"), "--nproc", "1", "--out", str(w / "out"),
                                 "--data.path", str(w / "prepared"), "--data.packing", "document"])
    assert code == "launched", err[-2000:]
