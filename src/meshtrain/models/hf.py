"""Hugging Face ``transformers`` checkpoints in and out, for every family with a Hugging Face format
(``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...; :class:`meshtrain.models.family.HFFormat`).

In (``model.init_from``, :func:`load_hf_weights`): each rank fills the parameters it holds -- its pipeline
stages' layers, its tensor-parallel and FSDP2 shards -- by reading exactly those slices of the safetensors
files (``safe_open(...).get_slice``), never a whole tensor it does not hold. A DTensor names its shard's
place in the whole tensor by the same chunk list ``torch.distributed.checkpoint`` uses
(``__create_chunk_list__``), so every layout DCP can save, this can load. bf16/fp16 weights are cast into
the fp32 parameters as they are copied. Nothing is ever downloaded: the folder is local.

Out (:func:`write_hf_folder`, ``meshtrain export --format hf``): ``config.json``, the weights under
``transformers``' names in fp32 -- ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` past ``max_shard_bytes`` -- and the tokenizer: a character one as a
``tokenizer.json`` of the ``tokenizers`` library, a Hugging Face one copied. The names, shapes and transposes are
the family's (``models/<family>/spec.py``); the files are :mod:`meshtrain.models.hf_io`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtrain.errors import ConfigError
from meshtrain.fileio import fresh_temp_dir
from meshtrain.models import hf_io as hf
from meshtrain.models.base import is_adapter
from meshtrain.models.family import Source
from meshtrain.models.hf_carry import carried_config
from meshtrain.models.registry import ModelConfig, hf_format
from meshtrain.models.resize import GROWN, GrownRows


def _format(cfg: ModelConfig) -> Any:
    """The family's :class:`meshtrain.models.family.HFFormat`. Raises ConfigError: a family without one."""
    try:
        return hf_format(cfg.type)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None


