"""What every run sets up the same way, synchronous (:mod:`meshtrain.train.loop`) or parameter server
(:mod:`meshtrain.train.async_run`): the corpus and the vocabulary check, the model built whole from
``train.seed``, the compute dtype; and what both write: a checkpoint's meta and the run's summary."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.data.corpus import Corpus, corpus_of
from meshtrain.data.growth import VocabGrowth, vocab_growth
from meshtrain.data.tokenizers import model_vocab_size
from meshtrain.models.build import build_model
from meshtrain.models.base import LayeredLM
from meshtrain.runtime.device import autocast, compute_dtype


@dataclass
class RunSetup:
    """The pieces a rank builds before any parallelism: ``model`` is the whole model on ``device``."""

    corpus: Corpus
    vocab_size: int
    """V: ``model.vocab_size``, or the corpus tokenizer's when it is 0 or ``growth`` grows it (a non-char tokenizer's
    padded up to a multiple of 128 * tp, :func:`meshtrain.data.tokenizers.model_vocab_size`)."""
    model: LayeredLM
    growth: VocabGrowth | None
    """How the vocabulary extends ``model.init_from``'s for the tokens prepare added (:mod:`meshtrain.data.growth`);
    None where it does not."""
    dtype: str
    """What ``train.dtype`` resolves to on this device: "float32" or "bfloat16"."""
    autocast: contextlib.AbstractContextManager
    """The context every forward runs in for ``dtype``."""


def set_up(cfg: Config, device: torch.device) -> RunSetup:
    """Load the corpus, check the vocabulary (grown for ``model.init_from`` by the tokens prepare added), build the
    model from ``train.seed`` on ``device``.

    Raises:
        ConfigError: ``model.vocab_size`` is set below the corpus's vocabulary, or what
            :func:`meshtrain.data.growth.vocab_growth` refuses.
    """
    corpus = corpus_of(cfg)
    tok = corpus.tokenizer
    growth = vocab_growth(cfg, tok.vocab_size, corpus.added_tokens)
    vocab_size = growth.new if growth else model_vocab_size(tok.kind, tok.vocab_size, cfg.model.vocab_size,
                                                            cfg.parallel.tp)
    if vocab_size < corpus.tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size = {vocab_size} is smaller than the corpus vocabulary "
                          f"({corpus.tokenizer.vocab_size}): use 0 or >= that")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, vocab_size).to(device)
    dtype = compute_dtype(cfg.train.dtype, device.type)
    return RunSetup(corpus, vocab_size, model, growth, dtype, autocast(dtype, device.type))


def checkpoint_meta(cfg: Config, run: RunSetup, sampler: dict[str, Any], layout: dict[str, int],
                    global_batch_size: int, **extra: Any) -> dict[str, Any]:
    """``meta.json`` of a checkpoint: the config, the tokenizer and the corpus's SHA-256 (so a resume on
    other data is refused), the sampler's position, ``layout`` (world_size, dp, tp, sp, pp) and the global
    batch it was trained at, plus ``extra`` (the LR schedule's state, the parameter server's counts)."""
    return {"config": cfg.to_dict(), "tokenizer": run.corpus.tokenizer.to_dict(), "corpus_sha256": run.corpus.sha256,
            "vocab_size": run.vocab_size, "sampler": sampler, **extra, **layout,
            "global_batch_size": global_batch_size}


def run_summary(run: RunSetup, val_loss: float | None, step_time_s: float | None, peak_memory_bytes: int,
                layout: dict[str, int], device_type: str, compiled: bool, tokens_per_step: int,
                **extra: Any) -> dict[str, Any]:
    """``OUT/summary.json`` of a run: val loss, median step time (s), peak memory over ranks (bytes), the
    layout but pp (a pipeline reports it in ``extra``, with its bubble), and tokens/s (``tokens_per_step /
    step_time_s``) where a step was timed; plus ``extra``."""
    layout = {axis: degree for axis, degree in layout.items() if axis != "pp"}
    summary = {"val_loss": val_loss, "step_time_s": step_time_s, "peak_memory_bytes": peak_memory_bytes, **layout,
               "vocab_size": run.vocab_size, "device": device_type, "dtype": run.dtype, "compiled": compiled,
               **extra}
    if step_time_s:
        summary["tokens_per_s"] = tokens_per_step / step_time_s
    return summary
