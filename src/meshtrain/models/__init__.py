"""Models: decoder-only GPT (``gpt.py``), Llama (``llama.py``) and LSTM/GRU language models (``rnn.py``), one base (``base.py``)."""

from __future__ import annotations

from meshtrain.config import ModelConfig
from meshtrain.models.base import LayeredLM


def build_model(cfg: ModelConfig, vocab_size: int) -> LayeredLM:
    """The model of ``cfg.type`` ("gpt", "llama", "lstm" or "gru") over ``vocab_size`` token ids, on the CPU,
    its weights drawn from the global torch RNG's next seed (call ``torch.manual_seed`` first)."""
    if cfg.type == "gpt":
        from meshtrain.models.gpt import GPT

        return GPT(cfg, vocab_size)
    if cfg.type == "llama":
        from meshtrain.models.llama import Llama

        return Llama(cfg, vocab_size)
    from meshtrain.models.rnn import RNNLM

    return RNNLM(cfg, vocab_size)
