"""The modules a LoRA run trains in full beside its adapters: peft's ``modules_to_save`` (``adapter.modules_to_save``),
the token embedding and the output head, by their Hugging Face names, and the names a peft adapter file gives them.
Torch-free: config validation and the vocabulary growth check (:mod:`meshtrain.data.growth`) read it before any
process starts.

peft wraps each such module in a ``ModulesToSaveWrapper`` that trains a copy of it beside the frozen original;
meshtrain trains the module itself (the original is read again from the base's folder whenever it is needed). A tied head is the embedding (Press & Wolf 2017, "Using the Output Embedding to Improve
Language Models", arXiv:1608.05859): one matrix trains, as with peft's ``ensure_weight_tying``.
"""

from __future__ import annotations

from typing import Any

from meshtrain.errors import require

HEAD = "lm_head"
"""The output head's module name in every causal language model ``transformers`` builds (``*ForCausalLM.lm_head``)."""
SAVED_MODULES = ("tok_emb", "lm_head")
"""meshtrain's modules ``adapter.modules_to_save`` may name: the token embedding and the output head
(:class:`meshtrain.models.base.LayeredLM`)."""


def savable_modules(m: Any) -> dict[str, tuple[str, str]]:
    """``{peft name: (meshtrain module, Hugging Face module path)}`` of the modules of ``m`` (a ``ModelConfig``) that
    ``adapter.modules_to_save`` may name (peft's ``modules_to_save``: trained in full beside the adapters): the token
    embedding by the last component of its Hugging Face name (Llama's ``model.embed_tokens`` -> ``embed_tokens``) and
    the head (``lm_head``); empty for a family without a Hugging Face format."""
    from meshtrain.models.registry import family

    fmt = family(m.type).hf
    if fmt is None:
        return {}
    embedding = fmt.sources(m, ())["tok_emb.weight"].name.removesuffix(".weight")
    return {embedding.rsplit(".", 1)[-1]: ("tok_emb", embedding), HEAD: ("lm_head", HEAD)}


def tied_embeddings(m: Any) -> bool:
    """Whether the head of ``m`` (a ``ModelConfig``) reads the embedding's tensor (one matrix, Press & Wolf 2017): then
    naming either in ``adapter.modules_to_save`` trains that one matrix, as peft's ``ensure_weight_tying`` does."""
    from meshtrain.models.registry import family

    sources = family(m.type).hf.sources(m, ())
    return sources["lm_head.weight"].name == sources["tok_emb.weight"].name


def saved_modules(m: Any, names: list[str]) -> tuple[str, ...]:
    """meshtrain's modules (of :data:`SAVED_MODULES`) that ``adapter.modules_to_save`` ``names`` train in full.

    Raises:
        ConfigError: a name that is not the embedding's or the head's (:func:`savable_modules`)."""
    valid = savable_modules(m)
    for name in names:
        require(name in valid, f"adapter.modules_to_save names {name!r}, which model.type = {m.type!r} cannot train "
                               f"beside adapters; valid: {', '.join(valid) or 'none'}")
    return tuple(ours for name, (ours, _) in valid.items() if name in names)


def saved_peft_names(m: Any, names: list[str]) -> dict[str, str]:
    """``{meshtrain parameter: peft's name in a saved adapter}`` of the modules ``names`` (``adapter.modules_to_save``)
    trains: ``tok_emb.weight`` -> ``base_model.model.model.embed_tokens.weight``, ``lm_head.weight`` ->
    ``base_model.model.lm_head.weight``, as ``get_peft_model_state_dict`` writes a ``ModulesToSaveWrapper``'s copy
    (its ``modules_to_save.default.`` segment dropped). A tied pair is written under both names, as peft does with
    ``ensure_weight_tying``."""
    valid = savable_modules(m)
    chosen = set(names) if not tied_embeddings(m) or not names else set(valid)
    return {f"{ours}.weight": f"base_model.model.{theirs}.weight" for name, (ours, theirs) in valid.items()
            if name in chosen}
