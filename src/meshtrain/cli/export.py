"""``meshtrain export --checkpoint DIR --out OUT [--format safetensors|hf|peft] [--merge]``: a checkpoint as files to
share.

A DCP checkpoint is a folder of shards and a pickled ``.metadata``. meshtrain reads that metadata with
an allow-list (:class:`meshtrain.checkpoint.store.SafeFileSystemReader`), but other tools may not. The
export is what to hand to someone else, consolidated from any layout:

- ``--format safetensors`` (default): ``OUT.safetensors``, every weight under meshtrain's names (a tied
  weight stored once); its header's ``__metadata__["meshtrain"]`` holds the model config, vocabulary size,
  tokenizer and step as JSON, also written to ``OUT.json`` for people and other tools.
- ``--format hf``: the folder ``OUT`` of a Hugging Face model (``config.json``, safetensors weights sharded
  past ``--max-shard-mb``, a ``tokenizer.json``: the character tokenizer as one, a Hugging Face one copied) that
  ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads: a "gpt" as ``GPT2LMHeadModel``, a "llama"
  as ``LlamaForCausalLM`` (:mod:`meshtrain.models.hf`).
- ``--format peft``: a LoRA run's adapters as the folder ``OUT`` that ``peft.PeftModel.from_pretrained(base, OUT)``
  loads (:mod:`meshtrain.adapters.export`); ``--merge`` instead folds them into the base for the two formats above
  (:func:`meshtrain.adapters.apply.merge`), which refuse a run with adapters without it.

safetensors holds only a JSON header and raw tensor bytes, so reading it cannot run code. ``meshtrain
generate --checkpoint OUT`` samples from either, with this module's loaders: a checkpoint's model
(:func:`load_checkpoint_model`), an export's (:func:`load_export`) and a Hugging Face folder's
(:func:`load_hf_model`). Nothing is ever overwritten: outputs are written under a temporary name and renamed into
place, so a crash leaves no half-written output.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from meshtrain.argtypes import positive_float
from meshtrain.checkpoint.schema import META_SCHEMA
from meshtrain.config.load import apply_init_from, check_saved_config, saved_adapter
from meshtrain.errors import ConfigError
from meshtrain.fileio import check_writable_dir, fresh_temp_file, unwritten
from meshtrain.models import hf_io as hf
from meshtrain.models.registry import ModelConfig, check_hf_weights, hf_max_positions

SUFFIX = ".safetensors"
FORMATS = ("safetensors", "hf", "peft")
DEFAULT_SHARD_BYTES = 5 * 2**30
"""``--max-shard-mb``'s default in bytes (5 GiB, about ``transformers``' 5 GB)."""
METADATA_KEY = "meshtrain"


def add_parser(sub: argparse._SubParsersAction, line: str) -> None:
    p = sub.add_parser("export", help=line,
                       description="Consolidate a checkpoint (any layout) into OUT.safetensors plus OUT.json "
                                   "(--format safetensors), into a Hugging Face model folder OUT that "
                                   "transformers loads (--format hf), or a LoRA run's adapters into a folder OUT that "
                                   "peft loads (--format peft). Loading safetensors cannot run code.")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="run folder (its latest checkpoint) or step folder")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="safetensors: a file ending in .safetensors; hf, peft: a folder; it must not exist")
    p.add_argument("--format", choices=FORMATS, default="safetensors",
                   help="safetensors: one file, meshtrain's names; hf: config.json + weights under transformers' names; "
                        "peft: adapter_config.json + adapter_model.safetensors of a LoRA run")
    p.add_argument("--merge", action="store_true",
                   help="safetensors, hf: fold a LoRA run's adapters into the base weights (W + alpha/r B A)")
    p.add_argument("--max-shard-mb", type=positive_float, default=DEFAULT_SHARD_BYTES / 2**20, metavar="MIB",
                   help="hf: largest weights file in MiB; larger models are sharded with an index (default 5 GiB)")
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


def export(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write ``out`` (.safetensors) and its ``.json`` from ``checkpoint``; return the .safetensors path. ``merge``:
    a LoRA run's adapters folded into its base (:func:`plain_model`).

    Raises:
        ConfigError: no checkpoint there, an unsafe or broken one, a run with adapters without ``merge``, or an
            output that exists or cannot be written.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    path, sidecar = _outputs(out)
    model, meta, found = plain_model(checkpoint, merge)
    info = {"model": meta["config"]["model"], "vocab_size": meta["vocab_size"], "tokenizer": meta["tokenizer"],
            "step": meta["step"], "source": str(found)}
    text = json.dumps(info)
    tmp, tmp_sidecar = fresh_temp_file(path), fresh_temp_file(sidecar)  # never a user's own NAME.tmp
    try:
        save_model(model, str(tmp), metadata={METADATA_KEY: text})
        tmp_sidecar.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, path)
        os.replace(tmp_sidecar, sidecar)
    except (OSError, SafetensorError) as e:  # a full disk, a quota: nothing is left behind
        raise ConfigError(unwritten(path, e)) from None
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
    from meshtrain.checkpoint import store as ckpt

    found = ckpt.resolve_checkpoint(checkpoint, key="--checkpoint", verify=True)
    meta = ckpt.read_meta(found)
    model = ckpt.described_model(meta)
    ckpt.load(found, model, None)
    return model, meta, found


def read_export(path: Path) -> dict[str, Any]:
    """The JSON of an export's header (model config, vocab_size, tokenizer, step), checked as a checkpoint's
    meta.json is: the model config key by key (:func:`meshtrain.config.load.check_saved_config`), the vocabulary
    size and the tokenizer record by :data:`meshtrain.checkpoint.schema.META_SCHEMA`'s rules.

    Raises:
        ConfigError: not a safetensors file, one without meshtrain's header entry, or an entry that is not that
            JSON (damaged or edited), naming the first wrong key.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"'{path}' is not a readable safetensors file: {e}") from None
    if METADATA_KEY not in header:
        raise ConfigError(f"'{path}' has no '{METADATA_KEY}' entry in its header: export it with meshtrain export")
    damaged = f"'{path}' has a damaged '{METADATA_KEY}' header entry"
    try:
        info = json.loads(header[METADATA_KEY])
    except ValueError as e:
        raise ConfigError(f"{damaged} (not JSON: {e}): export the checkpoint again") from None
    if not isinstance(info, dict) or not isinstance(info.get("model"), dict):
        raise ConfigError(f"{damaged} (no 'model' object): export the checkpoint again")
    for key in ("vocab_size", "tokenizer"):
        want, typed, in_range = META_SCHEMA[key]
        if key not in info or not typed(info[key]) or not in_range(info[key]):
            raise ConfigError(f"{damaged}: '{key}' must be {want}: export the checkpoint again")
    try:
        check_saved_config({"model": info["model"]})
    except ConfigError as e:
        raise ConfigError(f"{damaged}: in its model config, {e}: export the checkpoint again") from None
    return info


