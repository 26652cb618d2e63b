"""Hugging Face's on-disk format of a causal language model, without torch: ``config.json`` <-> meshtrain's
``[model]`` keys, the tensor names and shapes of ``LlamaForCausalLM`` and ``GPT2LMHeadModel``, and the
headers of their safetensors files.

A Hugging Face model folder holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"weight_map": {tensor:
file}}``). A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}}``, offsets counted from byte 8 + N), then the raw tensors; so a
missing or truncated shard and a tensor of the wrong shape are found from the headers alone, before any
process starts (:func:`check_weights`).

Names: each meshtrain parameter reads a :class:`Source`, a block of rows of one Hugging Face tensor, possibly
transposed. Llama's tensors map one to one. GPT-2 stores its linear layers as ``Conv1D`` (weight (in, out),
the transpose of ``nn.Linear``'s) and fuses q, k and v into one ``c_attn`` whose output features are
``[q | k | v]``; meshtrain's ``attn.q`` is rows ``0..C`` of ``c_attn.weight``'s transpose, ``attn.k`` rows
``C..2C``, ``attn.v`` rows ``2C..3C``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.paths import path_problem

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
ARCHITECTURES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt"}
"""Hugging Face architecture -> the ``model.type`` that builds it."""
HF_MODEL_TYPE = {"llama": "llama", "gpt": "gpt2"}
"""``model.type`` -> ``config.json``'s ``model_type``."""
FLOAT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
"""safetensors dtypes a weight may be stored in (bytes per element); each loads into fp32 parameters."""


class HFFormatError(ValueError):
    """A Hugging Face folder meshtrain cannot read; one line naming the file, the value and what is valid."""


@dataclass(frozen=True)
class Source:
    """Where a meshtrain parameter lives in a Hugging Face checkpoint: rows ``row0 .. row0 + rows`` (dim 0) of
    tensor ``name``, transposed first when ``transpose`` (GPT-2's ``Conv1D`` stores (in, out))."""

    name: str
    transpose: bool = False
    row0: int = 0


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


def architecture(hf: dict[str, Any], where: Path) -> str:
    """The ``model.type`` building the architecture ``config.json`` names (``architectures[0]``, else
    ``model_type``). Raises HFFormatError for an architecture meshtrain does not build."""
    names = hf.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise HFFormatError(f"'{where}': architectures = {names!r} must be a list of names, e.g. "
                            f"[\"{next(iter(ARCHITECTURES))}\"]")
    name = names[0] if names else None
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if name is None and hf.get("model_type") in HF_MODEL_TYPE.values():
        return {v: k for k, v in HF_MODEL_TYPE.items()}[hf["model_type"]]
    shown = name if name is not None else f"model_type {hf.get('model_type')!r}"
    raise HFFormatError(f"'{where}' describes {shown}, which meshtrain does not build: supported are "
                        f"{', '.join(ARCHITECTURES)}")


def _get(hf: dict[str, Any], key: str, where: Path, typ: type | tuple[type, ...], default: Any = None) -> Any:
    """``hf[key]`` (or ``default``), a positive number of type ``typ`` (a size, an epsilon, a RoPE base or
    factor). Raises HFFormatError: missing, not a number, or not > 0."""
    value = hf.get(key, default)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise HFFormatError(f"'{where}': {key} = {value!r} is missing or not a number")
    if not 0 < value < float("inf"):
        raise HFFormatError(f"'{where}': {key} = {value!r} must be a finite number > 0")
    return value


def _refuse(hf: dict[str, Any], key: str, allowed: Any, where: Path, why: str) -> None:
    if key in hf and hf[key] not in allowed:
        raise HFFormatError(f"'{where}': {key} = {hf[key]!r} is not supported ({why}): meshtrain builds "
                            f"{' or '.join(map(repr, allowed))}")


