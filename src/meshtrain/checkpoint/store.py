"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded save, atomic commit, resharding load.

Layout of a run folder::

    OUT/checkpoints/step_000500/   committed checkpoint (DCP shards + .metadata + meta.json)
    OUT/checkpoints/step_000500.tmp/   being written; never read (nor resumed), removed by the next save

A step folder is written under ``.tmp`` and renamed by rank 0 only after every rank finished and
``meta.json`` is on disk, so a crash never leaves a half-written checkpoint under a real name, and an
existing checkpoint is never overwritten. Model and optimizer state go through
``get_state_dict``/``set_state_dict``, which name tensors by their unwrapped parameter names, so a
checkpoint saved with DDP loads into FSDP2 at another dp size and the other way round (DCP reshards
from its global metadata). A ``ZeroRedundancyOptimizer`` (zero_stage 1) saves and loads through a plain
AdamW holding every state (:func:`_as_adamw`), so its checkpoints are those of zero_stage 0.
``meta.json`` holds the step, config, tokenizer, sampler and LR-schedule state.

Loading never runs code from a checkpoint: DCP's ``.metadata`` is a pickle, which torch reads with
``pickle.load``; here it is read by an unpickler that accepts only the metadata classes
(:class:`SafeFileSystemReader`), and tensors are read with ``torch.load(weights_only=True)`` (DCP's own).
``meta.json`` is JSON. It also records the size and SHA-256 of every file of the checkpoint, checked
before a checkpoint is used (:func:`verify_files`): a truncated or altered shard is refused, and a run
folder falls back to its newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import re
import shutil
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from meshtrain.checkpoint.schema import check_meta
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.models.base import TIED_NAMES, is_adapter
from meshtrain.paths import path_problem
from meshtrain.fileio import write_json_atomic

STEP_RE = re.compile(r"^step_(\d{6,})$")
META = "meta.json"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
PARTIAL = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
"""Loads a model state that holds part of the model's tensors (the adapters of a frozen base)."""


def trained_part(model_sd: dict[str, Any], trained: Collection[str] = ()) -> dict[str, Any]:
    """What a checkpoint holds of a model's state ``model_sd``: all of it, or with LoRA adapters
    (:mod:`meshtrain.adapters`) the adapters and the parameters ``trained`` names (the modules trained in full beside
    them, ``adapter.modules_to_save``: :func:`optimized_names`, :func:`trainable_names`) -- the frozen base is rebuilt
    from where it came from (``model.init_from``, or ``train.seed``), so a run folder stays the adapters' size."""
    if not any(map(is_adapter, model_sd)):
        return model_sd
    return {name: value for name, value in model_sd.items() if is_adapter(name) or name in trained}


def trainable_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s (a plain, unwrapped model's) parameters that train, a tied weight under each of its
    names."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def optimized_names(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> set[str]:
    """The parameters an optimizer's flattened state ``optim_sd`` (``param_groups.<name>.<option>`` keys, DCP's
    names, wrappers' prefixes removed) trains, and a tied weight's other name in ``model_sd`` (the optimizer lists it
    once, the state dict under both names, and a pipeline's head copy reads it under ``lm_head.weight``)."""
    names = {key[len("param_groups."):].rsplit(".", 1)[0] for key in optim_sd if key.startswith("param_groups.")}
    pair = [name for name in TIED_NAMES if name in model_sd]
    if len(pair) == 2 and names & set(pair) and _same_storage(*(model_sd[name] for name in pair)):
        names |= set(pair)
    return names


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two state tensors (plain or DTensor) are views of one parameter's memory (a tied weight)."""
    a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
    return a.numel() > 0 and a.data_ptr() == b.data_ptr() and a.shape == b.shape
"""Optimizer state keyed by parameter name, hyperparameters included (``param_groups.<name>.lr``): each
pipeline stage saves and loads its own parameters' entries, so the state reshards across pp sizes like the
weights do (a nested ``param_groups`` list would be one rank's, the others' lost)."""


METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
}
"""The only globals a DCP ``.metadata`` pickle may name: the metadata classes, ``torch.Size``, dtypes
(``torch.float32``, ...), the layout decoder and paths. Constructing any of them runs no code of the
file's choosing."""


class UnsafeCheckpointError(ConfigError):
    """A checkpoint's metadata names something outside :data:`METADATA_GLOBALS`: it may be crafted to
    run code, and is not loaded."""


class _ForbiddenGlobal(pickle.UnpicklingError):
    """A global outside :data:`METADATA_GLOBALS`; the message is ``module.name``."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global outside :data:`METADATA_GLOBALS` (Python's
    "Restricting Globals" recipe, pickle docs): ``pickle.load`` would import and call whatever the file
    names, e.g. ``os.system``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"{module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :class:`_MetadataUnpickler` for ``.metadata`` (torch's own calls
    ``pickle.load``); tensor shards are read by torch with ``torch.load(weights_only=True)`` as before."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except _ForbiddenGlobal as e:
            raise UnsafeCheckpointError(f"checkpoint {self.path} was not loaded: its .metadata names {e}, which a "
                                        f"checkpoint never contains (it could run code); use a checkpoint you "
                                        f"trust, or its safetensors export") from None
        except (OSError, EOFError, ValueError, TypeError, AttributeError, pickle.UnpicklingError) as e:
            raise ConfigError(f"checkpoint {self.path}: .metadata is missing or unreadable ({e}): "
                              f"the checkpoint is incomplete or corrupt") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"checkpoint {self.path}: .metadata holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(ckpt: Path) -> Metadata:
    """The DCP metadata of a committed checkpoint, read without running code from it.

    Raises:
        UnsafeCheckpointError: it names a global outside :data:`METADATA_GLOBALS`.
        ConfigError: it is missing or unreadable.
    """
    return SafeFileSystemReader(str(ckpt)).read_metadata()


def step_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Committed step folders of a run, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name) and os.path.lexists(p / META)]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path, key: str = "checkpoint.resume", verify: bool = False) -> Path:
    """A committed step folder from a step folder or a run folder (its latest checkpoint).

    With ``verify``, the checkpoint is checked (:func:`verify_checkpoint`): its files against the sizes and SHA-256
    digests recorded when it was saved, its meta.json's model against the weights. A run folder then yields its newest intact checkpoint, with one
    warning line on stderr naming each newer damaged one and why.

    Raises:
        ConfigError: nothing committed there, or (``verify``) no intact checkpoint there.
    """
    p = Path(path).expanduser()
    if p.name.endswith(".tmp"):  # rank 0 writes meta.json into it before the commit; an interrupted save stays
        raise ConfigError(f"{key} = '{path}' is a checkpoint that was never committed (a save still running or "
                          f"cut short): give its run folder, which resumes from the newest committed step")
    if os.path.lexists(p / META):
        if verify:
            verify_checkpoint(p)
        return p
    found = list_checkpoints(p)
    if not found:
        stopped_early = (p / "metrics.jsonl").is_file() and not any((p / "checkpoints").glob("step_*"))
        if stopped_early and key == "checkpoint.resume":  # a run that stopped before its first checkpoint
            raise ConfigError(f"{key} = '{path}' holds a run that saved no checkpoint, so there is nothing to resume: "
                              f"start it afresh without --resume after removing {p / 'metrics.jsonl'}, or choose "
                              f"another --out")
        raise ConfigError(f"{key} = '{path}' holds no checkpoint: give a run folder with "
                          "checkpoints/step_* or a step folder with meta.json")
    if not verify:
        return found[-1]
    damaged = []
    for candidate in reversed(found):
        try:
            verify_checkpoint(candidate)
        except ConfigError as e:
            damaged.append(str(e))
            continue
        for reason in damaged:
            print(f"meshtrain: warning: {reason}; using {candidate} instead", file=sys.stderr)
        return candidate
    raise ConfigError(f"{key} = '{path}': no intact checkpoint ({damaged[0]})")


def file_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex digest}}`` of every file of a checkpoint folder but meta.json."""
    out = {}
    for f in sorted(Path(folder).iterdir()):
        if f.is_file() and f.name != META:
            with f.open("rb") as stream:
                out[f.name] = {"bytes": f.stat().st_size, "sha256": hashlib.file_digest(stream, "sha256").hexdigest()}
    return out


def verify_files(ckpt: Path) -> None:
    """Check every file recorded in ``meta.json["files"]`` at save time: present, same size, same SHA-256.
    The record is required (:func:`read_meta`): deleting it does not turn the check off.

    Raises:
        ConfigError: the first missing, truncated or altered file, in one line.
    """
    for name, want in read_meta(ckpt)["files"].items():
        f = Path(ckpt) / name
        problem = path_problem(f)
        if problem:
            raise ConfigError(f"checkpoint {ckpt} is incomplete: {name} "
                              f"{'is missing' if problem == 'does not exist' else problem}")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise ConfigError(f"checkpoint {ckpt} is damaged: {name} has {size:,} bytes, {want['bytes']:,} bytes when saved")
        with f.open("rb") as stream:
            if hashlib.file_digest(stream, "sha256").hexdigest() != want["sha256"]:
                raise ConfigError(f"checkpoint {ckpt} is damaged: the bytes of {name} changed since it was saved "
                                  f"(SHA-256 differs)")


def verify_checkpoint(ckpt: Path) -> None:
    """:func:`verify_files`, then :func:`check_model_tensors`. Raises ConfigError: the first problem, in one line."""
    verify_files(ckpt)
    check_model_tensors(ckpt)


def check_model_tensors(ckpt: Path) -> None:
    """The model ``meta.json``'s config and vocabulary describe is the one whose weights the checkpoint holds: each
    of its parameters and buffers is a ``model.*`` tensor of DCP's ``.metadata`` with its shape, and ``.metadata``
    holds no other. (The digests of :func:`verify_files` cover every file but ``meta.json``, whose config an edit
    can change: a model of another depth or vocabulary would fail inside DCP's load, or load part of the weights.)
    Builds the model on the meta device: no memory, no weights read.

    Raises:
        ConfigError: the first tensor missing, left over or of another shape, naming the meta.json.
    """
    meta = read_meta(ckpt)
    stored = {k[len("model."):]: tuple(v.size) for k, v in read_metadata(ckpt).state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "size")}
    with torch.device("meta"):
        model = described_model(meta, base=False)
    needed = {k: tuple(v.shape) for k, v in trained_part(model.state_dict(), trainable_names(model)).items()}
    problem = next((f"{name} is not in its weights" for name in needed if name not in stored), None)
    problem = problem or next((f"{name} has shape {stored[name]} in its weights, {shape} in its config"
                               for name, shape in needed.items() if stored[name] != shape), None)
    problem = problem or next((f"its weights hold {name}, which its config has no place for"
                               for name in stored if name not in needed), None)
    if problem:
        m = meta["config"]["model"]
        raise ConfigError(f"checkpoint file {Path(ckpt) / META} describes another model than the checkpoint holds "
                          f"(model.type = {m.get('type')!r}, n_layer = {m.get('n_layer')}, n_embd = {m.get('n_embd')}, "
                          f"vocab_size = {meta['vocab_size']}: {problem}): the checkpoint was edited or damaged; "
                          f"resume from another one")