def load_export(path: Path):
    """(model, info) from an export: the model built from the header's config, weights from the file.

    Raises:
        ConfigError: :func:`read_export`'s, or tensors that do not match the header's model (missing, extra or of
            another shape).
    """
    from safetensors.torch import load_model

    from meshtrain.models.build import build_model

    info = read_export(path)
    model = build_model(check_saved_config({"model": info["model"]}), info["vocab_size"])
    try:
        missing, unexpected = load_model(model, str(path), strict=False)  # sets of names
    except RuntimeError as e:  # a tensor of another shape: torch's line names it
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = next((line for line in lines if not line.startswith("Error(s)")), lines[0] if lines else type(e).__name__)
    else:
        reason = (f"{min(missing)} is missing" if missing else
                  f"it holds {min(unexpected)}, which that model has no place for" if unexpected else None)
    if reason:
        raise ConfigError(f"'{path}': its tensors do not match the model its header describes ({reason}): export the "
                          f"checkpoint again")
    return model, info


def hf_model_config(folder: str | Path):
    """The ModelConfig of a Hugging Face model folder (its ``config.json``,
    :func:`meshtrain.config.load.apply_init_from`), ``block_size`` its declared positions (the context generation may
    use).

    Raises:
        ConfigError: not a folder, or a ``config.json`` meshtrain cannot build.
    """
    cfg = ModelConfig(init_from=str(folder))
    apply_init_from(cfg, {"model.dropout"})  # a model to run, not to train: no dropout, whatever the file says
    where = Path(folder).expanduser() / hf.CONFIG_FILE
    try:
        limit = hf_max_positions(hf.read_json(where, "config"), where)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    cfg.block_size = limit or cfg.block_size  # the whole context the model was built for
    try:
        check_saved_config({"model": asdict(cfg)})
    except ConfigError as e:
        raise ConfigError(f"'{where}' describes a model meshtrain cannot build: {e}") from None
    return cfg


def load_hf_model(folder: str | Path):
    """(the whole model, its ModelConfig) of a Hugging Face folder, in one process on the CPU: its config checked as
    a saved one (:func:`hf_model_config`), its weights read by :func:`meshtrain.models.hf.load_hf_weights`.

    Raises:
        ConfigError: what :func:`hf_model_config` and :func:`meshtrain.models.registry.check_hf_weights` refuse.
    """
    from meshtrain.models.build import build_model
    from meshtrain.models.hf import load_hf_weights

    cfg = hf_model_config(folder)
    try:
        check_hf_weights(Path(folder).expanduser(), cfg)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    model = build_model(cfg, cfg.vocab_size)
    load_hf_weights(model, folder, cfg)
    return model, cfg


