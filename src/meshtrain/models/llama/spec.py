"""The Llama family without torch: its ``[model]`` keys, checks, costs, planner numbers, tensor-parallel names and
Hugging Face ``LlamaForCausalLM`` format (``model.py`` builds it). Qwen2 and Qwen3 reuse these keys and functions
with their own options (``qkv_bias``, ``qk_norm``).

Shape legend: L = n_layer, C = n_embd, nh = n_head, nkv = kv heads, hd = head size, F = MLP width, T = block_size,
V = vocabulary size. Parameters per block (no biases; Qwen2 adds ``(nh + 2*nkv)*hd`` q/k/v biases, Qwen3 two
``hd`` norms)::

    C*nh*hd (q) + 2*C*nkv*hd (k, v) + nh*hd*C (o) + 3*C*F (SwiGLU) + 2*C (RMSNorm scales)
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from meshtrain.errors import require
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family, HFFormat, Source, TPNames
from meshtrain.models.hf_io import Derived, HFFormatError, fraction, number, refuse, with_defaults


@dataclass
class LlamaKeys:
    """The ``[model]`` keys of the Llama family (llama, qwen2, qwen3)."""

    n_kv_head: int = 0
    """llama: key/value heads (grouped-query attention, Ainslie et al. 2023); 0 = ``n_head``; divides ``n_head``."""
    head_dim: int = 0
    """llama: features per attention head; 0 = ``n_embd / n_head``. Qwen3 decouples it (e.g. 128 at n_embd 1024
    with 16 heads); q's width is then ``n_head * head_dim``."""
    ffn_hidden: int = 0
    """llama: SwiGLU hidden size F; 0 = Llama's rule from ``n_embd``, ``multiple_of`` and ``ffn_dim_multiplier``."""
    multiple_of: int = 256
    """llama: the rule's F = 2/3 * 4 * n_embd (times ``ffn_dim_multiplier``) is rounded up to a multiple of this."""
    ffn_dim_multiplier: float = 0.0
    """llama: multiplies the rule's F before rounding (Llama 3 70B: 1.3); 0 = none."""
    rope_theta: float = 10000.0
    """llama: RoPE base (Llama 2: 10000, Llama 3: 500000, Qwen2/Qwen3: 1000000)."""
    rope_scaling_factor: float = 0.0
    """llama: Llama 3.1's RoPE frequency scaling factor (8 for Llama 3.1); 0 = no scaling."""
    rope_low_freq_factor: float = 1.0
    """llama, with ``rope_scaling_factor``: wavelengths above ``rope_original_max_positions / this`` are scaled."""
    rope_high_freq_factor: float = 4.0
    """llama, with ``rope_scaling_factor``: wavelengths below ``rope_original_max_positions / this`` are kept."""
    rope_original_max_positions: int = 8192
    """llama, with ``rope_scaling_factor``: the context length the model was pretrained at."""
    tie_embeddings: bool = False
    """llama: share the token embedding with the output head (small Llamas, e.g. Llama 3.2 1B); the GPT always ties."""


def kv_heads(m: Any) -> int:
    return m.n_kv_head or m.n_head


def head_dim(m: Any) -> int:
    return m.head_dim or m.n_embd // m.n_head


def ffn_hidden(m: Any) -> int:
    """SwiGLU's width F: ``ffn_hidden``, or Llama's rule from ``n_embd``: ``2/3 * 4C`` (SwiGLU's three matrices hold
    as many parameters as a 4C GELU MLP's two, Shazeer 2020, arXiv:2002.05202, Sec. 2), times
    ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of`` (Llama's reference
    ``FeedForward``; Llama 3 8B: C = 4096 -> 14336 with multiplier 1.3 and multiple_of 1024)."""
    if m.ffn_hidden:
        return m.ffn_hidden
    hidden = int(2 * 4 * m.n_embd / 3)
    if m.ffn_dim_multiplier:
        hidden = int(m.ffn_dim_multiplier * hidden)
    return m.multiple_of * math.ceil(hidden / m.multiple_of)


