"""Adapters on a model and off it again: LoRA's adapters (:mod:`meshtrain.adapters.lora`) with QLoRA's NF4 base
(:mod:`meshtrain.adapters.nf4`) when ``adapter.quantize_base`` asks for it, and merged back into plain weights."""

from __future__ import annotations

from torch import nn

from meshtrain.adapters.dora import DoRALinear, add_dora, merge_dora
from meshtrain.adapters.lora import add_adapters, merge_adapters
from meshtrain.adapters.nf4 import dequantize_linear, quantize_linear
from meshtrain.adapters.spec import ALL_LINEAR, targeted_paths


def adapt(model: nn.Module, adapter, model_cfg, quantize: bool = True) -> list[str]:
    """:func:`meshtrain.adapters.lora.add_adapters` on ``model`` (a whole model or a pipeline chunk), DoRA's magnitudes
    with ``adapter.use_dora`` (:func:`meshtrain.adapters.dora.add_dora`), then, with ``adapter.quantize_base = "nf4"`` (and ``quantize``; False on the meta device), every linear map of its blocks
    that LoRA could target stored as NF4, adapted or not (QLoRA); return the adapted modules' names."""
    names = add_adapters(model, adapter, model_cfg)
    if adapter.use_dora:  # DoRA's magnitudes, trained (LoRA's linear modules only: refused on the experts)
        for name in names:
            add_dora(model.get_submodule(name))
    if adapter.quantize_base == "nf4" and quantize:
        for block in model.blocks.values():
            for path in targeted_paths(model_cfg, [ALL_LINEAR]):
                quantize_linear(block.get_submodule(path))
    return names


def merge(model: nn.Module) -> int:
    """An NF4 base dequantized (the weights it trained with), then every adapter folded in (DoRA's by
    :func:`meshtrain.adapters.dora.merge_dora`, the others by :func:`meshtrain.adapters.lora.merge_adapters`); returns
    how many adapters were merged."""
    for module in model.modules():
        if hasattr(module, "nf4_data"):
            dequantize_linear(module)
    doras = [module for module in model.modules() if isinstance(module, DoRALinear)]
    for module in doras:
        merge_dora(module)
    return len(doras) + merge_adapters(model)