def plain_model(checkpoint: str | Path, merge: bool):
    """:func:`load_checkpoint_model`, its LoRA adapters (if any) merged into the base when ``merge``.

    Raises:
        ConfigError: as :func:`load_checkpoint_model`, or a run with adapters and no ``merge``."""
    from meshtrain.adapters import apply

    model, meta, found = load_checkpoint_model(checkpoint)
    if merge:
        apply.merge(model)
    elif any(".lora_" in name for name, _ in model.named_parameters()):
        raise ConfigError(f"checkpoint {found} holds LoRA adapters: export them with --format peft, or the base with "
                          f"the adapters folded in with --merge")
    return model, meta, found


def export_peft(checkpoint: str | Path, out: str | Path) -> list[Path]:
    """Write a LoRA run's adapters as the peft folder ``out`` (:func:`meshtrain.adapters.export.write_peft_folder`);
    return the files written.

    Raises:
        ConfigError: no checkpoint there, an unsafe or broken one, a run without adapters, or an ``out`` that exists
            or whose parent cannot be written.
    """
    from meshtrain.adapters.export import write_peft_folder

    folder = _new_folder(out)
    model, meta, _ = load_checkpoint_model(checkpoint)
    return write_peft_folder(folder, model.state_dict(), saved_adapter(meta["config"]), model.cfg)


def _new_folder(out: str | Path) -> Path:
    """``out`` as a folder to create: it must not exist, its parent must be a writable folder. Raises ConfigError."""
    folder = Path(out).expanduser()
    if folder.exists():
        raise ConfigError(f"'{folder}' already exists: exports never overwrite; choose another --out")
    if not folder.parent.is_dir():
        raise ConfigError(f"--out = '{out}': folder '{folder.parent}' does not exist")
    check_writable_dir(folder.parent, "the folder of --out")
    return folder


def export_hf(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write the Hugging Face folder ``out`` from ``checkpoint`` (:func:`meshtrain.models.hf.write_hf_folder`);
    return the files written (:func:`export_hf_report` also says which keys of the source's config.json changed).

    Raises:
        ConfigError: no checkpoint there, an unsafe or broken one, a recurrent model, or an ``out`` that exists
            or whose parent cannot be written.
    """
    return export_hf_report(checkpoint, out, max_shard_bytes)[0]


def export_hf_report(checkpoint: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     merge: bool = False) -> tuple[list[Path], dict[str, tuple[Any, Any]]]:
    """(the files :func:`export_hf` writes, {key: (the source's value, the export's)} of each key of the source model's
    ``config.json`` whose meaning the run changed, :func:`meshtrain.models.hf.hf_config`: empty for a run that did
    not start from a Hugging Face folder, or changed none).

    ``merge``: a LoRA run's adapters folded into its base (:func:`plain_model`).

    Raises:
        ConfigError: as :func:`export_hf`, or a run with adapters without ``merge``.
    """
    from meshtrain.models.hf import hf_config, write_hf_folder

    folder = _new_folder(out)
    model, meta, _ = plain_model(checkpoint, merge)
    source = meta.get("source_hf_config")
    _, changes = hf_config(model.cfg, meta["vocab_size"], source)
    files = write_hf_folder(folder, model.state_dict(), model.cfg, meta["vocab_size"], meta["tokenizer"],
                            max_shard_bytes, source)
    return files, changes


def changed_lines(changes: dict[str, tuple[Any, Any]]) -> list[str]:
    """One line per key of the source's ``config.json`` that an export changed: its old and new values."""
    return [f"config.json: {key} = {json.dumps(new)} (the source model's was {json.dumps(old)}; the run changed it)"
            for key, (old, new) in changes.items()]


def run(args: argparse.Namespace) -> int:
    if args.format == "hf":
        shard = int(min(args.max_shard_mb * 2**20, 2**62))  # 1e308 MiB: no limit
        files, changes = export_hf_report(args.checkpoint, args.out, shard, args.merge)
        print(f"wrote {args.out}: {', '.join(f.name for f in files)}")
        for line in changed_lines(changes):
            print(line)
        return 0
    if args.format == "peft":
        if args.merge:
            raise ConfigError("--merge folds adapters into the base weights, which --format peft does not write: use "
                              "--format hf --merge or --format safetensors --merge, or drop --merge")
        files = export_peft(args.checkpoint, args.out)
        print(f"wrote {args.out}: {', '.join(f.name for f in files)}")
        return 0
    path = export(args.checkpoint, args.out, args.merge)
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0