def described_model(meta: dict[str, Any], base: bool = True) -> nn.Module:
    """The whole model a checkpoint's ``meta`` (:func:`read_meta`) describes, in one process, on torch's default
    device, before the checkpoint's tensors are loaded into it (:func:`load`): built from its config, and with
    LoRA adapters (``[adapter]``) its frozen base as the run had it -- ``train.seed``'s weights, then ``model.init_from``'s
    when set (``base``: read them; False on the meta device) -- and the adapters added."""
    from meshtrain.adapters.apply import adapt
    from meshtrain.config.load import saved_adapter
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    config = meta["config"]
    m = ModelConfig(**config["model"])
    torch.manual_seed(config.get("train", {}).get("seed", 0))  # the run's seed: an adapter's base is its weights
    model = build_model(m, meta["vocab_size"])
    adapter = saved_adapter(config)
    if adapter.lora_rank:
        if base:
            from meshtrain.adapters.spec import BASE_KEY, base_record, check_same_base

            check_same_base(meta.get(BASE_KEY), base_record(m.init_from, config["train"]["seed"]), meta.get("step"))
        if base and m.init_from:
            from meshtrain.models.hf import load_hf_weights
            from meshtrain.models.resize import GrownRows

            grown = meta["vocab_size"] > m.vocab_size > 0  # its trained embedding and head are in the checkpoint
            load_hf_weights(model, m.init_from, m, GrownRows(m.vocab_size, meta["vocab_size"], config["train"]["seed"])
                            if grown else None)
        adapt(model, adapter, m, quantize=base)  # QLoRA: quantized after reading it
    return model


