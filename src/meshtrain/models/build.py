"""Building a family's torch module: the one place that imports every family's ``model.py``.

The registry (:mod:`meshtrain.models.registry`) stays torch-free: a family's ``spec.py`` names its class as
``"module:Class"`` (:attr:`meshtrain.models.family.Family.model`). Here each class is a plain import, so readers,
go-to-definition and import greps follow a build from ``model.type`` to the class. Importing this module imports
torch; a new family adds its class to :data:`MODELS`' tuple.
"""

from __future__ import annotations

from typing import Any

from meshtrain.models.base import LayeredLM
from meshtrain.models.deepseek_v2.model import DeepseekV2
from meshtrain.models.deepseek_v3.model import DeepseekV3
from meshtrain.models.glm4_moe.model import Glm4Moe
from meshtrain.models.gpt.model import GPT
from meshtrain.models.llama.model import Llama
from meshtrain.models.mixtral.model import Mixtral
from meshtrain.models.qwen2.model import Qwen2
from meshtrain.models.qwen2_moe.model import Qwen2MoE
from meshtrain.models.qwen3.model import Qwen3
from meshtrain.models.qwen3_moe.model import Qwen3MoE
from meshtrain.models.registry import family
from meshtrain.models.rnn.model import RNNLM

MODELS: dict[str, type[LayeredLM]] = {f"{c.__module__}:{c.__qualname__}": c
                                      for c in (GPT, Llama, Qwen2, Qwen3, Mixtral, Qwen3MoE, Qwen2MoE, DeepseekV3,
                                                Glm4Moe, DeepseekV2, RNNLM)}
"""A family's :attr:`~meshtrain.models.family.Family.model` (``"meshtrain.models.gpt.model:GPT"``) -> its class."""


def build_model(cfg: Any, vocab_size: int) -> LayeredLM:
    """The model of ``cfg.type`` (a :data:`meshtrain.models.registry.ModelConfig`) over ``vocab_size`` token ids, on
    the CPU, its weights drawn from the global torch RNG's next seed (call ``torch.manual_seed`` first)."""
    return MODELS[family(cfg.type).model](cfg, vocab_size)
