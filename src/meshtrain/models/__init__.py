"""Models: one folder per family (``gpt/``, ``llama/``, ``rnn/``, ...), each a torch-free ``spec.py`` and a
``model.py``; :mod:`meshtrain.models.registry` lists them and is the only reader of ``model.type``;
:mod:`meshtrain.models.family` is the contract a family fills in. Shared: ``base.py`` (the layered model every
family builds on), ``attention.py`` (the decoders' attention pieces), ``tp_plan.py`` (the tensor-parallel plan),
``hf_io.py`` (Hugging Face files, torch-free) and ``hf.py`` (Hugging Face weights in and out).

This package imports nothing at load time, so torch-free modules (config, the registry) can import from it.
"""

from __future__ import annotations


def build_model(cfg, vocab_size: int):
    """The model of ``cfg.type`` (a :data:`meshtrain.models.registry.ModelConfig`) over ``vocab_size`` token ids, on
    the CPU, its weights drawn from the global torch RNG's next seed (call ``torch.manual_seed`` first).
    Returns a :class:`meshtrain.models.base.LayeredLM`."""
    from meshtrain.models.registry import build_model as build

    return build(cfg, vocab_size)