def read_meta(ckpt: Path) -> dict[str, Any]:
    """``meta.json`` of a step folder, checked against :data:`meshtrain.checkpoint.schema.META_SCHEMA`.

    Raises:
        ConfigError: unreadable, not JSON, or a key missing, of the wrong type or out of range (one line
            naming the file and the key).
    """
    path = Path(ckpt) / META
    problem = path_problem(path)
    if problem and problem != "does not exist":
        raise ConfigError(f"checkpoint file {path} {problem}: the checkpoint is damaged; resume from another one")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"checkpoint file {path} is missing or not JSON ({e}): the checkpoint is incomplete or "
                          f"damaged; resume from another one") from None
    return check_meta(meta, path)


def save(out_dir: Path, step: int, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any],
         keep: int, group: dist.ProcessGroup | None = None, extra: Any = None) -> Path:
    """Collectively save model + optimizer state (and ``extra``'s, :func:`state_to_save`) and ``meta``; commit
    atomically; keep the newest ``keep``.

    Every rank of ``group`` (default: all) must call this, global rank 0 among them. Returns the
    committed step folder. (:class:`meshtrain.checkpoint.writer.Checkpoints` writes the same folders in the
    background.)

    Raises:
        FileExistsError: that step is already committed (nothing is overwritten).
    """
    tmp = begin_save(out_dir, step, group)
    dcp.save(state_to_save(model, optimizer, extra), checkpoint_id=str(tmp), process_group=group)
    # every rank's files are in (DCP's save ends with a gather of every rank's write results)
    final = commit(out_dir, step, meta, file_digests(tmp) if dist.get_rank() == 0 else {}, keep)
    dist.barrier(group)
    return final


