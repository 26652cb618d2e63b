"""The generic checks of a config (:func:`validate`: every value and cross-field rule that needs no process group;
a family checks its own keys, :func:`meshtrain.models.registry.check_model`) and the layout against the ranks
(:func:`resolve_world`). Torch-free."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from meshtrain import axes
from meshtrain.axes import (OUTER_PRECISIONS, REPLICA_AXES, STALE_POLICIES, SYNC_MODE_SECTIONS, SYNC_MODES,
                            degree_errors)
from meshtrain.config.sections import (COMPILES, COMPUTE_DTYPES, DPO_LOSSES, DPO_REFERENCES, HF_TOKENIZER_FILE,
                                       LR_SCALINGS, MUON_EXCHANGES, MUON_LR_ADJUSTS, MUON_NS_DTYPES, OBJECTIVES,
                                       OPTIMIZERS, PACKINGS, RECOMPUTES, Config)
from meshtrain.adapters.spec import check_adapter
from meshtrain.errors import ConfigError
from meshtrain.errors import require as _require
from meshtrain.models.registry import attention_families, check_model, family
from meshtrain.paths import path_problem
from meshtrain.rules.layout import layout_errors, shape_of
from meshtrain.rules.pipeline import pipeline_error
from meshtrain.rules.support import compile_error, recompute_error

MAX_SEED = 2**32 - 1
"""Largest ``train.seed``: per-step seeds ``(seed * 1_000_003 + step) * 1_009 + rank`` stay below torch's 2**64."""
MAX_TIMEOUT_S = 1e9
"""Largest ``train.collective_timeout_s``: torch keeps the timeout in C++ milliseconds (1e308 s overflowed a rank)."""
MAX_MODEL_SIZE = {"n_layer": 2**20, "n_head": 2**20, "n_embd": 2**24, "block_size": 2**31 - 1, "vocab_size": 2**31 - 1}
"""Upper bounds of the model's sizes, each far past any model: the planner and the model hold per-layer lists and
int32-indexed tables (a plan of 2**63 layers overflowed; 2**40 would fill the memory)."""
MAX_MODEL_SIZE_WHY = {"n_layer": "blocks are built and planned one by one", "n_head": "far past any model",
                      "n_embd": "far past any model", "block_size": "an int32 position"}


def tokenizer_kind(spec: str) -> str:
    """The kind of tokenizer ``data.tokenizer = spec`` names, from the path alone (no library loaded):
    "char"; "hf" for a ``*.json`` file or a folder holding ``tokenizer.json``; "tiktoken" for a ``*.tiktoken``
    file, or a ``*.model`` whose first line is a tiktoken rank line (``<base64> <rank>``, as Meta's Llama 3
    ``original/tokenizer.model``); "sentencepiece" for any other ``*.model``.

    Raises:
        ConfigError: a path that does not exist, a folder without ``tokenizer.json``, or another suffix.
    """
    if spec == "char":
        return "char"
    valid = ("valid are 'char', a Hugging Face tokenizer.json or model folder, a *.tiktoken file or a "
             "sentencepiece *.model")
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / HF_TOKENIZER_FILE).is_file():
            return "hf"
        raise ConfigError(f"data.tokenizer = '{spec}' is a folder without {HF_TOKENIZER_FILE}: {valid}")
    problem = path_problem(path)
    if problem:
        raise ConfigError(f"data.tokenizer = '{spec}' {problem}: {valid}")
    if path.suffix == ".json":
        return "hf"
    if path.suffix == ".tiktoken":
        return "tiktoken"
    if path.suffix == ".model":
        with open(path, "rb") as f:
            head = f.read(256).split(b"\n", 1)[0].split(b" ")  # a protobuf (sentencepiece) has no such line
        tiktoken_line = len(head) == 2 and head[1].strip().isdigit() and _is_base64(head[0])
        return "tiktoken" if tiktoken_line else "sentencepiece"
    raise ConfigError(f"data.tokenizer = '{spec}' has suffix {path.suffix!r}, which names no tokenizer kind: {valid}")


def _is_base64(token: bytes) -> bool:
    """Whether ``token`` is non-empty standard base64 (tiktoken's token column)."""
    import base64
    import binascii

    try:
        return bool(token) and bool(base64.b64decode(token, validate=True))
    except (binascii.Error, ValueError):
        return False


