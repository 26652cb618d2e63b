"""The GPT family without torch: its ``[model]`` keys, checks, costs, planner numbers, tensor-parallel names and
Hugging Face ``GPT2LMHeadModel`` format (``model.py`` builds it).

Shape legend: L = n_layer, C = n_embd, T = block_size, V = vocabulary size. Parameters (tied head; b = 1 with
``model.bias``, else 0)::

    N = V*C + T*C + L*(12*C**2 + 2*C + b*11*C) + C + b*C

GPT-2 stores its linear layers as ``Conv1D`` (weight (in, out), the transpose of ``nn.Linear``'s) and fuses q, k
and v into one ``c_attn`` whose output features are ``[q | k | v]``: meshtrain's ``attn.q`` is rows ``0..C`` of
``c_attn.weight``'s transpose, ``attn.k`` rows ``C..2C``, ``attn.v`` rows ``2C..3C``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.errors import require
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family, HFFormat, Source, TPNames
from meshtrain.models.hf_io import Undecided, fraction, number, refuse, with_defaults

ACTIVATIONS = ("gelu", "gelu_tanh")
"""The GPT's MLP activation (``model.activation``): exact (erf) GELU, or its tanh approximation (GPT-2's
``gelu_new``, Hendrycks & Gimpel 2016, arXiv:1606.08415, Sec. 2)."""


@dataclass
class GPTKeys:
    """The GPT's own ``[model]`` keys."""

    bias: bool = False
    """gpt: biases in every Linear but the head (q, k, v, attn.proj, mlp.fc, mlp.proj) and in every LayerNorm,
    as GPT-2 has them (Hugging Face ``GPT2LMHeadModel``); false = none (nanoGPT's bias=False)."""
    activation: str = "gelu"
    """gpt: MLP activation, one of :data:`ACTIVATIONS`: "gelu" (exact, erf) or "gelu_tanh" (GPT-2's ``gelu_new``)."""


def check(m: Any) -> None:
    require(m.n_embd % m.n_head == 0, f"model.n_embd = {m.n_embd} must be divisible by model.n_head = {m.n_head}")
    require(m.activation in ACTIVATIONS,
            f"model.activation = {m.activation!r} is not valid: use one of {', '.join(ACTIVATIONS)}")


def layer_costs(m: Any, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step: a block holds ``12*C**2`` matrix and ``2*C`` LayerNorm-scale
    parameters, plus ``11*C`` with biases; forward ``24*C**2 + 4*T*C`` per token (Narayanan et al. 2021,
    arXiv:2104.04473, Eq. 3, per layer), x3 with backward; the final norm ``C`` (``2*C``). Biases add
    parameters to update, not matmul FLOPs."""
    C, T, V, opt, b = m.n_embd, m.block_size, vocab_size, OPTIMIZER_FLOPS_PER_PARAM, int(m.bias)
    head = 3 * 2 * C * V * tokens  # the tied output matrix is the embedding: its update counted there
    block = 3 * (24 * C * C + 4 * T * C) * tokens + opt * (12 * C * C + 2 * C + b * 11 * C)
    return opt * (V + T) * C, block, head + opt * (1 + b) * C


def planner(m: Any, vocab_size: int) -> dict[str, Any]:
    """GELU MLP of width 4C (exact or tanh alike: two matrices), tied head, learned positions; with ``bias``
    biases in every Linear but the head and LayerNorm shifts (GPT-2), else LayerNorm scales only."""
    return dict(layers=m.n_layer, hidden=m.n_embd, heads=m.n_head, vocab=vocab_size, seq_len=m.block_size,
                biases=m.bias, dropout=m.dropout > 0)


# --- Hugging Face GPT2LMHeadModel ---------------------------------------------------------------------------

BLOCK = (("ln_1", "ln_1", False), ("ln_2", "ln_2", False), ("attn.proj", "attn.c_proj", True),
         ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True))
"""(meshtrain's module in ``blocks.{i}``, GPT-2's module in ``h.{i}``, whether it is a transposed Conv1D)."""


def prefix(present: Collection[str]) -> str:
    """"transformer." when the checkpoint's names carry it (as ``transformers`` saves them, and an export), ""
    in the original GPT-2 files."""
    return "transformer." if not present or any(n.startswith("transformer.") for n in present) else ""


HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False, "tie_word_embeddings": True}
"""``GPT2Config``'s defaults (``transformers`` 5.24, ``models/gpt2/configuration_gpt2.py``) of every key :func:`read`
reads."""
ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
           "num_hidden_layers": "n_layer"}
"""``GPT2Config.attribute_map``."""
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
"""GPT-2's dropouts (after each block's attention and MLP, on the embeddings, on the attention weights): meshtrain's
GPT has one ``model.dropout`` at those three places."""
IGNORED = (r"\.attn\.(masked_)?bias$", r"\.crossattention\.bias$")
"""Buffers of older GPT-2 files (the causal mask) that ``GPT2PreTrainedModel._keys_to_ignore_on_load_unexpected``
drops: no weights."""


def dropout(hf: dict[str, Any], where: Path) -> float | Undecided:
    """GPT-2's three dropouts as meshtrain's one, or :class:`meshtrain.models.hf_io.Undecided` when they differ."""
    values = {key: fraction(hf, key, where) for key in DROPOUTS}
    if len(set(values.values())) == 1:
        return values[DROPOUTS[0]]
    shown = ", ".join(f"{key} = {value:g}" for key, value in values.items())
    return Undecided(f"'{where}' has {shown}, and meshtrain's GPT has one model.dropout for the three")


def read(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS, ALIASES)
    embd = number(hf, "n_embd", where, int)
    refuse(hf, "n_inner", (None, 4 * embd), where, "the GPT's MLP is 4 * n_embd wide")
    refuse(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"), where, "GPT-2's activations")
    refuse(hf, "scale_attn_weights", (True,), where, "attention scores are scaled by 1/sqrt(head size)")
    refuse(hf, "scale_attn_by_inverse_layer_idx", (False,), where, "no per-layer attention scaling")
    refuse(hf, "add_cross_attention", (False,), where, "a decoder without cross-attention")
    refuse(hf, "tie_word_embeddings", (True,), where, "GPT-2 ties its head to the token embedding")
    return {"type": "gpt", "n_layer": number(hf, "n_layer", where, int), "n_head": number(hf, "n_head", where, int),
            "n_embd": embd, "block_size": number(hf, "n_positions", where, int),
            "vocab_size": number(hf, "vocab_size", where, int),
            "norm_eps": float(number(hf, "layer_norm_epsilon", where, (int, float))), "bias": True,
            "activation": "gelu" if hf["activation_function"] == "gelu" else "gelu_tanh",
            "dropout": dropout(hf, where)}


def write(m: Any, vocab_size: int) -> dict[str, Any]:
    """``GPT2LMHeadModel``'s ``config.json`` (a GPT without biases is GPT-2 with zero biases)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_positions": m.block_size, "n_embd": m.n_embd, "n_layer": m.n_layer, "n_head": m.n_head,
            "n_inner": None, "activation_function": "gelu" if m.activation == "gelu" else "gelu_new",
            "layer_norm_epsilon": m.norm_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout, "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
            "torch_dtype": "float32"}


