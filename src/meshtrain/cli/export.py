"""``meshtrain export --checkpoint DIR --out model.safetensors``: a checkpoint as one file of plain tensors.

A DCP checkpoint is a folder of shards and a pickled ``.metadata``. meshtrain reads that metadata with
an allow-list (:class:`meshtrain.checkpoint.SafeFileSystemReader`), but other tools may not. The
export is the file to hand to someone else:

- ``OUT.safetensors``: every weight of the model, consolidated from any layout (a tied weight is
  stored once). safetensors holds only a JSON header and raw tensor bytes, so reading it cannot run code.
  The header's ``__metadata__["meshtrain"]`` holds the model config, vocabulary size, tokenizer and
  step as JSON.
- ``OUT.json``: the same JSON, for people and other tools.

``meshtrain generate --checkpoint OUT.safetensors`` samples from it. Neither file is ever overwritten.
Both are written under a temporary name and renamed into place, so a crash leaves no half-written
output.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from meshtrain.config import ConfigError
from meshtrain.fileio import check_writable_dir

SUFFIX = ".safetensors"
METADATA_KEY = "meshtrain"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as one safetensors file (safe to share and load)",
                       description="Consolidate a checkpoint (any layout) into OUT.safetensors plus OUT.json "
                                   "(model config and tokenizer). Loading a safetensors file cannot run code.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run folder (its latest checkpoint) or step folder")
    p.add_argument("--out", required=True, metavar="FILE", help="output file ending in .safetensors (must not exist)")
    p.set_defaults(func=run)


def _outputs(out: str | Path) -> tuple[Path, Path]:
    path = Path(out).expanduser()
    if path.suffix != SUFFIX:
        raise ConfigError(f"--out = '{out}' must end in {SUFFIX}, e.g. model{SUFFIX}")
    sidecar = path.with_suffix(".json")
    for target in (path, sidecar):
        if target.exists():
            raise ConfigError(f"'{target}' already exists: exports never overwrite a file; choose another --out")
    if not path.parent.is_dir():
        raise ConfigError(f"--out = '{out}': folder '{path.parent}' does not exist")
    check_writable_dir(path.parent, "the folder of --out")
    return path, sidecar


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write ``out`` (.safetensors) and its ``.json`` from ``checkpoint``; return the .safetensors path.

    Raises:
        ConfigError: no checkpoint there, an unsafe or broken one, or an output that exists or cannot be written.
    """
    from safetensors.torch import save_model

    path, sidecar = _outputs(out)
    model, meta, found = load_checkpoint_model(checkpoint)
    info = {"model": meta["config"]["model"], "vocab_size": meta["vocab_size"], "tokenizer": meta["tokenizer"],
            "step": meta["step"], "source": str(found)}
    text = json.dumps(info)
    tmp, tmp_sidecar = path.with_name(path.name + ".tmp"), sidecar.with_name(sidecar.name + ".tmp")
    try:
        save_model(model, str(tmp), metadata={METADATA_KEY: text})
        tmp_sidecar.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, path)
        os.replace(tmp_sidecar, sidecar)
    finally:
        for leftover in (tmp, tmp_sidecar):
            leftover.unlink(missing_ok=True)
    return path


def load_checkpoint_model(checkpoint: str | Path):
    """(model, meta, step folder): the model of a verified DCP checkpoint (run or step folder) in one
    process, whatever layout saved it.

    Raises:
        ConfigError: no intact checkpoint there, or an unsafe one.
    """
    from meshtrain import checkpoint as ckpt
    from meshtrain.config import ModelConfig
    from meshtrain.models import build_model

    found = ckpt.resolve_checkpoint(checkpoint, key="--checkpoint", verify=True)
    meta = ckpt.read_meta(found)
    model = build_model(ModelConfig(**meta["config"]["model"]), meta["vocab_size"])
    ckpt.load(found, model, None)
    return model, meta, found


def read_export(path: Path) -> dict[str, Any]:
    """The JSON of an export's header (model config, vocab_size, tokenizer, step).

    Raises:
        ConfigError: not a safetensors file, or one without meshtrain's header entry.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"'{path}' is not a readable safetensors file: {e}") from None
    if METADATA_KEY not in header:
        raise ConfigError(f"'{path}' has no '{METADATA_KEY}' entry in its header: export it with meshtrain export")
    return json.loads(header[METADATA_KEY])


def load_export(path: Path):
    """(model, info) from an export: the model built from the header's config, weights from the file."""
    from safetensors.torch import load_model

    from meshtrain.config import ModelConfig
    from meshtrain.models import build_model

    info = read_export(path)
    model = build_model(ModelConfig(**info["model"]), info["vocab_size"])
    load_model(model, str(path))
    return model, info


def run(args: argparse.Namespace) -> int:
    path = export(args.checkpoint, args.out)
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0