def validate(cfg: Config, schedule: bool = True) -> Config:
    """Check every value and cross-field rule that needs no process group; return ``cfg``. Sections are checked
    in order (model, data, layout, optim, train, checkpoint), so the first violated rule is the one reported.
    ``schedule=False`` leaves out the pipeline schedule's rules on the micro-batch split (``--layout auto`` chooses
    the split of the global batch itself, then validates the whole config).

    Raises:
        ConfigError: the first violated rule, naming the key, the value and what is valid.
    """
    _validate_model(cfg)
    _validate_data(cfg)
    _validate_layout(cfg, schedule)
    _validate_optim(cfg)
    _validate_train(cfg)
    check_adapter(cfg)
    c = cfg.checkpoint
    _require(c.interval >= 0, f"checkpoint.interval = {c.interval} must be >= 0 (0 = only at the last step)")
    _require(c.keep >= 1, f"checkpoint.keep = {c.keep} must be >= 1")
    if cfg.elastic:  # elastic workers save at outer steps only
        H = cfg.diloco.inner_steps
        for key, value in (("checkpoint.interval", c.interval), ("train.steps", cfg.train.steps)):
            _require(value % H == 0, f"{key} = {value} is not a multiple of diloco.inner_steps = {H}: "
                                     f"elastic workers end and save at outer steps; use a multiple of {H}")
    _require(not c.async_save or cfg.parallel.sync_mode != "async",
             "checkpoint.async_save = true needs a synchronous parallel.sync_mode: the parameter server (sync_mode "
             "= 'async') saves from inside its gradient handling, with no step the ranks share; use false")
    return cfg


def _validate_model(cfg: Config) -> None:
    """The generic ``[model]`` keys' ranges, then the family's own checks (:func:`check_model`)."""
    m = cfg.model
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        _require(getattr(m, key) >= 1, f"model.{key} = {getattr(m, key)} must be >= 1")
        _require(getattr(m, key) <= MAX_MODEL_SIZE[key], f"model.{key} = {getattr(m, key)} must be at most "
                                                         f"{MAX_MODEL_SIZE[key]:,} ({MAX_MODEL_SIZE_WHY[key]})")
    if family(m.type).attention:
        _require(0 < m.norm_eps < 1, f"model.norm_eps = {m.norm_eps} must be in (0, 1)")
    check_model(m)
    _require(0.0 <= m.dropout < 1.0, f"model.dropout = {m.dropout} must be in [0, 1)")
    _require(m.vocab_size >= 0, f"model.vocab_size = {m.vocab_size} must be >= 0 (0 = from the tokenizer)")
    _require(m.vocab_size <= MAX_MODEL_SIZE["vocab_size"], f"model.vocab_size = {m.vocab_size} must be at most "
                                                           f"{MAX_MODEL_SIZE['vocab_size']:,} (an int32 token id)")


def _validate_data(cfg: Config) -> None:
    """``data.path`` is readable, ``val_fraction`` in (0, 1), ``data.tokenizer`` names a kind."""
    d = cfg.data
    path = d.resolved_path()
    problem = None if path.is_dir() else path_problem(path)
    _require(problem != "does not exist", f"data.path = {d.path!r} does not exist: give a UTF-8 text file, a "
                                          f"folder meshtrain prepare wrote, or leave it empty")
    _require(problem is None, f"data.path = {d.path!r} {problem}: give a UTF-8 text file or a folder meshtrain "
                              f"prepare wrote")
    _require(0.0 < d.val_fraction < 1.0, f"data.val_fraction = {d.val_fraction} must be in (0, 1)")
    tokenizer_kind(d.tokenizer)


def _validate_layout(cfg: Config, schedule: bool = True) -> None:
    """The degrees (:func:`meshtrain.axes.degree_errors`), the batch split, what the trainer runs, what the
    model's shapes allow (:func:`meshtrain.rules.layout.layout_errors`, the planner's rule book too), packing and the
    sync mode."""
    p, b = cfg.parallel, cfg.batch
    if errors := degree_errors(p, "parallel."):
        raise ConfigError(errors[0])
    _require(b.micro_batch_size >= 1, f"batch.micro_batch_size = {b.micro_batch_size} must be >= 1")
    _require(b.gradient_accumulation_steps >= 1,
             f"batch.gradient_accumulation_steps = {b.gradient_accumulation_steps} must be >= 1")
    _validate_support(cfg, schedule)
    if errors := layout_errors(shape_of(cfg), p, p.dp, p.sync_mode):
        raise ConfigError(errors[0])
    _validate_packing(cfg)
    _validate_objective(cfg)
    _validate_sync_mode(cfg)
    _validate_mtp(cfg)
    _validate_seq_aux_loss(cfg)
    _validate_tp_widths(cfg)


def _validate_seq_aux_loss(cfg: Config) -> None:
    """DeepSeek-V3's sequence-wise balance loss (``model.seq_aux_loss_alpha``) counts each sequence's tokens per
    expert in one forward: the whole sequence on one rank, sp = 1."""
    alpha, sp = cfg.model.seq_aux_loss_alpha, cfg.parallel.sp
    _require(not alpha or sp == 1, f"model.seq_aux_loss_alpha = {alpha} (the sequence-wise balance loss) is not "
                                   f"supported with parallel.sp = {sp}: it counts each sequence's tokens on one rank; "
                                   f"use parallel.sp = 1 or model.seq_aux_loss_alpha = 0")