def sources(m: Any, present: Collection[str]) -> dict[str, Source]:
    p, C = prefix(present), m.n_embd
    out = {"tok_emb.weight": Source(f"{p}wte.weight"), "pos_emb.weight": Source(f"{p}wpe.weight"),
           "lm_head.weight": Source(f"{p}wte.weight"), "norm.weight": Source(f"{p}ln_f.weight")}
    if m.bias:
        out["norm.bias"] = Source(f"{p}ln_f.bias")
    for i in range(m.n_layer):
        h = f"{p}h.{i}"
        for j, name in enumerate("qkv"):
            out[f"blocks.{i}.attn.{name}.weight"] = Source(f"{h}.attn.c_attn.weight", True, j * C)
            if m.bias:
                out[f"blocks.{i}.attn.{name}.bias"] = Source(f"{h}.attn.c_attn.bias", False, j * C)
        for ours, theirs, conv in BLOCK:
            out[f"blocks.{i}.{ours}.weight"] = Source(f"{h}.{theirs}.weight", conv)
            if m.bias:
                out[f"blocks.{i}.{ours}.bias"] = Source(f"{h}.{theirs}.bias")
    return out


def shapes(m: Any, vocab_size: int, present: Collection[str]) -> dict[str, tuple[int, ...]]:
    """GPT-2's tensors, ``Conv1D`` weights as (in, out); biases always (a checkpoint of GPT-2 has them)."""
    p, C = prefix(present), m.n_embd
    out = {f"{p}wte.weight": (vocab_size, C), f"{p}wpe.weight": (m.block_size, C), f"{p}ln_f.weight": (C,),
           f"{p}ln_f.bias": (C,)}
    block = {"ln_1": ((C,), (C,)), "ln_2": ((C,), (C,)), "attn.c_attn": ((C, 3 * C), (3 * C,)),
             "attn.c_proj": ((C, C), (C,)), "mlp.c_fc": ((C, 4 * C), (4 * C,)), "mlp.c_proj": ((4 * C, C), (C,))}
    for i in range(m.n_layer):
        for name, (weight, bias) in block.items():
            out[f"{p}h.{i}.{name}.weight"], out[f"{p}h.{i}.{name}.bias"] = weight, bias
    return out


def zeros(m: Any) -> dict[str, tuple[int, ...]]:
    """A GPT without biases exports zero biases: GPT-2 always has them."""
    if m.bias:
        return {}
    return {name: shape for name, shape in shapes(m, 1, ()).items() if name.endswith(".bias")}


FAMILY = Family(
    name="gpt", summary="GPT-2-style decoder (LayerNorm, learned positions, GELU MLP, tied head)",
    model="meshtrain.models.gpt.model:GPT", keys=GPTKeys, blocks="attention", check=check,
    layer_costs=layer_costs,
    resume_keys=("type", "n_layer", "n_embd", "n_head", "block_size", "bias"), planner=planner,
    hf=HFFormat(architectures=("GPT2LMHeadModel",), model_type="gpt2", read=read, write=write, sources=sources,
                shapes=shapes, zeros=zeros, defaults=HF_DEFAULTS, aliases=ALIASES, training={"dropout": DROPOUTS},
                ignored=IGNORED),
    tp=TPNames(colwise=("attn.q", "attn.k", "attn.v", "mlp.fc"), rowwise=("attn.proj", "mlp.proj")))