def _chunk(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(this rank's local tensor of ``t``, its offset in the whole tensor): a DTensor's shard and the
    offset DCP would save it at; a plain tensor whole, at offset 0."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        (chunk,) = t.__create_chunk_list__()
        return t.to_local(), tuple(chunk.offsets)
    return t, (0,) * t.dim()


def _read(part: Any, source: Source, offset: tuple[int, ...], shape: torch.Size) -> torch.Tensor:
    """The block ``shape`` at ``offset`` of the tensor ``source`` describes, read as slices of the files
    (``part(name)``: the safetensors slice of tensor ``name``); a 3-D block (experts, rows, cols) from the
    per-expert tensors of a stack or from one fused 3-D tensor (:class:`meshtrain.models.family.Source`)."""
    if len(shape) == 3:
        e0, r0, c0 = offset
        rows = slice(source.row0 + r0, source.row0 + r0 + shape[1])
        cols = slice(c0, c0 + shape[2])
        if source.experts:
            return torch.stack([part(source.name.format(e=e))[rows, cols] for e in range(e0, e0 + shape[0])])
        return part(source.name)[e0:e0 + shape[0], rows, cols]
    whole = part(source.name)
    rows = slice(source.row0 + offset[0], source.row0 + offset[0] + shape[0])
    if len(shape) == 1:
        return whole[rows]
    cols = slice(offset[1], offset[1] + shape[1])
    return whole[cols, rows].t() if source.transpose else whole[rows, cols]


def _names(source: Source) -> list[str]:
    """The Hugging Face tensors ``source`` reads: its name, or each expert's of a stack."""
    return [source.name.format(e=e) for e in range(source.experts)] if source.experts else [source.name]


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str | Path, cfg: ModelConfig, grown: GrownRows | None = None) -> int:
    """Copy the weights of the Hugging Face folder into ``model`` (this rank's part: plain modules, DDP,
    FSDP2/tensor-parallel DTensors, pipeline stages). Returns the number of elements this rank read.
    ``grown``: the model's vocabulary extends the checkpoint's (:mod:`meshtrain.data.growth`): the embedding's and
    head's rows past the checkpoint's are made as ``transformers``' ``resize_token_embeddings`` makes them
    (:class:`meshtrain.models.resize.GrownRows`).

    Raises:
        ConfigError: a weights file that is missing or truncated, or a parameter of ``model`` the checkpoint
            does not hold (:func:`meshtrain.models.registry.check_hf_weights` finds these before launch).
    """
    from safetensors import SafetensorError, safe_open
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    folder = Path(folder).expanduser()
    try:
        files = hf.weight_map(folder)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    sources = _format(cfg).sources(cfg, files.keys())
    read = 0
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def part(name: str) -> Any:
            file = files[name]
            if file not in handles:
                try:
                    hf.safetensors_header(folder / file)  # whole, and covered to its last byte
                    handles[file] = stack.enter_context(safe_open(str(folder / file), framework="pt"))
                except (hf.HFFormatError, SafetensorError) as e:
                    raise ConfigError(f"'{folder / file}' cannot be read: {e}") from None
            return handles[file].get_slice(name)

        if grown is not None:
            grown.read = lambda name, r0, r1: part(name)[r0:r1]
            grown.embedding = sources[GROWN[0]].name
        for name, param in get_model_state_dict(model).items():
            source = sources.get(name)
            if (source is not None and not source.name) or is_adapter(name):  # no Hugging Face tensor holds it
                continue  # it keeps its init (a routing bias, a LoRA adapter)
            missing = [n for n in _names(source) if n not in files] if source else []
            if source is None or missing:
                raise ConfigError(f"'{folder}' holds no tensor for parameter {name} "
                                  f"({missing[0] if missing else 'no Hugging Face name'})")
            local, offset = _chunk(param)
            if local.numel() and grown is not None and name in GROWN:
                read += grown.fill(local, offset, source.name, lambda at, shape: _read(part, source, at, shape))
            elif local.numel():
                local.copy_(_read(part, source, offset, local.shape))
                read += local.numel()
        if grown is not None:
            grown.read = None  # the files close here
    return read


def hf_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole meshtrain model's ``state`` (its ``state_dict()``, one process) under ``transformers``' names (the
    family's :class:`meshtrain.models.family.Source` of each parameter): blocks of rows joined into one tensor
    (GPT-2's q, k and v back into ``c_attn``), transposed where the source is (GPT-2's ``Conv1D``), a stack of
    experts as one tensor per expert (the published form); tensors
    ``transformers`` expects that the model lacks as zeros (a GPT without biases, the same function); a tied head
    left out (saved once, as the embedding). Every tensor contiguous, ready for safetensors.

    Raises:
        KeyError: ``state`` lacks a parameter of the model ``cfg`` describes.
    """
    fmt = _format(cfg)
    sources = fmt.sources(cfg, ())
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    transposed: dict[str, bool] = {}
    tied = sources["lm_head.weight"].name == sources["tok_emb.weight"].name
    out = {}
    for name, source in sources.items():
        if (name == "lm_head.weight" and tied) or not source.name:
            continue
        if source.experts:  # a stack (E, rows, cols): one tensor per expert
            out.update({n: state[name][e].detach().contiguous() for e, n in enumerate(_names(source))})
            continue
        parts.setdefault(source.name, []).append((source.row0, state[name].detach()))
        transposed[source.name] = source.transpose
    for name, blocks in parts.items():
        whole = torch.cat([t for _, t in sorted(blocks, key=lambda b: b[0])])
        out[name] = (whole.t() if transposed[name] else whole).contiguous()
    for name, shape in fmt.zeros(cfg).items():
        out[name] = torch.zeros(shape, dtype=torch.float32)
    for name, original in fmt.copies(cfg).items():  # safetensors refuses tensors that share memory
        out[name] = out[original].clone()
    return out


def char_tokenizer_json(chars: str) -> str:
    """A character tokenizer (ids in the order of ``chars``) as the ``tokenizer.json`` of the ``tokenizers``
    library: every character is one word of a ``WordLevel`` vocabulary, split one per character, joined back
    by the ``Fuse`` decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in their order, cut into consecutive groups of at most ``max_shard_bytes`` (a larger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def source_hf_config(folder: str | Path) -> dict[str, Any] | None:
    """The ``config.json`` of the Hugging Face folder a run starts from, or None where it cannot be read (the
    weights were read from it already: this only feeds what an export carries)."""
    try:
        return hf.read_json(Path(folder).expanduser() / hf.CONFIG_FILE, "model.init_from's")
    except hf.HFFormatError:
        return None


def hf_config(cfg: ModelConfig, vocab_size: int,
              source_config: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """(the ``config.json`` an export of the model ``cfg`` writes, the source's keys it changed): the family's
    (:attr:`meshtrain.models.family.HFFormat.write`) carried over the source's (:func:`carried_config`).

    Raises:
        ConfigError: the model has no Hugging Face format, or one the format cannot hold (routing biases).
    """
    fmt = _format(cfg)
    try:
        return carried_config(fmt.write(cfg, vocab_size), source_config, fmt)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None


def write_hf_folder(out: Path, state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int,
                    tokenizer: dict[str, Any] | None, max_shard_bytes: int,
                    source_config: dict[str, Any] | None = None) -> list[Path]:
    """Write the Hugging Face folder ``out`` (which must not exist) of a whole model's ``state``, no weights
    file larger than ``max_shard_bytes`` but for a single larger tensor: built in
    a fresh temporary folder beside it (:func:`meshtrain.fileio.fresh_temp_dir`) and renamed into place, so a crash
    leaves no half-written folder and no other folder is touched. ``source_config``: the ``config.json`` of the
    model the run started from, whose keys the run did not change are carried as they were (:func:`hf_config`).
    Returns the files written.

    Raises:
        ConfigError: ``out`` exists, or the model has no Hugging Face architecture (lstm, gru).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from meshtrain.fileio import unwritten

    if out.exists():
        raise ConfigError(f"'{out}' already exists: exports never overwrite; choose another --out")
    config, _ = hf_config(cfg, vocab_size, source_config)
    tensors = hf_state_dict(state, cfg)
    tmp = fresh_temp_dir(out)  # a fresh name: a user's own OUT.tmp is never touched
    try:
        groups = _shards(tensors, max_shard_bytes)
        names = ([hf.SINGLE_FILE] if len(groups) == 1 else
                 [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
        for name, group in zip(names, groups):
            save_file(group, str(tmp / name), metadata={"format": "pt"})
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                     "weight_map": {t: name for name, group in zip(names, groups) for t in group}}
            (tmp / hf.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / hf.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(tmp, tokenizer)
        os.replace(tmp, out)
    except (OSError, SafetensorError) as e:  # a full disk, a quota: nothing is left behind
        raise ConfigError(unwritten(out, e)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out.iterdir())


TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")


def _write_tokenizer(folder: Path, tokenizer: dict[str, Any] | None) -> None:
    """The run's tokenizer as Hugging Face files in ``folder``: a character tokenizer as a ``tokenizer.json``
    (:func:`char_tokenizer_json`), a Hugging Face one copied with the config files next to it; tiktoken and
    sentencepiece files have no ``tokenizer.json`` form here and are left out (generate then needs the run)."""
    kind = (tokenizer or {}).get("kind")
    if kind == "char":
        (folder / hf.TOKENIZER_FILE).write_text(char_tokenizer_json(tokenizer["chars"]))
    elif kind == "hf":
        source = Path(tokenizer["path"])
        source = source / hf.TOKENIZER_FILE if source.is_dir() else source
        shutil.copyfile(source, folder / hf.TOKENIZER_FILE)
        for name in TOKENIZER_CONFIGS:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, folder / name)
    else:
        return
    if not (folder / TOKENIZER_CONFIGS[0]).exists():
        (folder / TOKENIZER_CONFIGS[0]).write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