def _validate_tp_widths(cfg: Config) -> None:
    """tp gives each rank an equal slice of each width the family splits beyond the heads and the dense MLP
    (:attr:`meshtrain.models.family.Family.tp_widths`: DeepSeek-V3's dense layers and shared experts)."""
    tp = cfg.parallel.tp
    for what, width in family(cfg.model.type).tp_widths(cfg.model).items() if tp > 1 else ():
        _require(width % tp == 0, f"{what} = {width} is not divisible by parallel.tp = {tp}: tensor parallelism gives "
                                  f"each tp rank an equal slice of it; use a tp that divides {width}")


def _validate_mtp(cfg: Config) -> None:
    """Multi-token prediction (``model.num_nextn_predict_layers``, DeepSeek-V3) takes the main model's whole, replicated
    hidden state (not tp's sequence-parallel shards) and each window's tokens shifted within it, in the language-model
    objective of the synchronous trainer: dp, FSDP2, tp, sp, ep and pp (every schedule; the modules on the last stage,
    :mod:`meshtrain.models.deepseek_v3.mtp`), not ``tp_sequence_parallel`` nor document packing."""
    m, p = cfg.model, cfg.parallel
    if not m.num_nextn_predict_layers:
        return
    d, t = cfg.data, cfg.train
    checks = (("parallel.tp_sequence_parallel", p.tp_sequence_parallel, not p.tp_sequence_parallel),
              ("data.packing", d.packing, d.packing != "document"),
              ("train.objective", t.objective, t.objective == "lm"),
              ("parallel.sync_mode", p.sync_mode, p.sync_mode != "async"))
    blocked = [f"{key} = {value!r}" for key, value, ok in checks if not ok]
    _require(not blocked, f"model.num_nextn_predict_layers = {m.num_nextn_predict_layers} (multi-token prediction) is "
                          f"not supported with {', '.join(blocked)}: it needs tp_sequence_parallel = false (dp, FSDP2, "
                          f"tp, sp, ep and pp work), train.objective = 'lm', data.packing other than 'document' and a "
                          f"synchronous sync_mode (or model.num_nextn_predict_layers = 0)")


