"""The model families meshtrain builds, one line each, and the only reader of ``model.type``. No torch.

A family is a folder ``models/<family>/`` whose ``spec.py`` fills in :class:`meshtrain.models.family.Family`;
adding one is that folder, a line in :data:`FAMILIES` and its class in :data:`meshtrain.models.build.MODELS` (the
torch side, which builds the model). Config checks, the planner, the pre-launch checks,
the pipeline split, the tensor-parallel plan and Hugging Face import/export call :func:`family` and use what
it provides. ``[model]`` is one table: :data:`ModelConfig` holds the generic keys (:class:`ModelKeys`) and every
family's own keys; a key of another family than ``model.type``'s must keep its default (:func:`check_model`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError, require
from meshtrain.models.deepseek_v2 import spec as deepseek_v2
from meshtrain.models.deepseek_v3 import spec as deepseek_v3
from meshtrain.models.family import Family
from meshtrain.models.glm4_moe import spec as glm4_moe
from meshtrain.models.gpt import spec as gpt
from meshtrain.models.hf_io import HFFormatError, check_weights, max_positions, with_defaults
from meshtrain.models.llama import spec as llama
from meshtrain.models.mixtral import spec as mixtral
from meshtrain.models.qwen2 import spec as qwen2
from meshtrain.models.qwen2_moe import spec as qwen2_moe
from meshtrain.models.qwen3 import spec as qwen3
from meshtrain.models.qwen3_moe import spec as qwen3_moe
from meshtrain.models.rnn import spec as rnn

FAMILIES: dict[str, Family] = {f.name: f for f in (
    gpt.FAMILY,
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    deepseek_v2.FAMILY,
    rnn.LSTM,
    rnn.GRU,
)}
"""``model.type`` -> its family."""


@dataclass
class ModelKeys:
    """The ``[model]`` keys every family reads."""

    type: str = "gpt"
    """Model family, one of :data:`FAMILIES`: "gpt" (GPT-2-style decoder), "llama" (RMSNorm, RoPE, SwiGLU,
    grouped-query attention), "qwen2", "qwen3", the mixtures of experts "mixtral", "qwen3_moe", "qwen2_moe" and
    "deepseek_v3" (multi-head latent attention), "glm4_moe" (GLM-4.5) and "deepseek_v2",
    "lstm" or "gru" (recurrent); docs/models.md lists them all."""
    n_layer: int = 4
    """Number of blocks: transformer blocks, or recurrent layers."""
    n_head: int = 4
    """Attention (query) heads per block (ignored by lstm/gru)."""
    n_embd: int = 128
    """Hidden size (embedding width)."""
    block_size: int = 64
    """Context length in tokens (the ``seq_len`` of the batch arithmetic)."""
    dropout: float = 0.0
    """Dropout probability in [0, 1)."""
    vocab_size: int = 0
    """Vocabulary size; 0 means "take it from the tokenizer of the corpus" (``data.tokenizer``: char as it is,
    any other kind padded up to a multiple of 128 * tp, :func:`meshtrain.data.tokenizers.model_vocab_size`)."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers (LayerNorm: 1e-5, GPT-2's and ``nn.LayerNorm``'s default; RMSNorm)."""
    init_from: str = ""
    """A local Hugging Face model folder (``config.json`` + safetensors) of an architecture a family imports
    (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...) to start from: its ``config.json`` sets the model keys (a key
    given here that contradicts it is an error) and its weights replace the seed's, under any layout."""

    def family(self) -> Family:
        """This model's family (:func:`family`)."""
        return family(self.type)

    def kv_heads(self) -> int:
        """Key/value heads of the attention (``n_head`` but under grouped-query attention)."""
        return self.family().kv_heads(self)

    def head_size(self) -> int:
        """Features per attention head."""
        return self.family().head_dim(self)

    def ffn_hidden_size(self) -> int:
        """Width of the MLP's hidden layer (the family's rule)."""
        return self.family().ffn_hidden(self)


def _family_keys() -> tuple[type, ...]:
    """Each family's own keys class, once, in registry order."""
    out: list[type] = []
    for f in FAMILIES.values():
        if f.keys is not None and f.keys not in out:
            out.append(f.keys)
    return tuple(out)


# ModelKeys last among the bases: a dataclass collects fields from the most basic class up, so the generic keys come
# first (then each family's, in registry order) in ``asdict`` and a checkpoint's meta.json.
ModelConfig = dataclasses.make_dataclass("ModelConfig", [], bases=(*reversed(_family_keys()), ModelKeys))
ModelConfig.__module__ = __name__
ModelConfig.__doc__ = """The ``[model]`` table: :class:`ModelKeys` and every family's own keys (``models/*/spec.py``)."""



def _key_owners() -> dict[str, tuple[str, ...]]:
    owners: dict[str, list[str]] = {}
    for name, f in FAMILIES.items():
        for key in dataclasses.fields(f.keys) if f.keys is not None else ():
            owners.setdefault(key.name, []).append(name)
    return {key: tuple(names) for key, names in owners.items()}