def check(m: Any) -> None:
    """Grouped-query heads, the head size, the MLP width rule, RoPE and its scaling."""
    require(m.n_kv_head >= 0, f"model.n_kv_head = {m.n_kv_head} must be >= 0 (0 = n_head)")
    require(m.n_head % kv_heads(m) == 0, f"model.n_kv_head = {m.n_kv_head} must divide model.n_head = {m.n_head} "
                                         f"(each kv head serves n_head / n_kv_head query heads)")
    require(m.head_dim >= 0, f"model.head_dim = {m.head_dim} must be >= 0 (0 = n_embd / n_head)")
    if m.head_dim:
        require(m.head_dim % 2 == 0, f"model.head_dim = {m.head_dim} must be even: RoPE rotates pairs of features")
    else:
        require(m.n_embd % m.n_head == 0, f"model.n_embd = {m.n_embd} must be divisible by model.n_head = {m.n_head} "
                                          f"(or set model.head_dim)")
        require(head_dim(m) % 2 == 0, f"model.n_embd / model.n_head = {head_dim(m)} (the head size) must be even: "
                                      f"RoPE rotates pairs of features")
    require(m.ffn_hidden >= 0, f"model.ffn_hidden = {m.ffn_hidden} must be >= 0 (0 = Llama's rule)")
    require(m.multiple_of >= 1, f"model.multiple_of = {m.multiple_of} must be >= 1")
    require(m.ffn_dim_multiplier >= 0 and math.isfinite(m.ffn_dim_multiplier),
            f"model.ffn_dim_multiplier = {m.ffn_dim_multiplier} must be a finite number >= 0 (0 = none)")
    require(m.rope_theta > 1 and math.isfinite(m.rope_theta), f"model.rope_theta = {m.rope_theta} must be a finite "
                                                              f"number > 1 (Llama 2: 10000, Llama 3: 500000)")
    require(m.rope_scaling_factor >= 0 and math.isfinite(m.rope_scaling_factor),
            f"model.rope_scaling_factor = {m.rope_scaling_factor} must be a finite number >= 0 (0 = no scaling)")
    require(0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
            f"model.rope_low_freq_factor = {m.rope_low_freq_factor} and model.rope_high_freq_factor = "
            f"{m.rope_high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1 and 4)")
    require(m.rope_original_max_positions >= 1,
            f"model.rope_original_max_positions = {m.rope_original_max_positions} must be >= 1")


def block_params(m: Any, qkv_bias: bool = False, qk_norm: bool = False) -> int:
    """Parameters of one block (the module docstring's sum)."""
    C, hd, q, kv = m.n_embd, head_dim(m), m.n_head * head_dim(m), kv_heads(m) * head_dim(m)
    return 2 * C * q + 2 * C * kv + 3 * C * ffn_hidden(m) + 2 * C + (q + 2 * kv) * qkv_bias + 2 * hd * qk_norm


