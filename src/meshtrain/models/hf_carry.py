"""The ``config.json`` an export of a run writes when the run started from a Hugging Face folder
(``model.init_from``): the source's, key for key, but where the run changed what a key means (issue 58).

The family's reader (:attr:`meshtrain.models.family.HFFormat.read`) judges what a ``config.json`` means, as the
``[model]`` keys it reads (a key the file lacks at its ``transformers`` default), so spellings that say the same
(``gelu_pytorch_tanh`` and ``gelu_new``, a null ``head_dim`` and ``hidden_size // num_attention_heads``) are never
rewritten. Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshtrain.models import hf_io as hf


SPELLINGS = {"torch_dtype": ("dtype",)}
"""A key meshtrain writes -> other names ``transformers`` reads it under (5's ``dtype``), besides the family's
:attr:`meshtrain.models.family.HFFormat.aliases`: an export writes a changed value under the source's name."""
TOGETHER = (("rope_theta", "rope_scaling"), ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
"""Keys meshtrain writes that one ``[model]`` key spans (RoPE's base and scaling, ``transformers`` 5's one
``rope_parameters``; GPT-2's three dropouts, meshtrain's one ``dropout``): changed together or not at all."""
WEIGHTS_DTYPE = "float32"
"""The dtype of every weight an export writes (:func:`meshtrain.models.hf.hf_state_dict`)."""


def _spelled(config: dict[str, Any], key: str, fmt: Any) -> str:
    """The name ``config`` gives ``key`` (meshtrain's spelling): ``key`` itself, an alias of it, or ``key``
    where it has none."""
    names = (key, *SPELLINGS.get(key, ()), *(a for a, k in fmt.aliases.items() if k == key), fmt.aliases.get(key, key))
    return next((name for name in names if name in config), key)


def _set(config: dict[str, Any], values: dict[str, Any], fmt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a copy of ``config`` with ``values`` -- meshtrain's keys -- written in ``config``'s own spelling, {name
    written: its value}). RoPE in a source that spells it ``rope_parameters`` stays ``rope_parameters``."""
    out, written = dict(config), {}
    if "rope_theta" in values and "rope_parameters" in config and "rope_theta" not in config:
        rope = dict(values.get("rope_scaling") or {"rope_type": "default"})
        written["rope_parameters"] = {**rope, "rope_theta": values["rope_theta"]}
        values = {k: v for k, v in values.items() if k not in ("rope_theta", "rope_scaling") or k in config}
    for key, value in values.items():
        written[_spelled(config, key, fmt)] = value
    out.update(written)
    return out, written


def _agreement(got: dict[str, Any], want: dict[str, Any]) -> int:
    """How many ``[model]`` keys of ``want`` ``got`` has the same value for."""
    return sum(got.get(key) == value for key, value in want.items())


def carried_config(written: dict[str, Any], source: dict[str, Any] | None,
                   fmt: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """(the ``config.json`` an export writes, {key: (the source's value, the export's)} of each key it changed).

    Without a source model (``model.init_from``): meshtrain's own, ``written``. With one: the source's, every key as
    it was -- its spelling (``transformers`` 5's ``rope_parameters``, ``dtype``, ``num_local_experts``), its keys
    meshtrain has no use for (a Qwen-MoE's dense ``intermediate_size``, ``output_router_logits``, generation
    options, the BOS/EOS/PAD ids), a key it lacks left out (it keeps meaning ``transformers``' default) -- but where
    the run changed what a key means: the family's reader (:attr:`meshtrain.models.family.HFFormat.read`) is the
    judge, a key of ``written`` replacing the source's (in the source's spelling) only where it brings the model the
    source describes closer to the run's (a training key the run set, :func:`meshtrain.models.registry.
    hf_training_keys`; a RoPE family's ``max_position_embeddings`` is the source's, RoPE having no table to cut); and
    ``dtype`` is float32, the weights'. A source the reader refuses gets meshtrain's keys over it.
    """
    if not source:
        return written, {}
    where = Path("model.init_from's config.json")
    try:
        want, have = fmt.read(written, where), fmt.read(source, where)
    except hf.HFFormatError:
        return {**source, **written}, {}
    out, changes = dict(source), {}
    together = {key: group for group in TOGETHER for key in group}
    done: set[str] = set()
    for key in written:
        group = [k for k in together.get(key, (key,)) if k in written]
        if have == want or key in done:
            continue
        done.update(group)
        trial, values = _set(out, {k: written[k] for k in group}, fmt)
        try:
            got = fmt.read(trial, where)
        except hf.HFFormatError:
            continue
        if _agreement(got, want) > _agreement(have, want):
            changes.update({name: (out.get(name), value) for name, value in values.items()})
            out, have = trial, got
    for name in ("dtype", "torch_dtype"):
        if out.get(name) not in (None, WEIGHTS_DTYPE):
            changes[name] = (out[name], WEIGHTS_DTYPE)
            out[name] = WEIGHTS_DTYPE
    return out, changes
