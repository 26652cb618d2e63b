"""Typed run configuration: TOML file + CLI overrides, validated before any process starts.

Sections and keys (``--section.key VALUE`` on the CLI; short flags ``--dp --tp --pp --sp --ep --steps
--seed --out``)::

    [model]      type, n_layer, n_head, n_embd, block_size, dropout, vocab_size, norm_eps, init_from (a Hugging
                 Face model folder), and each family's own keys (models/<family>/spec.py: gpt bias, activation;
                 llama, qwen2, qwen3 and the mixtures of experts n_kv_head, head_dim, ffn_hidden, rope_*,
                 tie_embeddings, ...; mixtral, qwen3_moe and qwen2_moe also num_experts, num_experts_per_tok,
                 router_*, moe_compute, shared_expert_ffn, ...; lstm/gru tbptt_steps)
    [data]       path, val_fraction, tokenizer, packing
    [parallel]   dp, tp, pp, sp, ep, zero_stage, fsdp_unit_mb, sp_mode, sp_ulysses, pp_schedule, virtual_stages,
                 tp_sequence_parallel, sync_mode, hierarchical_allreduce
    [local_sgd]  steps, warmup                                     (sync_mode = "local-sgd")
    [parameter_server]  servers, max_staleness, stale_policy       (sync_mode = "async")
    [diloco]     group, inner_steps, outer_lr, outer_momentum, fragments, delay, alpha, precision, lighthouse,
                 worker, workers                                   (sync_mode = "diloco")
    [batch]      micro_batch_size, gradient_accumulation_steps
    [optim]      name, lr, min_lr, warmup_steps, weight_decay, grad_clip, beta1, beta2, lr_scaling,
                 reference_batch_size, fused
    [train]      steps, seed, eval_interval, eval_steps, log_interval, dtype, out_dir, compile, recompute, check_memory,
                 max_nonfinite_steps, collective_timeout_s, tensorboard, objective, dpo_beta, dpo_loss,
                 dpo_label_smoothing, dpo_reference, profile_steps
    [checkpoint] interval, keep, resume, allow_batch_change, async_save
    [adapter]    lora_rank, lora_alpha, lora_dropout, lora_targets, use_rslora, use_dora, modules_to_save, quantize_base

Every user mistake raises :class:`meshtrain.errors.ConfigError` (a ``ValueError``) whose one-line message names
the key, the value and what would be valid.

Modules, each imported by name (this package imports nothing): :mod:`meshtrain.config.sections` (one dataclass per
section, :class:`~meshtrain.config.sections.Config`), :mod:`meshtrain.config.checks` (the generic checks,
:func:`~meshtrain.config.checks.validate`, :func:`~meshtrain.config.checks.resolve_world`) and
:mod:`meshtrain.config.load` (TOML and command line: :func:`~meshtrain.config.load.load_config`,
:func:`~meshtrain.config.load.set_key`, a checkpoint's saved config). ``[model]`` is
:data:`meshtrain.models.registry.ModelConfig`.
"""
