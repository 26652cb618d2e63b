"""Typed run configuration: TOML file + CLI overrides, validated before any process starts.

Sections and keys (``--section.key VALUE`` on the CLI; short flags ``--dp --tp --pp --sp --steps
--seed --out``)::

    [model]      type, n_layer, n_head, n_embd, block_size, dropout, vocab_size, norm_eps, init_from (a Hugging
                 Face model folder), and each family's own keys (models/<family>/spec.py: gpt bias, activation;
                 llama n_kv_head, head_dim, ffn_hidden, rope_*, tie_embeddings, ...; lstm/gru tbptt_steps)
    [data]       path, val_fraction, tokenizer, packing
    [parallel]   dp, tp, pp, sp, zero_stage, fsdp_unit_mb, sp_mode, pp_schedule, virtual_stages, tp_sequence_parallel, sync_mode,
                 local_sgd_steps, local_sgd_warmup, ps_servers, max_staleness, hierarchical_allreduce, stale_policy,
                 diloco_group, diloco_inner_steps, outer_lr, outer_momentum, diloco_fragments, diloco_delay,
                 diloco_alpha, diloco_precision
    [batch]      micro_batch_size, gradient_accumulation_steps
    [optim]      name, lr, min_lr, warmup_steps, weight_decay, grad_clip, beta1, beta2, lr_scaling, reference_batch_size
    [train]      steps, seed, eval_interval, eval_steps, log_interval, dtype, out_dir, check_memory,
                 max_nonfinite_steps, collective_timeout_s, tensorboard, profile_steps
    [checkpoint] interval, keep, resume, allow_batch_change, async_save
    [adapter]    lora_rank, lora_alpha, lora_dropout, lora_targets, use_rslora

Every user mistake raises :class:`ConfigError` (a ``ValueError``) whose one-line message names the
key, the value and what would be valid.
"""

from __future__ import annotations

from meshtrain.config.checks import (MAX_MODEL_SIZE, MAX_SEED, MAX_TIMEOUT_S, diloco_workers, resolve_world,
                                     tokenizer_kind, validate)
from meshtrain.config.load import (SAVED_KEYS, SHORT_FLAGS, apply_init_from, check_saved_config, load_config,
                                   parse_overrides, read_toml, require_regular_file, saved_adapter, set_key)
from meshtrain.config.sections import (AdapterConfig, BUNDLED_CORPUS, COMPILES, COMPUTE_DTYPES, HF_TOKENIZER_FILE, LR_SCALINGS,
                                       PACKINGS, RECOMPUTES, TOKENIZER_KINDS, BatchConfig, CheckpointConfig, Config,
                                       DataConfig, OptimConfig, ParallelConfig, TrainConfig)
from meshtrain.errors import ConfigError
from meshtrain.models.registry import ModelConfig

__all__ = ["AdapterConfig", "BUNDLED_CORPUS", "COMPILES", "COMPUTE_DTYPES", "HF_TOKENIZER_FILE", "LR_SCALINGS", "MAX_MODEL_SIZE",
           "MAX_SEED", "MAX_TIMEOUT_S", "PACKINGS", "RECOMPUTES", "SAVED_KEYS", "SHORT_FLAGS", "TOKENIZER_KINDS",
           "BatchConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "ModelConfig", "OptimConfig",
           "ParallelConfig", "TrainConfig", "apply_init_from", "check_saved_config", "load_config", "parse_overrides",
           "diloco_workers", "read_toml", "require_regular_file", "resolve_world", "saved_adapter", "set_key", "tokenizer_kind", "validate"]