def model_keys(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """meshtrain ``[model]`` keys of the model ``config.json`` (``hf``, read from ``where``) describes: its
    type, shape, MLP width, norm epsilon, RoPE, tying and vocabulary; ``block_size`` for GPT-2 (the rows of
    its learned position table). Keys a checkpoint cannot contradict; training keys (dropout) stay the run's.

    Raises:
        HFFormatError: an architecture or option meshtrain does not build, or a missing/ill-typed key.
    """
    kind = architecture(hf, where)
    num = (int, float)
    if kind == "gpt":
        embd = _get(hf, "n_embd", where, int)
        _refuse(hf, "n_inner", (None, 4 * embd), where, "the GPT's MLP is 4 * n_embd wide")
        _refuse(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"), where, "GPT-2's activations")
        _refuse(hf, "scale_attn_weights", (True,), where, "attention scores are scaled by 1/sqrt(head size)")
        _refuse(hf, "scale_attn_by_inverse_layer_idx", (False,), where, "no per-layer attention scaling")
        _refuse(hf, "add_cross_attention", (False,), where, "a decoder without cross-attention")
        _refuse(hf, "tie_word_embeddings", (True,), where, "GPT-2 ties its head to the token embedding")
        act = hf.get("activation_function", "gelu_new")
        return {"type": "gpt", "n_layer": _get(hf, "n_layer", where, int), "n_head": _get(hf, "n_head", where, int),
                "n_embd": embd, "block_size": _get(hf, "n_positions", where, int),
                "vocab_size": _get(hf, "vocab_size", where, int),
                "norm_eps": float(_get(hf, "layer_norm_epsilon", where, num, 1e-5)), "bias": True,
                "activation": "gelu" if act == "gelu" else "gelu_tanh"}
    heads, embd = _get(hf, "num_attention_heads", where, int), _get(hf, "hidden_size", where, int)
    if heads >= 1 and hf.get("head_dim") not in (None, embd // heads):
        raise HFFormatError(f"'{where}': head_dim = {hf['head_dim']} is not hidden_size / num_attention_heads = "
                            f"{embd // heads}: meshtrain's Llama derives the head size from the width")
    _refuse(hf, "hidden_act", ("silu",), where, "Llama's SwiGLU")
    _refuse(hf, "attention_bias", (False,), where, "Llama's projections have no biases")
    _refuse(hf, "mlp_bias", (False,), where, "Llama's projections have no biases")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5 / 4 spelling
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    keys = {"type": "llama", "n_layer": _get(hf, "num_hidden_layers", where, int), "n_head": heads, "n_embd": embd,
            "n_kv_head": _get(hf, "num_key_value_heads", where, int, heads),
            "ffn_hidden": _get(hf, "intermediate_size", where, int), "vocab_size": _get(hf, "vocab_size", where, int),
            "norm_eps": float(_get(hf, "rms_norm_eps", where, num, 1e-6)),
            "rope_theta": float(_get({"rope_theta": theta}, "rope_theta", where, num)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "rope_scaling_factor": 0.0}
    if rope_type == "llama3":
        keys.update(rope_scaling_factor=float(_get(rope, "factor", where, num)),
                    rope_low_freq_factor=float(_get(rope, "low_freq_factor", where, num)),
                    rope_high_freq_factor=float(_get(rope, "high_freq_factor", where, num)),
                    rope_original_max_positions=_get(rope, "original_max_position_embeddings", where, int))
    elif rope_type != "default":
        raise HFFormatError(f"'{where}': rope type {rope_type!r} is not supported: meshtrain builds 'default' and "
                            f"'llama3' (Llama 3.1's frequency scaling)")
    return keys


def max_positions(hf: dict[str, Any]) -> int | None:
    """The longest context ``config.json`` declares (``max_position_embeddings`` / ``n_positions``), if any."""
    value = hf.get("max_position_embeddings", hf.get("n_positions"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- [model] keys -> config.json ----------------------------------------------------------------------------

def hf_config(model: dict[str, Any], vocab_size: int, ffn_hidden: int, kv_heads: int) -> dict[str, Any]:
    """``config.json`` of a meshtrain ``[model]`` (``model``: ModelConfig's fields as a dict) for ``transformers``:
    ``LlamaForCausalLM`` for type "llama" (``ffn_hidden`` and ``kv_heads`` resolved by the caller), ``GPT2LMHeadModel``
    for "gpt" (a GPT without biases is GPT-2 with zero biases). Weights are stored in fp32.

    Raises:
        HFFormatError: a recurrent model (no Hugging Face architecture).
    """
    kind = model["type"]
    if kind == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
                "n_positions": model["block_size"], "n_embd": model["n_embd"], "n_layer": model["n_layer"],
                "n_head": model["n_head"], "n_inner": None,
                "activation_function": "gelu" if model.get("activation", "gelu") == "gelu" else "gelu_new",
                "layer_norm_epsilon": model.get("norm_eps", 1e-5), "resid_pdrop": model["dropout"],
                "embd_pdrop": model["dropout"], "attn_pdrop": model["dropout"], "tie_word_embeddings": True,
                "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}
    if kind != "llama":
        raise HFFormatError(f"model.type = {kind!r} has no Hugging Face architecture: export it with --format "
                            f"safetensors (gpt and llama export as Hugging Face models)")
    rope: dict[str, Any] | None = None
    if model["rope_scaling_factor"]:
        rope = {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
                "low_freq_factor": model["rope_low_freq_factor"], "high_freq_factor": model["rope_high_freq_factor"],
                "original_max_position_embeddings": model["rope_original_max_positions"]}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
            "hidden_size": model["n_embd"], "intermediate_size": ffn_hidden, "num_hidden_layers": model["n_layer"],
            "num_attention_heads": model["n_head"], "num_key_value_heads": kv_heads,
            "head_dim": model["n_embd"] // model["n_head"], "hidden_act": "silu",
            "max_position_embeddings": model["block_size"], "rms_norm_eps": model["norm_eps"],
            "rope_theta": model["rope_theta"], "rope_scaling": rope, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": model["dropout"], "tie_word_embeddings": model["tie_embeddings"],
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


# --- tensor names and shapes --------------------------------------------------------------------------------

LLAMA_BLOCK = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"), ("attn.q", "self_attn.q_proj"),
               ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"), ("attn.proj", "self_attn.o_proj"),
               ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))
"""(meshtrain's module in ``blocks.{i}``, ``transformers``' module in ``model.layers.{i}``) of a Llama block."""
GPT2_BLOCK = (("ln_1", "ln_1", False), ("ln_2", "ln_2", False), ("attn.proj", "attn.c_proj", True),
              ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))
"""(meshtrain's module in ``blocks.{i}``, GPT-2's module in ``h.{i}``, whether it is a transposed Conv1D)."""


def sources(model: dict[str, Any], prefix: str = "transformer.") -> dict[str, Source]:
    """{meshtrain parameter name: :class:`Source`} of the model ``model`` (ModelConfig's fields) describes;
    ``prefix`` is what GPT-2's tensor names start with ("transformer." as ``transformers`` saves them, "" in
    the original GPT-2 files). A tied head reads the token embedding."""
    L, C = model["n_layer"], model["n_embd"]
    if model["type"] == "llama":
        out = {"tok_emb.weight": Source("model.embed_tokens.weight"), "norm.weight": Source("model.norm.weight"),
               "lm_head.weight": Source("model.embed_tokens.weight" if model["tie_embeddings"] else "lm_head.weight")}
        for i in range(L):
            out.update({f"blocks.{i}.{ours}.weight": Source(f"model.layers.{i}.{theirs}.weight")
                        for ours, theirs in LLAMA_BLOCK})
        return out
    p = prefix
    out = {"tok_emb.weight": Source(f"{p}wte.weight"), "pos_emb.weight": Source(f"{p}wpe.weight"),
           "lm_head.weight": Source(f"{p}wte.weight"), "norm.weight": Source(f"{p}ln_f.weight")}
    biases = model.get("bias", False)
    if biases:
        out["norm.bias"] = Source(f"{p}ln_f.bias")
    for i in range(L):
        h = f"{p}h.{i}"
        for j, name in enumerate("qkv"):
            out[f"blocks.{i}.attn.{name}.weight"] = Source(f"{h}.attn.c_attn.weight", True, j * C)
            if biases:
                out[f"blocks.{i}.attn.{name}.bias"] = Source(f"{h}.attn.c_attn.bias", False, j * C)
        for ours, theirs, conv in GPT2_BLOCK:
            out[f"blocks.{i}.{ours}.weight"] = Source(f"{h}.{theirs}.weight", conv)
            if biases:
                out[f"blocks.{i}.{ours}.bias"] = Source(f"{h}.{theirs}.bias")
    return out


def hf_shapes(model: dict[str, Any], vocab_size: int, ffn_hidden: int, kv_heads: int,
              prefix: str = "transformer.") -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: shape} every weight of this model has in its checkpoint (GPT-2's ``Conv1D``
    as (in, out); a tied head not listed: ``transformers`` saves it once, as the embedding)."""
    L, C, V = model["n_layer"], model["n_embd"], vocab_size
    if model["type"] == "llama":
        kv = kv_heads * (C // model["n_head"])
        block = {"input_layernorm": (C,), "post_attention_layernorm": (C,), "self_attn.q_proj": (C, C),
                 "self_attn.k_proj": (kv, C), "self_attn.v_proj": (kv, C), "self_attn.o_proj": (C, C),
                 "mlp.gate_proj": (ffn_hidden, C), "mlp.up_proj": (ffn_hidden, C), "mlp.down_proj": (C, ffn_hidden)}
        out = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
        if not model["tie_embeddings"]:
            out["lm_head.weight"] = (V, C)
        for i in range(L):
            out.update({f"model.layers.{i}.{name}.weight": shape for name, shape in block.items()})
        return out
    p = prefix
    out = {f"{p}wte.weight": (V, C), f"{p}wpe.weight": (model["block_size"], C), f"{p}ln_f.weight": (C,),
           f"{p}ln_f.bias": (C,)}
    block = {"ln_1": ((C,), (C,)), "ln_2": ((C,), (C,)), "attn.c_attn": ((C, 3 * C), (3 * C,)),
             "attn.c_proj": ((C, C), (C,)), "mlp.c_fc": ((C, 4 * C), (4 * C,)), "mlp.c_proj": ((4 * C, C), (C,))}
    for i in range(L):
        for name, (weight, bias) in block.items():
            out[f"{p}h.{i}.{name}.weight"], out[f"{p}h.{i}.{name}.bias"] = weight, bias
    return out


# --- safetensors files --------------------------------------------------------------------------------------

def safetensors_header(path: Path) -> dict[str, Any]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file (``__metadata__`` left out).

    Raises:
        HFFormatError: missing file, a header that is not safetensors JSON, or a file shorter than its
            header says (truncated).
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
    end = 8 + n + max((int(t.get("data_offsets", [0, 0])[1]) for t in header.values() if isinstance(t, dict)),
                      default=0)
    if size < end:
        raise HFFormatError(f"weights file '{path}' is truncated: {size} bytes, its header needs {end}; "
                            f"download or copy it again")
    return header


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


def gpt2_prefix(names: set[str] | dict[str, Any]) -> str:
    """"transformer." when GPT-2's tensors carry it (as ``transformers`` saves them), "" otherwise (the
    original GPT-2 files)."""
    return "transformer." if any(n.startswith("transformer.") for n in names) else ""


def check_weights(folder: Path, model: dict[str, Any], vocab_size: int, ffn_hidden: int, kv_heads: int) -> None:
    """Every tensor the model needs is in ``folder``'s safetensors files, with its shape, in a float dtype, in a
    file that is whole. Reads only headers.

    Raises:
        HFFormatError: the first missing file, truncated shard, missing tensor, wrong shape or dtype.
    """
    mapping = weight_map(folder)
    prefix = gpt2_prefix(mapping)
    headers = {file: safetensors_header(folder / file) for file in sorted(set(mapping.values()))}
    for name, shape in hf_shapes(model, vocab_size, ffn_hidden, kv_heads, prefix).items():
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