def begin_save(out_dir: Path, step: int, group: dist.ProcessGroup | None = None) -> Path:
    """Collectively (over ``group``) make the empty ``step_N.tmp`` folder a save writes into; return it.

    Raises:
        FileExistsError: that step is already committed (nothing is overwritten).
    """
    final = step_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group)
    return tmp


def state_to_save(model: nn.Module, optimizer: Optimizer, extra: Any = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP saves it: tensors named by parameter name (:data:`OPTIONS`).
    Collective for a ``ZeroRedundancyOptimizer`` (:func:`_as_adamw` gathers its shares). ``extra``: an object
    whose ``state_dict()`` gives more tensors named by parameter (DiLoCo's outer momentum,
    :meth:`meshtrain.parallel.diloco.DiLoCo.state_dict`), saved under ``"outer"``."""
    model_sd, optim_sd = get_state_dict(model, _as_adamw(optimizer, gather=True), options=OPTIONS)
    state = {"model": trained_part(model_sd, optimized_names(model_sd, optim_sd)), "optim": optim_sd}
    if extra is not None:
        state[EXTRA] = extra.state_dict()
    return state


EXTRA = "outer"
"""The checkpoint's key of the extra state (:func:`state_to_save`)."""


def commit(out_dir: Path, step: int, meta: dict[str, Any], files: dict[str, dict[str, Any]], keep: int) -> Path:
    """Rank 0 (a no-op elsewhere): write ``meta.json`` with the files manifest ``files``
    (:func:`file_digests` of the finished ``.tmp`` folder) into ``step_N.tmp``, rename it to ``step_N``,
    and delete all but the newest ``keep`` committed checkpoints. Call it once every rank's files are
    written. Returns the committed step folder."""
    final = step_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        write_json_atomic(tmp / META, {"step": step, **meta, "files": files})
        os.replace(tmp, final)
        for old in list_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def load(ckpt: Path, model: nn.Module, optimizer: Optimizer | None, aliases: dict[str, str] | None = None,
         group: dist.ProcessGroup | None = None, extra: Any = None, fresh_optimizer: bool = False,
         started: Collection[str] = ()) -> dict[str, Any]:
    """Collectively (over ``group``, default all ranks) load a committed checkpoint into ``model`` (and
    ``optimizer``), resharding as needed.

    ``aliases`` maps a parameter name to another one holding the same tensor in a checkpoint of another
    layout: a pipeline's head copy of the tied embedding (``lm_head.weight``) reads the optimizer state
    that a one-stage run saved under ``tok_emb.weight``. ``extra``: what :func:`state_to_save` saved of it is
    given to its ``load_state_dict`` (the names the checkpoint holds; none from a run without it). Returns the
    checkpoint's ``meta.json`` contents. ``fresh_optimizer``: ``optimizer``'s states are left as they are
    (``checkpoint.fresh_optimizer``: the checkpoint's may be another optimizer's). ``started``: model tensors the
    checkpoint lacks, which keep the values the model was built with (routing biases a resume adds,
    :func:`meshtrain.preflight.started_tensors`; buffers, which have no optimizer state).
    """
    read_metadata(ckpt)  # a crafted or broken .metadata is one ConfigError here, not an error inside DCP's load
    if optimizer is None:
        model_sd = trained_part(model.state_dict(), trainable_names(model))
        model_sd = {k: v for k, v in model_sd.items() if k not in started}
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_sd}, storage_reader=SafeFileSystemReader(str(ckpt)))
        model.load_state_dict(model_sd, strict=len(model_sd) == len(model.state_dict()))
    else:
        target = _as_adamw(optimizer, gather=False)
        model_sd, optim_sd = get_state_dict(model, target, options=OPTIONS)
        model_sd = trained_part(model_sd, optimized_names(model_sd, optim_sd))
        model_sd = {k: v for k, v in model_sd.items() if k not in started}
        renamed = _aliased_keys(ckpt, optim_sd, aliases or {})
        optim_sd = {renamed.get(k, k): v for k, v in optim_sd.items()}
        state = {"model": model_sd, "optim": optim_sd}
        if fresh_optimizer:
            del state["optim"]
        if extra is not None:
            stored, held = set(read_metadata(ckpt).state_dict_metadata), extra.state_dict()
            wanted = {k: k if f"{EXTRA}.{k}" in stored else (aliases or {}).get(k) for k in held}
            wanted = {k: stored_as for k, stored_as in wanted.items() if f"{EXTRA}.{stored_as}" in stored}
            state[EXTRA] = {stored_as: held[k] for k, stored_as in wanted.items()}
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), process_group=group)
        if extra is not None:
            extra.load_state_dict({k: state[EXTRA][stored_as] for k, stored_as in wanted.items()})
        # adapters: the base is not in it; started tensors keep their built values
        options = PARTIAL if started or any(map(is_adapter, model_sd)) else OPTIONS
        if fresh_optimizer:
            set_model_state_dict(model, state["model"], options=options)
            return read_meta(ckpt)
        back = {v: k for k, v in renamed.items()}
        optim_sd = {back.get(k, k): v for k, v in state["optim"].items()}
        kernels = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
        set_state_dict(model, target, model_state_dict=state["model"], optim_state_dict=optim_sd, options=options)
        if target is not optimizer:
            optimizer.load_state_dict(target.state_dict())  # each rank keeps the states of its own share
        for g, chosen in zip(optimizer.param_groups, kernels):
            g.update(chosen)  # this layout's kernels, not the saving layout's (fused fails on DTensor states)
    return read_meta(ckpt)