KEY_OWNERS = _key_owners()
"""A family-specific ``[model]`` key -> the ``model.type`` names whose family reads it."""
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def family(name: str) -> Family:
    """The family of ``model.type = name``.

    Raises:
        ConfigError: no such family (the valid ones listed).
    """
    found = FAMILIES.get(name)
    require(found is not None, f"model.type = {name!r} is not supported: use one of {', '.join(FAMILIES)}")
    return found


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def check_model(m: Any) -> None:
    """The family of ``m.type`` exists, the keys of other families keep their defaults, and the family's own rules
    (:attr:`Family.check`) hold.

    Raises:
        ConfigError: the first broken rule, e.g. "model.bias = true applies to model.type = 'gpt' only: use false
            with model.type = 'llama'".
    """
    own = family(m.type)
    for key, owners in KEY_OWNERS.items():
        if m.type not in owners and getattr(m, key) != DEFAULTS[key]:
            which = " or ".join(repr(o) for o in owners)
            raise ConfigError(f"model.{key} = {_shown(getattr(m, key))} applies to model.type = {which} only: use "
                              f"{_shown(DEFAULTS[key])} with model.type = {m.type!r}")
    own.check(m)


def families_with(predicate: Any) -> list[str]:
    """``model.type`` names of the families for which ``predicate(family)`` holds, e.g. those the planner models."""
    return [name for name, f in FAMILIES.items() if predicate(f)]


def expert_families() -> str:
    """"mixtral and qwen3_moe and qwen2_moe and deepseek_v3 and glm4_moe and deepseek_v2": the families whose MLPs are
    mixtures of experts."""
    return " and ".join(families_with(lambda f: f.experts))


def attention_families() -> str:
    """"gpt and llama and ...": the families with attention blocks, for messages about what only they run."""
    return " and ".join(families_with(lambda f: f.attention))


def hf_format(model_type: str) -> Any:
    """The :class:`meshtrain.models.family.HFFormat` of ``model.type``.

    Raises:
        HFFormatError: a family without a Hugging Face architecture (the message names the families with one).
    """
    fmt = family(model_type).hf
    if fmt is None:
        exporters = " and ".join(families_with(lambda f: f.hf is not None))
        raise HFFormatError(f"model.type = {model_type!r} has no Hugging Face architecture: export it with --format "
                            f"safetensors ({exporters} export as Hugging Face models)")
    return fmt


# --- Hugging Face config.json -> family ---------------------------------------------------------------------

def hf_family(hf: dict[str, Any], where: Path) -> Family:
    """The family building the architecture ``config.json`` (``hf``, read from ``where``) names:
    ``architectures[0]``, else ``model_type``.

    Raises:
        HFFormatError: an architecture no family builds.
    """
    importers = [f for f in FAMILIES.values() if f.hf is not None]
    names = hf.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise HFFormatError(f"'{where}': architectures = {names!r} must be a list of names, e.g. "
                            f"[\"{importers[0].hf.architectures[0]}\"]")
    name = names[0] if names else None
    for f in importers:
        if name in f.hf.architectures or (name is None and hf.get("model_type") == f.hf.model_type):
            return f
    shown = name if name is not None else f"model_type {hf.get('model_type')!r}"
    supported = ", ".join(a for f in importers for a in f.hf.architectures)
    raise HFFormatError(f"'{where}' describes {shown}, which meshtrain does not build: supported are {supported}")


def hf_model_keys(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """meshtrain ``[model]`` keys of the model ``config.json`` describes (its family's :attr:`HFFormat.read`), a key
    the file lacks at its ``transformers`` default (:attr:`HFFormat.defaults`): the architecture, which a checkpoint
    cannot contradict, and the training keys it holds (:func:`hf_training_keys`), which a run may set otherwise.

    Raises:
        HFFormatError: an architecture or option meshtrain does not build, or a missing/ill-typed key.
    """
    return hf_family(hf, where).hf.read(hf, where)


def hf_training_keys(hf: dict[str, Any], where: Path) -> dict[str, tuple[str, ...]]:
    """The ``[model]`` keys of :func:`hf_model_keys` that training may choose (dropout, the load-balancing loss's
    weight) -> the ``config.json`` keys holding them (:attr:`HFFormat.training`)."""
    return hf_family(hf, where).hf.training


def hf_max_positions(hf: dict[str, Any], where: Path) -> int | None:
    """The longest context the model of ``config.json`` was built for (``max_position_embeddings`` or ``n_positions``,
    its family's ``transformers`` default where the file lacks it), None when not an integer."""
    fmt = hf_family(hf, where).hf
    return max_positions(with_defaults(hf, fmt.defaults, fmt.aliases))


def check_hf_weights(folder: Path, m: Any) -> None:
    """Every tensor of the model ``m`` (a ModelConfig, its ``vocab_size`` set) is in the Hugging Face folder's
    safetensors files with the shape its family gives (:func:`meshtrain.models.hf_io.check_weights`, headers only).

    Raises:
        HFFormatError: the first missing file or tensor, a truncated shard, a wrong shape or dtype, a tensor the
            model has no place for (:func:`meshtrain.models.hf_io.check_weights`), or a family without a Hugging
            Face format.
    """
    fmt = hf_format(m.type)
    sources = fmt.sources(m, ())
    tied = sources["lm_head.weight"].name == sources["tok_emb.weight"].name

    def spare(name: str) -> bool:  # a tied head saved anyway (transformers ties it), or a buffer it drops
        return (tied and name == "lm_head.weight") or any(re.search(p, name) for p in fmt.ignored)

    check_weights(folder, lambda present: fmt.shapes(m, m.vocab_size, present), spare)
