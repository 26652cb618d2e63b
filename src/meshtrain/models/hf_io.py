"""Hugging Face's on-disk format of a causal language model, without torch: the files of a model folder and the
headers of their safetensors files. Each family's names, shapes and ``config.json`` keys are its own
(``models/<family>/spec.py``, :class:`meshtrain.models.family.HFFormat`); the registry picks the family a
``config.json`` describes (:func:`meshtrain.models.registry.hf_model_keys`).

A Hugging Face model folder holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor:
file}}``). A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}}``, offsets counted from byte 8 + N), then the raw tensors; so a
missing or truncated shard and a tensor of the wrong shape are found from the headers alone, before any
process starts (:func:`check_weights`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Collection, Mapping
from typing import Any

from meshtrain.paths import path_problem

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
"""safetensors dtypes a weight may be stored in (bytes per element); each loads into fp32 parameters."""
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32,
              "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
"""Bits per element of every dtype safetensors 0.8 reads (its ``Dtype``): a header's other names are refused."""


class HFFormatError(ValueError):
    """A Hugging Face folder meshtrain cannot read; one line naming the file, the value and what is valid."""


# --- config.json -> [model] keys ----------------------------------------------------------------------------

def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object at ``path``. Raises HFFormatError (missing, unreadable or not an object)."""
    problem = path_problem(path)
    if problem:
        raise HFFormatError(f"{what} '{path}' {problem}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{what} '{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFFormatError(f"{what} '{path}' must hold a JSON object, got {type(data).__name__}")
    return data


def number(hf: dict[str, Any], key: str, where: Path, typ: type | tuple[type, ...], default: Any = None) -> Any:
    """``hf[key]`` (or ``default``), a positive number of type ``typ`` (a size, an epsilon, a RoPE base or
    factor). Raises HFFormatError: missing, not a number, or not > 0."""
    value = hf.get(key, default)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise HFFormatError(f"'{where}': {key} = {value!r} is missing or not a number")
    if not 0 < value < float("inf"):
        raise HFFormatError(f"'{where}': {key} = {value!r} must be a finite number > 0")
    return value


def fraction(hf: dict[str, Any], key: str, where: Path) -> float:
    """``hf[key]``, a probability in [0, 1) (a dropout). Raises HFFormatError: not a number, or out of range."""
    value = hf.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise HFFormatError(f"'{where}': {key} = {value!r} must be a number in [0, 1)")
    return float(value)


@dataclass(frozen=True)
class Derived:
    """A ``config.json`` default that ``transformers`` computes from other keys of the same file rather than a
    constant (``LlamaConfig.__post_init__``: ``head_dim = hidden_size // num_attention_heads``; Qwen2's attention:
    ``getattr(config, "head_dim", hidden_size // num_attention_heads)``); the family's reader derives it, and
    ``rule`` computes it from a config for the defaults test."""

    rule: Callable[[Mapping[str, Any]], Any]
    text: str
    """The rule in words, e.g. "hidden_size // num_attention_heads"."""


class Undecided(str):
    """The value of a ``[model]`` key that ``config.json`` leaves open (GPT-2's three dropouts, unequal, for
    meshtrain's one ``model.dropout``): the run must set the key; the text says why."""


def with_defaults(hf: dict[str, Any], defaults: Mapping[str, Any], aliases: Mapping[str, str] | None = None,
                  ) -> dict[str, Any]:
    """A copy of ``config.json`` (``hf``) in which every key of ``defaults`` it lacks holds the default of the
    family's ``transformers`` config class, as ``from_pretrained`` would fill it (a :class:`Derived` default is
    left to the reader, which derives it), and a key spelled as one of ``aliases`` (``transformers``'
    ``attribute_map``) is also under its own name."""
    out = copy.copy(hf)  # the same mapping type: a test may record which keys the reader looks at
    for alias, name in (aliases or {}).items():
        if alias in out and name not in out:
            out[name] = out[alias]
    for key, default in defaults.items():
        if key not in out and not isinstance(default, Derived):
            out[key] = copy.deepcopy(default)
    return out


def refuse(hf: dict[str, Any], key: str, allowed: Any, where: Path, why: str) -> None:
    """Raise HFFormatError when ``config.json`` (``hf``) sets ``key`` to a value not in ``allowed`` (an option the
    family does not build), naming ``why``."""
    if key in hf and hf[key] not in allowed:
        raise HFFormatError(f"'{where}': {key} = {hf[key]!r} is not supported ({why}): meshtrain builds "
                            f"{' or '.join(map(repr, allowed))}")


def max_positions(hf: dict[str, Any]) -> int | None:
    """The longest context ``config.json`` declares (``max_position_embeddings`` / ``n_positions``), if any."""
    value = hf.get("max_position_embeddings", hf.get("n_positions"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- safetensors files --------------------------------------------------------------------------------------

def safetensors_header(path: Path) -> dict[str, Any]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file (``__metadata__`` left out).

    Raises:
        HFFormatError: missing file, a header that is not safetensors JSON, or a file shorter (truncated) or
            longer than its header says (safetensors refuses bytes after the last tensor).
    """
    problem = path_problem(path)
    if problem:
        raise HFFormatError(f"weights file '{path}' {problem}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise HFFormatError(f"weights file '{path}' is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise HFFormatError(f"weights file '{path}' is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 8 + n + _tensor_bytes(header, path)
    if size != end:  # safetensors reads a file only when its tensors cover it to the last byte
        extra = size - end
        what = "is truncated" if extra < 0 else f"has {extra} byte{'s' if extra > 1 else ''} after its last tensor"
        raise HFFormatError(f"weights file '{path}' {what}: {size} bytes, its header describes {end}; "
                            f"download or copy it again")
    return header


def _tensor_bytes(header: dict[str, Any], path: Path) -> int:
    """The bytes of tensor data ``header`` (a safetensors header less ``__metadata__``) describes, after checking
    it as safetensors does before it reads a byte: each entry ``{"dtype", "shape", "data_offsets": [begin, end]}``
    with a dtype of :data:`DTYPE_BITS`, a shape of non-negative ints, ``end - begin`` the shape's elements times the
    dtype's size, and the byte ranges, in order, one after the other from 0 with no gap and no overlap.

    Raises:
        HFFormatError: the first entry that breaks a rule, named with its values.
    """
    ranges = []
    for name, entry in header.items():
        where = f"weights file '{path}' is not a safetensors file: tensor {name!r}"
        if not isinstance(entry, dict):
            raise HFFormatError(f"{where} is described by {entry!r}, not an object")
        shape, offsets, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise HFFormatError(f"{where} has shape {shape!r}, not a list of sizes >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise HFFormatError(f"{where} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise HFFormatError(f"{where} has dtype {dtype!r}, not one of safetensors' {', '.join(DTYPE_BITS)}")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if offsets[1] - offsets[0] != bits / 8:
            raise HFFormatError(f"{where} has data_offsets {offsets} ({offsets[1] - offsets[0]} bytes) for shape "
                                f"{shape} of {dtype} ({bits / 8:g} bytes): its header lies; download or copy it again")
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(ranges):
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves {begin - end} bytes unused before it"
            raise HFFormatError(f"weights file '{path}' is not a safetensors file: tensor {name!r} at bytes "
                                f"[{begin}, {stop}) {what}; download or copy it again")
        end = stop
    return end


def weight_map(folder: Path) -> dict[str, str]:
    """{tensor name: file name in ``folder``}: from ``model.safetensors.index.json`` when there is one, else
    every tensor of ``model.safetensors``.

    Raises:
        HFFormatError: neither file, an index without a ``weight_map`` object, or a file it names missing.
    """
    index = folder / INDEX_FILE
    if os.path.lexists(index):
        data = read_json(index, "index")
        mapping = data.get("weight_map")
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise HFFormatError(f"index '{index}' has no weight_map object of tensor name -> file name")
        for file in sorted(set(mapping.values())):
            problem = "is not a file name" if os.sep in file else path_problem(folder / file)
            if problem:
                raise HFFormatError(f"shard '{folder / file}' named by '{index}' {problem}: copy every shard "
                                    f"into '{folder}'")
        return mapping
    single = folder / SINGLE_FILE
    if not os.path.lexists(single):
        raise HFFormatError(f"'{folder}' has neither {SINGLE_FILE} nor {INDEX_FILE}: give a Hugging Face model "
                            f"folder with safetensors weights")
    return {name: SINGLE_FILE for name in safetensors_header(single)}


def check_weights(folder: Path, shapes: Callable[[Collection[str]], dict[str, tuple[int, ...]]],
                  spare: Callable[[str], bool] = lambda name: False) -> None:
    """Every tensor the model needs is in ``folder``'s safetensors files, with its shape, in a float dtype, in a
    file that is whole, and the files hold no other tensor but those ``spare(name)`` accepts (a tied head saved
    anyway, GPT-2's mask buffers). Reads only headers. ``shapes`` maps the tensor names the folder holds to
    {name: shape} of every tensor the model needs (a family's :attr:`meshtrain.models.family.HFFormat.shapes`).

    Raises:
        HFFormatError: the first missing file, truncated shard, missing tensor, wrong shape or dtype, or a tensor
            that ``config.json``'s model has no place for (a fifth expert of four, q/k/v biases of a Llama
            without ``attention_bias``): training without it would compute another model than the checkpoint.
    """
    mapping = weight_map(folder)
    headers = {file: safetensors_header(folder / file) for file in sorted(set(mapping.values()))}
    needed = shapes(mapping.keys())
    for name, shape in needed.items():
        file = mapping.get(name)
        entry = headers[file].get(name) if file else None
        if not isinstance(entry, dict):
            index = folder / INDEX_FILE
            where = f"'{folder / file}'" if file else f"the weight_map of '{index}'" if index.exists() else f"'{folder}'"
            raise HFFormatError(f"tensor {name} is missing from {where}: the checkpoint does not match its "
                                f"config.json")
        if tuple(entry.get("shape", ())) != shape:
            raise HFFormatError(f"tensor {name} in '{folder / file}' has shape {tuple(entry.get('shape', ()))}, "
                                f"config.json needs {shape}")
        if entry.get("dtype") not in FLOAT_DTYPES:
            raise HFFormatError(f"tensor {name} in '{folder / file}' is stored as {entry.get('dtype')}: weights "
                                f"must be one of {', '.join(FLOAT_DTYPES)}")
    extra = sorted(name for name in mapping if name not in needed and not spare(name))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise HFFormatError(f"tensor {extra[0]}{more} in '{folder / mapping[extra[0]]}' has no place in the model its "
                            f"config.json describes: the checkpoint and its config.json disagree (an expert count, "
                            f"attention_bias, a layer count); fix config.json or remove the tensor")