def _as_adamw(optimizer: Optimizer, gather: bool) -> Optimizer:
    """``optimizer`` itself, or for a ``ZeroRedundancyOptimizer`` (which DCP's state dicts do not take: its
    own ``state`` is empty, so DCP would initialise it with a zero-gradient step) a plain AdamW over the
    same parameter groups, with every rank's states when ``gather`` (collective: each rank of its group
    receives the others' shares, so the save holds the whole state on every rank for a moment)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    plain = optimizer._optim_constructor([{**g, "params": list(g["params"])} for g in optimizer.param_groups])
    if gather:
        for rank in range(optimizer.world_size):  # each call gathers onto one rank (and clears the others')
            optimizer.consolidate_state_dict(to=rank)
            if rank == optimizer.rank:
                plain.load_state_dict(optimizer.state_dict())
                optimizer._all_state_dicts.clear()  # else the whole state would stay on this rank until the next save
    return plain


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""Optimizer options that choose kernels, not the training state: a resumed run keeps its own."""


def _aliased_keys(ckpt: Path, optim_sd: dict[str, Any], aliases: dict[str, str]) -> dict[str, str]:
    """{requested optimizer key: the checkpoint's key for it} for keys the checkpoint lacks under their own
    parameter name but holds under an alias (``state.lm_head.weight.exp_avg`` -> ``state.tok_emb.weight.exp_avg``)."""
    if not aliases:
        return {}
    stored = set(read_metadata(ckpt).state_dict_metadata)
    out = {}
    for key in optim_sd:
        if f"optim.{key}" in stored:
            continue
        for name, alias in aliases.items():
            if f".{name}." in f".{key}.":
                other = f".{key}.".replace(f".{name}.", f".{alias}.", 1)[1:-1]
                if f"optim.{other}" in stored:
                    out[key] = other
    return out


def resume_hint(out_dir: Path) -> str:
    """What a run folder allows after a failed run: ``--resume`` from its newest committed checkpoint (a save cut
    short never committed, and its ``.tmp`` folder is never resumed), or, with none, starting again in a new folder
    (a folder with a run in it is never reused). Lower case, for the end of a sentence."""
    found = list_checkpoints(out_dir)
    if found:
        return f"the same command with --resume continues from {found[-1].name} in {out_dir}"
    return f"{out_dir} holds no checkpoint: start again with another --out (or remove {out_dir})"


def resume_checkpoint(cfg: Config) -> Path | None:
    """The step folder a rank resumes from: ``checkpoint.resume``, or, in ranks torchrun restarted after a
    failure, the newest checkpoint of this run's own output folder; None to start fresh."""
    resume = cfg.checkpoint.resume
    if elastic_restart() and list_checkpoints(cfg.train.out_dir):
        resume = cfg.train.out_dir  # continue this run, not the checkpoint it started from
    return resolve_checkpoint(resume) if resume else None


def elastic_restart() -> bool:
    """True in ranks that torchrun restarted after a failure (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
