"""The recurrent families (``lstm``, ``gru``) without torch: their ``[model]`` key, checks and pipeline costs
(``model.py`` builds them). They have no tensor-parallel plan, no sequence parallelism, no Hugging Face
architecture and no planner model.

Parameters (PyTorch keeps two bias vectors per gate; g gates: LSTM 4, GRU 3)::

    V*C (tied embedding and head) + n_layer * g * (2*C*C + 2*C)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtrain.errors import require
from meshtrain.models.family import OPTIMIZER_FLOPS_PER_PARAM, Family

GATES = {"lstm": 4, "gru": 3}
"""Gates of a recurrent layer: each has a C x C input and a C x C recurrent matrix and two C biases."""


@dataclass
class RecurrentKeys:
    """The recurrent families' own ``[model]`` key."""

    tbptt_steps: int = 0
    """lstm/gru: backpropagate through at most this many time steps (truncated BPTT); 0 = the whole block_size."""


def check(m: Any) -> None:
    require(m.tbptt_steps >= 0, f"model.tbptt_steps = {m.tbptt_steps} must be >= 0 (0 = the whole block_size)")


def layer_costs(m: Any, vocab_size: int, tokens: int) -> tuple[float, float, float]:
    """(embedding, block, head) FLOPs per step: a block is one recurrent layer, ``g`` gates of two C x C matmuls per
    token, ``2 * 2*g*C**2`` forward FLOPs (x3 with backward), ``g * (2*C**2 + 2*C)`` parameters; no position
    embeddings and no final norm."""
    C, V, opt, g = m.n_embd, vocab_size, OPTIMIZER_FLOPS_PER_PARAM, GATES[m.type]
    return opt * V * C, 3 * 4 * g * C * C * tokens + opt * g * (2 * C * C + 2 * C), 3 * 2 * C * V * tokens


def _family(name: str, cell: str) -> Family:
    return Family(name=name, summary=f"{cell} language model (embedding, {cell} layers, tied head)",
                  model="meshtrain.models.rnn.model:RNNLM", keys=RecurrentKeys, blocks="recurrent", check=check,
                  layer_costs=layer_costs, resume_keys=("type", "n_layer", "n_embd"))


LSTM = _family("lstm", "LSTM")
GRU = _family("gru", "GRU")