def _validate_optim(cfg: Config) -> None:
    """AdamW's and the schedule's values, and the learning-rate scaling rule."""
    o = cfg.optim
    _require(o.name in OPTIMIZERS, f"optim.name = {o.name!r} is not valid: use one of {', '.join(OPTIMIZERS)}")
    _require(o.lr > 0, f"optim.lr = {o.lr} must be > 0")
    _require(0 <= o.min_lr <= o.lr, f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps = {o.warmup_steps} must be >= 0")
    _require(o.weight_decay >= 0, f"optim.weight_decay = {o.weight_decay} must be >= 0")
    _require(o.grad_clip >= 0, f"optim.grad_clip = {o.grad_clip} must be >= 0 (0 disables clipping)")
    for key in ("beta1", "beta2"):
        _require(0 <= getattr(o, key) < 1, f"optim.{key} = {getattr(o, key)} must be in [0, 1)")
    _require(o.lr_scaling in LR_SCALINGS,
             f"optim.lr_scaling = {o.lr_scaling!r} is not valid: use one of {', '.join(LR_SCALINGS)}")
    _require(o.reference_batch_size >= 0, f"optim.reference_batch_size = {o.reference_batch_size} must be >= 0")
    _require(o.lr_scaling == "none" or o.reference_batch_size >= 1,
             f"optim.lr_scaling = {o.lr_scaling!r} needs optim.reference_batch_size >= 1: the global batch "
             f"optim.lr was tuned at")
    _validate_muon(o)
    _validate_qk_clip(cfg)


def _validate_qk_clip(cfg: Config) -> None:
    """``optim.qk_clip``: >= 0; when on, attention whose logits it can scale, seen whole by each rank."""
    o, p = cfg.optim, cfg.parallel
    _require(o.qk_clip >= 0, f"optim.qk_clip = {o.qk_clip} must be >= 0 (0 = off; Kimi K2 used 100)")
    if not o.qk_clip:
        return
    fam = family(cfg.model.type)
    _require(fam.attention and fam.qk_clip,
             f"optim.qk_clip = {o.qk_clip} needs attention with per-head q and k projections to scale, which model.type"
             f" = {cfg.model.type!r} {'does not have (q/k normalised, or latent)' if fam.attention else 'has not'}: "
             f"use optim.qk_clip = 0")
    _require(p.sp == 1, f"optim.qk_clip = {o.qk_clip} observes whole sequences and parallel.sp = {p.sp} splits them: "
                        f"use parallel.sp = 1 (or optim.qk_clip = 0)")
    _require(p.sync_mode != "async", "optim.qk_clip needs a step every rank shares, which parallel.sync_mode = 'async' "
                                     "has not: use optim.qk_clip = 0")


def _validate_muon(o) -> None:
    """Muon's keys (:class:`meshtrain.config.sections.OptimConfig`), checked whatever ``optim.name`` is."""
    _require(0 <= o.muon_momentum < 1, f"optim.muon_momentum = {o.muon_momentum} must be in [0, 1)")
    _require(1 <= o.muon_ns_steps < 100, f"optim.muon_ns_steps = {o.muon_ns_steps} must be in [1, 99] (5 as published)")
    _require(o.muon_adamw_lr >= 0, f"optim.muon_adamw_lr = {o.muon_adamw_lr} must be >= 0 (0 = optim.lr)")
    for key, valid in (("muon_ns_dtype", MUON_NS_DTYPES), ("muon_lr_adjust", MUON_LR_ADJUSTS),
                       ("muon_exchange", MUON_EXCHANGES)):
        _require(getattr(o, key) in valid, f"optim.{key} = {getattr(o, key)!r} is not valid: use one of {', '.join(valid)}")


def _validate_train(cfg: Config) -> None:
    """``[train]``: steps, seed, intervals, dtype, compile and recompute (with what they cannot run with),
    timeouts, and the observability keys."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _require(t.steps >= 1, f"train.steps = {t.steps} must be >= 1")
    _require(0 <= t.seed <= MAX_SEED, f"train.seed = {t.seed} must be in [0, {MAX_SEED}] (2**32 - 1: numpy's "
                                      f"and torch's generators are seeded from it per step and rank)")
    _require(t.eval_interval >= 0, f"train.eval_interval = {t.eval_interval} must be >= 0 (0 = only at the end)")
    _require(t.eval_steps >= 1, f"train.eval_steps = {t.eval_steps} must be >= 1")
    _require(t.log_interval >= 1, f"train.log_interval = {t.log_interval} must be >= 1")
    _require(t.dtype in COMPUTE_DTYPES, f"train.dtype = {t.dtype!r} is not valid: use one of {', '.join(COMPUTE_DTYPES)}")
    _require(t.compile in COMPILES, f"train.compile = {t.compile!r} is not valid: use one of {', '.join(COMPILES)}")
    why = compile_error(m.type, p.sync_mode) if t.compile == "on" else ""
    _require(not why, f"train.compile = \"on\" cannot run here: {why}; use \"auto\" or \"off\"")
    _require(math.isfinite(t.loss_chunk_mb) and t.loss_chunk_mb >= 0, f"train.loss_chunk_mb = {t.loss_chunk_mb} is not "
             f"valid: use 0 (the whole loss at once) or a positive number of MiB (default 64)")
    _require(t.recompute in RECOMPUTES,
             f"train.recompute = {t.recompute!r} is not valid: use one of {', '.join(RECOMPUTES)}")
    why = recompute_error(t.recompute, m.type, p.pp, p.pp_schedule, p.sync_mode)
    _require(not why, why)
    _require(bool(t.out_dir), "train.out_dir is empty: give a folder for the run's outputs")
    _require(t.collective_timeout_s > 0, f"train.collective_timeout_s = {t.collective_timeout_s} must be > 0 (seconds)")
    _require(t.collective_timeout_s <= MAX_TIMEOUT_S, f"train.collective_timeout_s = {t.collective_timeout_s} must be "
                                                      f"at most {MAX_TIMEOUT_S:g} seconds (31 years)")
    _require(t.max_nonfinite_steps >= 1, f"train.max_nonfinite_steps = {t.max_nonfinite_steps} must be >= 1")
    _validate_observability(cfg)


def _validate_observability(cfg: Config) -> None:
    """``train.profile_steps`` is off or a step range of the run; ``train.tensorboard`` needs its package
    (found without importing it, so this stays torch-free)."""
    import importlib.util

    t = cfg.train
    if t.profile_steps:
        _require(len(t.profile_steps) == 2, f"train.profile_steps = {t.profile_steps} must be two steps [first, last] "
                                            f"or empty (off)")
        a, b = t.profile_steps
        _require(1 <= a <= b <= t.steps, f"train.profile_steps = {t.profile_steps} must satisfy 1 <= first <= last "
                                         f"<= train.steps = {t.steps}")
        _require(cfg.parallel.sync_mode != "async", "train.profile_steps needs a step every rank shares, which "
                                                    "parallel.sync_mode = 'async' has not: use [] (off)")
    _require(not t.tensorboard or importlib.util.find_spec("tensorboard") is not None,
             "train.tensorboard = true needs the tensorboard package: pip install 'meshtrain[tb]', or use false")


def _validate_support(cfg: Config, schedule: bool = True) -> None:
    """Reject what the trainer cannot run (the table in :mod:`meshtrain.rules.support`)."""
    from meshtrain.rules.support import SUPPORTED as S, zero_stage_error

    p = cfg.parallel
    zeros = ", ".join(map(str, S.zero_stages))
    _require(p.zero_stage in S.zero_stages, f"parallel.zero_stage = {p.zero_stage} is not supported: use one of {zeros}")
    _require(not (S.zero1_ddp_only and zero_stage_error(p.zero_stage, p.tp, p.pp)),
             f"parallel.{zero_stage_error(p.zero_stage, p.tp, p.pp)}")
    _require(p.fsdp_unit_mb >= 0, f"parallel.fsdp_unit_mb = {p.fsdp_unit_mb} must be >= 0 (0 = one FSDP2 unit per block)")
    _require(S.tp or p.tp == 1, f"parallel.tp = {p.tp} is not supported yet: use 1")
    _require(S.sp_modes or p.sp == 1, f"parallel.sp = {p.sp} is not supported yet: use 1")
    _require(p.sp_mode in S.sp_modes + ("ulysses",),
             f"parallel.sp_mode = {p.sp_mode!r} is not valid: use one of {', '.join(S.sp_modes)}")
    _require(p.pp_schedule in S.pp_schedules,
             f"parallel.pp_schedule = {p.pp_schedule!r} is not valid: use one of {', '.join(S.pp_schedules)}")
    _require(p.virtual_stages >= 1, f"parallel.virtual_stages = {p.virtual_stages} must be >= 1")
    if schedule:  # dp = -1: resolve_world checks again with the ranks' dp
        error = pipeline_error(p.pp_schedule, p.pp, p.virtual_stages, cfg.batch.gradient_accumulation_steps,
                               cfg.model.n_layer, max(p.dp, 1) * p.sp, p.zero_stage)
        _require(error is None, error or "")
    _require(not p.tp_sequence_parallel or S.tp_sequence_parallel,
             "parallel.tp_sequence_parallel = true is not supported yet: use false")
    _require(p.sp == 1 or cfg.model.dropout == 0 or p.sp_mode in S.attention_dropout_sp_modes,
             f"model.dropout = {cfg.model.dropout} is not supported with parallel.sp_mode = {p.sp_mode!r} "
             f"(ring attention has no attention dropout): use model.dropout = 0 or sp_mode = 'ulysses'")


def _validate_sync_mode(cfg: Config) -> None:
    """local-sgd and async replace the gradient all-reduce of plain data parallelism, so they run with
    dp only (no tp, pp, sp, FSDP); the rank counts they need are checked in :func:`resolve_world`."""
    p, ls, ps = cfg.parallel, cfg.local_sgd, cfg.parameter_server
    _require(p.sync_mode in SYNC_MODES, f"parallel.sync_mode = {p.sync_mode!r} is not valid: use one of "
                                        f"{', '.join(SYNC_MODES)}")
    _require(ls.steps >= 1, f"local_sgd.steps = {ls.steps} must be >= 1")
    _require(ls.warmup >= 0, f"local_sgd.warmup = {ls.warmup} must be >= 0")
    _require(ps.servers >= 1, f"parameter_server.servers = {ps.servers} must be >= 1")
    _require(ps.max_staleness >= 0, f"parameter_server.max_staleness = {ps.max_staleness} must be >= 0 (0 = only fresh gradients)")
    _require(ps.stale_policy in STALE_POLICIES,
             f"parameter_server.stale_policy = {ps.stale_policy!r} is not valid: use one of {', '.join(STALE_POLICIES)}")
    _require(p.sync_mode != "async" or ps.stale_policy != "wait" or ps.servers == 1,
             f"parameter_server.stale_policy = 'wait' needs parameter_server.servers = 1 (got {ps.servers}): bounded waiting is "
             f"decided by one server; use stale_policy = 'drop' with several servers")
    if p.hierarchical_allreduce:
        _require(p.sync_mode == "sync" and p.zero_stage == 0 and p.tp == 1,
                 f"parallel.hierarchical_allreduce = true replaces DDP's gradient all-reduce: it needs sync_mode = "
                 f"'sync', zero_stage = 0 and tp = 1 (got {p.sync_mode!r}, {p.zero_stage}, {p.tp})")
    _validate_sync_mode_sections(cfg)
    if p.sync_mode == "diloco":
        check_diloco(cfg)
    if p.sync_mode in ("sync", "diloco"):
        return
    for key, value in ((str(a), axes.degree(p, a)) for a in REPLICA_AXES):
        _require(value == 1, f"parallel.{key} = {value} cannot be combined with parallel.sync_mode = "
                             f"{p.sync_mode!r}: it replaces the data-parallel all-reduce only; use {key} = 1")
    _require(p.zero_stage == 0, f"parallel.zero_stage = {p.zero_stage} cannot be combined with parallel.sync_mode = "
                                f"{p.sync_mode!r}: every replica keeps whole parameters; use zero_stage = 0")


def _validate_sync_mode_sections(cfg: Config) -> None:
    """The section of another sync mode than ``parallel.sync_mode`` (:data:`meshtrain.axes.SYNC_MODE_SECTIONS`) keeps
    its defaults: set, its keys would do nothing."""
    mode_now = cfg.parallel.sync_mode
    for mode, name in SYNC_MODE_SECTIONS.items():
        section, defaults = getattr(cfg, name), type(getattr(cfg, name))()
        for f in dataclasses.fields(section):
            value, default = (str(v).lower() if isinstance(v, bool) else repr(v)
                              for v in (getattr(section, f.name), getattr(defaults, f.name)))
            _require(mode == mode_now or value == default,
                     f"{name}.{f.name} = {value} applies to parallel.sync_mode = {mode!r} only: use {default} with "
                     f"sync_mode = {mode_now!r}, or set --parallel.sync_mode {mode}")


def check_diloco(cfg: Config) -> None:
    """DiLoCo's own keys (``[diloco]``); inside a worker every synchronous layout runs, so only what replaces the
    cross-worker exchange is refused (the hierarchical all-reduce; ep, whose all-to-all would span workers, is a
    layout rule). The planner runs it on its DiLoCo layouts too (:func:`meshtrain.planner.layout.divisibility_errors`).

    Raises:
        ConfigError: the first rule broken, naming the key, the value and what is valid.
    """
    p, d = cfg.parallel, cfg.diloco
    _require(d.group >= 0, f"diloco.group = {d.group} must be >= 0 (0 = the ranks of one node)")
    _require(d.inner_steps >= 1, f"diloco.inner_steps = {d.inner_steps} must be >= 1")
    _require(d.outer_lr > 0, f"diloco.outer_lr = {d.outer_lr} must be > 0")
    _require(0 <= d.outer_momentum < 1, f"diloco.outer_momentum = {d.outer_momentum} must be in [0, 1)")
    _require(d.fragments >= 1, f"diloco.fragments = {d.fragments} must be >= 1")
    _require(d.inner_steps % d.fragments == 0,
             f"diloco.inner_steps = {d.inner_steps} is not divisible by diloco.fragments = "
             f"{d.fragments}: a fragment syncs every H/F steps; use an H that is a multiple of F")
    every = d.inner_steps // d.fragments
    _require(0 <= d.delay < every,
             f"diloco.delay = {d.delay} must be in [0, H/F = {every}): a fragment's exchange must "
             f"land before the next fragment's starts")
    _require(0 <= d.alpha < 1, f"diloco.alpha = {d.alpha} must be in [0, 1)")
    _require(d.precision in OUTER_PRECISIONS, f"diloco.precision = {d.precision!r} is not "
                                                     f"valid: use one of {', '.join(OUTER_PRECISIONS)}")
    _require(not p.hierarchical_allreduce, "parallel.hierarchical_allreduce = true cannot be combined with "
                                           "parallel.sync_mode = 'diloco' (its outer step is the cross-node exchange): "
                                           "use false")
    if d.lighthouse:
        _validate_elastic(cfg)
    else:
        _require(d.workers == 0, f"diloco.workers = {d.workers} is for elastic workers (separate "
                                         f"jobs): set diloco.lighthouse too, or use 0")


def _validate_elastic(cfg: Config) -> None:
    """Elastic DiLoCo workers (:mod:`meshtrain.parallel.diloco.elastic`): the lighthouse's address, the worker's index, and
    what the elastic exchange does not do (it syncs the whole model at once, applied at once, in fp32 or bf16)."""
    p, d = cfg.parallel, cfg.diloco
    url = re.fullmatch(r"https?://[^\s/:]+:(\d{1,5})/?", d.lighthouse)
    _require(url is not None and 0 < int(url.group(1)) < 65536,
             f"diloco.lighthouse = {d.lighthouse!r} is not an address: use http://HOST:PORT "
             f"(where torchft_lighthouse --bind listens)")
    _require(d.workers >= 2, f"diloco.workers = {d.workers} must be >= 2 with a lighthouse: "
                                    f"the workers (jobs) of the run, whose shares of the data they read")
    _require(0 <= d.worker < d.workers,
             f"diloco.worker = {d.worker} must be in [0, {d.workers}) (diloco.workers)")
    for key, value, plain in (("fragments", d.fragments, 1), ("delay", d.delay, 0), ("alpha", d.alpha, 0.0)):
        _require(value == plain, f"diloco.{key} = {value} is not supported by elastic workers "
                                 f"(diloco.lighthouse): they sync the whole model at once; use {plain}")
    _require(d.precision in ("fp32", "bf16"), f"diloco.precision = {d.precision!r} is not "
                                                     f"supported by elastic workers: use 'fp32' or 'bf16'")
    _require(p.zero_stage != 1, "parallel.zero_stage = 1 is not supported by elastic workers (a rejoining worker "
                                "takes a peer's whole optimizer state): use 0, 2 or 3")


def diloco_workers(cfg: Config, world_size: int) -> int:
    """DiLoCo's workers on ``world_size`` ranks: ``world_size / diloco.group`` (``diloco.group`` resolved, >= 1).

    Raises:
        ConfigError: the group does not divide the ranks, holds no whole replica (pp*sp*tp), or leaves one worker.
    """
    group, inner = cfg.diloco.group, axes.replica_size(cfg.parallel)
    names = axes.product_text(REPLICA_AXES)
    _require(world_size % group == 0, f"diloco.group = {group} ranks per worker does not divide the "
                                      f"{world_size} ranks: use a divisor of {world_size}")
    _require(group % inner == 0, f"diloco.group = {group} is not a multiple of {names} = {inner}: a "
                                 f"worker holds whole replicas; use a multiple of {inner}")
    workers = world_size // group
    smaller = [g for g in range(inner, world_size // 2 + 1, inner) if world_size % g == 0]
    _require(workers >= 2, f"parallel.sync_mode = 'diloco' needs >= 2 workers, got {world_size} ranks in groups of "
                           f"{group}: " + (f"set diloco.group to one of {', '.join(map(str, smaller))}"
                                           if smaller else f"use --nproc {2 * group} or more"))
    return workers


def _validate_objective(cfg: Config) -> None:
    """``train.objective`` and DPO's keys; DPO reads one pair per two rows of padded samples, synchronously."""
    t = cfg.train
    _require(t.objective in OBJECTIVES, f"train.objective = {t.objective!r} is not valid: use one of "
                                        f"{', '.join(OBJECTIVES)}")
    _require(t.dpo_beta > 0, f"train.dpo_beta = {t.dpo_beta} must be > 0 (TRL's default is 0.1)")
    _require(t.dpo_loss in DPO_LOSSES, f"train.dpo_loss = {t.dpo_loss!r} is not valid: use one of "
                                       f"{', '.join(DPO_LOSSES)}")
    _require(0 <= t.dpo_label_smoothing < 0.5, f"train.dpo_label_smoothing = {t.dpo_label_smoothing} must be in "
                                               f"[0, 0.5)")
    _require(t.dpo_label_smoothing == 0 or t.dpo_loss == "robust", f"train.dpo_label_smoothing = "
             f"{t.dpo_label_smoothing} applies to train.dpo_loss = 'robust' only, not {t.dpo_loss!r}: set it to 0 or "
             f"use 'robust'")
    _require(t.dpo_reference in DPO_REFERENCES, f"train.dpo_reference = {t.dpo_reference!r} is not valid: use one "
                                                f"of {', '.join(DPO_REFERENCES)}")
    if t.objective != "dpo":
        return
    _require(t.dpo_reference != "copy" or not cfg.adapter.lora_rank, f"train.dpo_reference = 'copy' with LoRA "
             f"adapters (adapter.lora_rank = {cfg.adapter.lora_rank}) would copy the frozen base that the adapters "
             f"leave as it is: use train.dpo_reference = 'precomputed'")
    _require(cfg.data.packing == "pad", f"train.objective = 'dpo' reads each pair as two padded rows: set "
                                        f"data.packing = 'pad', not {cfg.data.packing!r}")
    _require(cfg.parallel.sync_mode == "sync", f"train.objective = 'dpo' is not supported with parallel.sync_mode = "
                                               f"{cfg.parallel.sync_mode!r}: use 'sync'")


def _validate_packing(cfg: Config) -> None:
    """``data.packing = "document"`` needs an EOS token to split windows at, and an attention that takes the
    block-diagonal mask: the GPT's or Llama's SDPA, whole, under Ulysses or under ring attention (a recurrence has
    no attention; the parameter server runs the model unsharded)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    _require(d.packing in PACKINGS, f"data.packing = {d.packing!r} is not valid: use one of {', '.join(PACKINGS)}")
    _require(d.packing != "pad" or p.sync_mode != "async", "data.packing = 'pad' is not supported with "
                                                           "parallel.sync_mode = 'async': use 'sync' or 'local-sgd'")
    if d.packing != "document":
        return
    prepared = d.resolved_path().is_dir()  # a prepared folder's own tokenizer, which prepare requires to have an EOS
    _require(d.tokenizer != "char" or prepared, "data.packing = 'document' needs an end-of-document (EOS) token and "
                                                "data.tokenizer = 'char' has none: use a tokenizer file with one or "
                                                "'concat'")
    _require(family(m.type).attention, f"data.packing = 'document' masks attention, which model.type = "
                                       f"{m.type!r} has none: use an attention model ({attention_families()}), or "
                                       f"data.packing = 'concat'")
    _require(p.sync_mode != "async", "data.packing = 'document' is not supported with parallel.sync_mode = 'async' "
                                     "(the parameter server's workers run windows whole): use 'sync' or 'local-sgd'")


def resolve_world(cfg: Config, nproc: int | None, schedule: bool = True) -> tuple[int, int]:
    """Return ``(world_size, dp)`` for launching ``cfg`` on ``nproc`` ranks (None: derive from the config);
    ``schedule=False`` leaves out the pipeline schedule's rules on the micro-batch split (as :func:`validate`).

    ``world_size = pp * dp * sp * tp`` (docs/architecture.md, mesh). With ``dp = -1``, dp fills the ranks left.

    Raises:
        ConfigError: nproc is not divisible by ``pp*sp*tp``, or disagrees with an explicit dp.
    """
    p, d = cfg.parallel, cfg.diloco
    if p.sync_mode == "async":
        return _resolve_async_world(cfg, nproc)
    inner, names = axes.replica_size(p), axes.product_text(REPLICA_AXES)
    if nproc is None and p.sync_mode == "diloco" and p.dp == -1 and d.group >= 1:
        nproc = d.group * (1 if d.lighthouse else 2)  # two workers; elastic: a job is one
    if nproc is None:
        dp = 1 if p.dp == -1 else p.dp
        if p.sync_mode == "local-sgd":
            dp = max(dp, 2)
        if p.sync_mode != "diloco":
            return dp * inner, dp
        nproc = dp * inner
    _require(nproc >= 1, f"--nproc = {nproc} must be >= 1")
    _require(nproc % inner == 0,
             f"--nproc = {nproc} is not divisible by {names} = {inner}: use a multiple of {inner}")
    dp = nproc // inner
    _require(p.dp in (-1, dp),
             f"parallel.dp = {p.dp} does not match --nproc = {nproc} ({names} = {inner} gives dp = {dp}): "
             f"set --dp {dp} or --nproc {p.dp * inner}")
    if schedule:
        error = pipeline_error(p.pp_schedule, p.pp, p.virtual_stages, cfg.batch.gradient_accumulation_steps,
                               cfg.model.n_layer, dp * p.sp, p.zero_stage)
        _require(error is None, error or "")
    if errors := layout_errors(shape_of(cfg), p, dp, p.sync_mode):  # the rules that wait for dp
        raise ConfigError(errors[0])
    _require(p.sync_mode != "local-sgd" or dp >= 2,
             f"parallel.sync_mode = 'local-sgd' needs dp >= 2 replicas to average, got dp = {dp}: use --nproc 2 or more")
    if p.sync_mode == "diloco":
        _require(d.group >= 1, "diloco.group = 0 (one node per worker) is resolved by meshtrain "
                                      "train from --nproc; set it to the ranks of one worker")
        if d.lighthouse:  # elastic: this job is one worker
            _require(d.group == nproc, f"diloco.group = {d.group} must equal the job's "
                                              f"{nproc} ranks with diloco.lighthouse: each job is one worker")
        else:
            diloco_workers(cfg, nproc)
    return nproc, dp


def _resolve_async_world(cfg: Config, nproc: int | None) -> tuple[int, int]:
    """``(world_size, workers)`` of a parameter-server run: ``parameter_server.servers`` server ranks plus the
    workers (``parallel.dp``; -1 = every rank that is not a server)."""
    p, ps = cfg.parallel, cfg.parameter_server
    if nproc is None:
        workers = 2 if p.dp == -1 else p.dp
        return ps.servers + workers, workers
    workers = nproc - ps.servers
    _require(workers >= 1, f"parallel.sync_mode = 'async' needs at least one worker besides parameter_server.servers = "
                           f"{ps.servers} server(s), got --nproc = {nproc}: use --nproc {ps.servers + 1} or more")
    _require(p.dp in (-1, workers), f"parallel.dp = {p.dp} workers does not match --nproc = {nproc} with "
                                    f"{ps.servers} server(s) (= {workers} workers): set --dp {workers} or -1")
    return nproc, workers