def layer_costs(m: Any, vocab_size: int, tokens: int, qkv_bias: bool = False,
                qk_norm: bool = False) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step: forward ``2 * matrix params + 4*T*nh*hd`` (the attention's ``Q K^T``
    and ``A V``) per token, x3 with backward (Narayanan et al. 2021, arXiv:2104.04473, Eq. 3); no position
    embedding; an untied head's ``V*C`` update is the head's."""
    C, T, V, opt = m.n_embd, m.block_size, vocab_size, OPTIMIZER_FLOPS_PER_PARAM
    params = block_params(m, qkv_bias, qk_norm)
    matrices = params - 2 * C
    block = 3 * (2 * matrices + 4 * T * m.n_head * head_dim(m)) * tokens + opt * params
    head = 3 * 2 * C * V * tokens + opt * C + (0 if m.tie_embeddings else opt * V * C)
    return opt * V * C, block, head


def planner(m: Any, vocab_size: int, qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Any]:
    """SwiGLU of :func:`ffn_hidden`, grouped-query kv heads, RoPE (no position parameters), RMSNorm scales, the head
    tied only with ``tie_embeddings``."""
    return dict(layers=m.n_layer, hidden=m.n_embd, heads=m.n_head, vocab=vocab_size, seq_len=m.block_size,
                ffn_hidden=ffn_hidden(m), kv_heads=kv_heads(m), head_dim=head_dim(m), activation="swiglu",
                tied_embeddings=m.tie_embeddings, learned_positions=False, dropout=m.dropout > 0,
                qkv_bias=qkv_bias, qk_norm=qk_norm)


# --- Hugging Face LlamaForCausalLM (and its relatives) -------------------------------------------------------

BLOCK = (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"), ("attn.q", "self_attn.q_proj"),
         ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"), ("attn.proj", "self_attn.o_proj"),
         ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"), ("mlp.down", "mlp.down_proj"))
"""(meshtrain's module in ``blocks.{i}``, ``transformers``' module in ``model.layers.{i}``) of a Llama block."""
QKV = (("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"))
QK_NORMS = (("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm"))


HEAD_DIM = Derived(lambda c: c["hidden_size"] // c["num_attention_heads"], "hidden_size // num_attention_heads")
"""``head_dim`` where ``transformers`` derives it (``LlamaConfig.__post_init__``; the attention's ``getattr(config,
"head_dim", ...)`` of the families whose config class has no such key); ``null`` in a file means it too."""
KV_HEADS = Derived(lambda c: c["num_attention_heads"], "num_attention_heads")
"""``num_key_value_heads`` where ``transformers`` derives it (``LlamaConfig.__post_init__``: multi-head attention);
``null`` in a file means it in every family (each ``__post_init__`` that reads it)."""

HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": None,
    "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}
"""``LlamaConfig``'s defaults (``transformers`` 5.24, ``models/llama/configuration_llama.py``) of every key
:func:`read_llama` reads; ``rope_theta`` is ``rope_parameters["rope_theta"]``'s, the class's ``default_theta``
(``modeling_rope_utils.RotaryEmbeddingConfigMixin``: 10000)."""
TRAINING = {"dropout": ("attention_dropout",)}
"""The dropout of the attention weights (meshtrain's Llama has no other), which training may choose."""


def read(hf: dict[str, Any], where: Path, kind: str = "llama") -> dict[str, Any]:
    """``[model]`` keys of a ``LlamaForCausalLM`` (or, with ``kind``, a relative's) ``config.json``, already filled
    with its family's ``transformers`` defaults (:func:`meshtrain.models.hf_io.with_defaults`); the relatives refuse
    their own options in their spec first. RoPE is read as ``transformers`` 5 reads it
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): ``rope_scaling`` (the 4.x spelling) over
    ``rope_parameters``, its ``rope_theta`` over the top-level one; Llama 3.1's ``original_max_position_embeddings``
    defaults to ``max_position_embeddings`` (``standardize_rope_params``), its three factors have no default.

    Raises:
        HFFormatError: an option the model does not build, or a key missing (without a default) or ill-typed.
    """
    heads, embd = number(hf, "num_attention_heads", where, int), number(hf, "hidden_size", where, int)
    refuse(hf, "hidden_act", ("silu",), where, "Llama's SwiGLU")
    spelled = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"  # transformers 4 / 5 spelling
    rope = hf.get(spelled) or {}
    if not isinstance(rope, dict):
        raise HFFormatError(f"'{where}': {spelled} = {rope!r:.60} must be an object (rope_type, factor, ...) or null")
    theta = rope.get("rope_theta", hf["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    dim, kv = hf.get("head_dim"), hf.get("num_key_value_heads")
    keys = {"type": kind, "n_layer": number(hf, "num_hidden_layers", where, int), "n_head": heads, "n_embd": embd,
            "n_kv_head": heads if kv is None else number(hf, "num_key_value_heads", where, int),
            "head_dim": 0 if dim is None or dim == embd // heads else number(hf, "head_dim", where, int),
            "ffn_hidden": number(hf, "intermediate_size", where, int),
            "vocab_size": number(hf, "vocab_size", where, int),
            "norm_eps": float(number(hf, "rms_norm_eps", where, (int, float))),
            "rope_theta": float(number({"rope_theta": theta}, "rope_theta", where, (int, float))),
            "tie_embeddings": bool(hf.get("tie_word_embeddings")), "rope_scaling_factor": 0.0,
            "dropout": fraction(hf, "attention_dropout", where)}
    if rope_type == "llama3":
        for factor in ("factor", "low_freq_factor", "high_freq_factor"):
            if factor not in rope:
                raise HFFormatError(f"'{where}': {spelled} of rope_type 'llama3' has no {factor}, which transformers "
                                    f"has no default for: give factor, low_freq_factor and high_freq_factor "
                                    f"(Llama 3.1: 8, 1, 4)")
        original = rope.get("original_max_position_embeddings", hf["max_position_embeddings"])
        keys.update(rope_scaling_factor=float(number(rope, "factor", where, (int, float))),
                    rope_low_freq_factor=float(number(rope, "low_freq_factor", where, (int, float))),
                    rope_high_freq_factor=float(number(rope, "high_freq_factor", where, (int, float))),
                    rope_original_max_positions=number({"original_max_position_embeddings": original},
                                                       "original_max_position_embeddings", where, int))
    elif rope_type != "default":
        raise HFFormatError(f"'{where}': rope type {rope_type!r} is not supported: meshtrain builds 'default' and "
                            f"'llama3' (Llama 3.1's frequency scaling)")
    return keys


def read_llama(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    hf = with_defaults(hf, HF_DEFAULTS)
    refuse(hf, "attention_bias", (False,), where, "Llama's projections have no biases")
    refuse(hf, "mlp_bias", (False,), where, "Llama's projections have no biases")
    return read(hf, where)


def write(m: Any, vocab_size: int, architecture: str = "LlamaForCausalLM", model_type: str = "llama",
          **extra: Any) -> dict[str, Any]:
    """``config.json`` of ``architecture`` (``extra``: a relative's own keys)."""
    rope: dict[str, Any] | None = None
    if m.rope_scaling_factor:
        rope = {"rope_type": "llama3", "factor": m.rope_scaling_factor, "low_freq_factor": m.rope_low_freq_factor,
                "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_positions}
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
            "hidden_size": m.n_embd, "intermediate_size": ffn_hidden(m), "num_hidden_layers": m.n_layer,
            "num_attention_heads": m.n_head, "num_key_value_heads": kv_heads(m), "head_dim": head_dim(m),
            "hidden_act": "silu", "max_position_embeddings": m.block_size, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "rope_scaling": rope, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": m.dropout, "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None,
            "eos_token_id": None, "torch_dtype": "float32", **extra}


def sources(m: Any, present: Collection[str], qkv_bias: bool = False, qk_norm: bool = False) -> dict[str, Source]:
    """Llama's tensors map one to one (``model.layers.{i}.*``); a tied head reads the embedding."""
    out = {"tok_emb.weight": Source("model.embed_tokens.weight"), "norm.weight": Source("model.norm.weight"),
           "lm_head.weight": Source("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")}
    pairs = [(f"{ours}.{what}", f"{theirs}.{what}") for ours, theirs in BLOCK for what in ("weight",)]
    pairs += [(f"{ours}.bias", f"{theirs}.bias") for ours, theirs in QKV if qkv_bias]
    pairs += [(f"{ours}.weight", f"{theirs}.weight") for ours, theirs in QK_NORMS if qk_norm]
    for i in range(m.n_layer):
        out.update({f"blocks.{i}.{ours}": Source(f"model.layers.{i}.{theirs}") for ours, theirs in pairs})
    return out


def shapes(m: Any, vocab_size: int, present: Collection[str], qkv_bias: bool = False,
           qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    C, F, hd = m.n_embd, ffn_hidden(m), head_dim(m)
    q, kv = m.n_head * hd, kv_heads(m) * hd
    block = {"input_layernorm.weight": (C,), "post_attention_layernorm.weight": (C,),
             "self_attn.q_proj.weight": (q, C), "self_attn.k_proj.weight": (kv, C),
             "self_attn.v_proj.weight": (kv, C), "self_attn.o_proj.weight": (C, q),
             "mlp.gate_proj.weight": (F, C), "mlp.up_proj.weight": (F, C), "mlp.down_proj.weight": (C, F)}
    if qkv_bias:
        block.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if qk_norm:
        block.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    out = {"model.embed_tokens.weight": (vocab_size, C), "model.norm.weight": (C,)}
    if not m.tie_embeddings:
        out["lm_head.weight"] = (vocab_size, C)
    for i in range(m.n_layer):
        out.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
    return out


TP = TPNames(colwise=("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"), rowwise=("attn.proj", "mlp.down"),
             extra_inputs=2)
"""SwiGLU's gate and up projections are column-parallel (each rank holds F/tp hidden units of both, so
``silu(gate) * up`` needs no communication), the down projection row-parallel; k and v give each rank
``n_kv_head/tp`` whole kv heads; RoPE's ``cos, sin`` pass through."""
RESUME_KEYS = ("type", "n_layer", "n_embd")


def family(name: str, summary: str, model: str, hf: HFFormat, qkv_bias: bool = False,
           qk_norm: bool = False) -> Family:
    """A member of the Llama family: these keys and rules, with q/k/v biases (Qwen2) or q/k norms (Qwen3)."""
    tp = TPNames(TP.colwise, TP.rowwise, ("attn.q_norm", "attn.k_norm") if qk_norm else (), TP.extra_inputs)
    return Family(name=name, summary=summary, model=model, keys=LlamaKeys, blocks="attention", check=check,
                  layer_costs=partial(layer_costs, qkv_bias=qkv_bias, qk_norm=qk_norm),
                  resume_keys=RESUME_KEYS, kv_heads=kv_heads, head_dim=head_dim, ffn_hidden=ffn_hidden,
                  planner=partial(planner, qkv_bias=qkv_bias, qk_norm=qk_norm), hf=hf, tp=tp,
                  derived={"n_kv_head": kv_heads, "head_dim": head_dim, "ffn_hidden": ffn_hidden}, qk_clip=not qk_norm)


FAMILY = family("llama", "Llama (RMSNorm, RoPE with Llama 3.1 scaling, SwiGLU, grouped-query attention)",
                "meshtrain.models.llama.model:Llama",
                HFFormat(architectures=("LlamaForCausalLM",), model_type="llama", read=read_llama, write=write,
                         sources=sources, shapes=shapes, defaults=HF_DEFAULTS, training=TRAINING))
