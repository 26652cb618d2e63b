"""Typed run configuration: TOML file + CLI overrides, validated before any process starts.

Sections and keys (``--section.key VALUE`` on the CLI; short flags ``--dp --tp --pp --sp --steps
--seed --out``)::

    [model]      type, n_layer, n_head, n_embd, block_size, dropout, vocab_size, norm_eps, init_from (a Hugging
                 Face model folder), and each family's own keys (models/<family>/spec.py: gpt bias, activation;
                 llama n_kv_head, head_dim, ffn_hidden, rope_*, tie_embeddings, ...; lstm/gru tbptt_steps)
    [data]       path, val_fraction, tokenizer, packing
    [parallel]   dp, tp, pp, sp, zero_stage, fsdp_unit_mb, sp_mode, pp_schedule, virtual_stages, tp_sequence_parallel, sync_mode,
                 local_sgd_steps, local_sgd_warmup, ps_servers, max_staleness, hierarchical_allreduce, stale_policy
    [batch]      micro_batch_size, gradient_accumulation_steps
    [optim]      lr, min_lr, warmup_steps, weight_decay, grad_clip, beta1, beta2, lr_scaling, reference_batch_size
    [train]      steps, seed, eval_interval, eval_steps, log_interval, dtype, out_dir, check_memory,
                 max_nonfinite_steps, collective_timeout_s, tensorboard, profile_steps
    [checkpoint] interval, keep, resume, allow_batch_change, async_save

Every user mistake raises :class:`ConfigError` (a ``ValueError``) whose one-line message names the
key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtrain import axes
from meshtrain.axes import REPLICA_AXES, STALE_POLICIES, SYNC_MODES, degree_errors, degrees_dataclass
from meshtrain.errors import ConfigError
from meshtrain.errors import require as _require
from meshtrain.models.registry import ModelConfig, attention_families, check_model, family
from meshtrain.paths import path_problem
from meshtrain.rules.support import SUPPORTED, compile_error, recompute_error

__all__ = ["Config", "ConfigError", "ModelConfig", "load_config", "validate", "resolve_world"]

BUNDLED_CORPUS = Path(__file__).parent / "assets" / "tinyshakespeare.txt"

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
COMPILES = ("auto", "on", "off")
RECOMPUTES = SUPPORTED.recompute
LR_SCALINGS = ("none", "linear", "sqrt")
"""How the peak learning rate follows the global batch (``optim.lr_scaling``, :func:`meshtrain.batch.scaled_lr`)."""
MAX_SEED = 2**32 - 1
"""Largest ``train.seed``: per-step seeds ``(seed * 1_000_003 + step) * 1_009 + rank`` stay below torch's 2**64."""
MAX_TIMEOUT_S = 1e9
"""Largest ``train.collective_timeout_s``: torch keeps the timeout in C++ milliseconds (1e308 s overflowed a rank)."""
MAX_MODEL_SIZE = {"n_layer": 2**20, "n_head": 2**20, "n_embd": 2**24, "block_size": 2**31 - 1, "vocab_size": 2**31 - 1}
"""Upper bounds of the model's sizes, each far past any model: the planner and the model hold per-layer lists and
int32-indexed tables (a plan of 2**63 layers overflowed; 2**40 would fill the memory)."""
MAX_MODEL_SIZE_WHY = {"n_layer": "blocks are built and planned one by one", "n_head": "far past any model",
                      "n_embd": "far past any model", "block_size": "an int32 position"}


PACKINGS = ("concat", "document")
"""``data.packing`` values (:mod:`meshtrain.data.packing`)."""
TOKENIZER_KINDS = ("char", "hf", "tiktoken", "sentencepiece")
"""Kinds of ``data.tokenizer`` (:mod:`meshtrain.data.tokenizers`)."""
HF_TOKENIZER_FILE = "tokenizer.json"


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


@dataclass
class DataConfig:
    path: str = ""
    """UTF-8 text file to train on, or a folder ``meshtrain prepare`` wrote (token shards read through memory
    maps: any size); empty means the bundled Tiny Shakespeare corpus."""
    val_fraction: float = 0.1
    """Fraction of the text (taken from its end) held out for validation, in (0, 1); a prepared folder has its own."""
    tokenizer: str = "char"
    """How the text becomes token ids (:mod:`meshtrain.data.tokenizers`): "char" (one id per distinct character
    of the text), a Hugging Face ``tokenizer.json`` (or a model folder holding one, e.g. ``model.init_from``'s),
    a ``*.tiktoken`` BPE file, or a sentencepiece ``*.model``. With ``model.vocab_size = 0`` a non-char
    tokenizer's vocabulary is padded up to a multiple of 128 * tp (Megatron-LM's rule)."""
    packing: str = "concat"
    """How documents share a window of ``block_size`` tokens (:mod:`meshtrain.data.packing`): "concat" (one
    sequence across the EOS tokens that separate documents, nanoGPT's and Megatron-LM's) or "document" (positions
    restart after each EOS and attention stays inside each document: a block-diagonal causal mask). "document"
    needs a tokenizer with an EOS token (not "char"), an attention model (gpt, llama), sp_mode "ulysses" when
    sp > 1, and a synchronous sync_mode."""

    def resolved_path(self) -> Path:
        return Path(self.path).expanduser() if self.path else BUNDLED_CORPUS


ParallelDegrees = degrees_dataclass("ParallelDegrees", "The degree of each axis of :data:`meshtrain.axes.AXIS_TABLE`.")


@dataclass
class ParallelConfig(ParallelDegrees):
    """The ``[parallel]`` section: one degree per axis (``dp``, ``tp``, ``pp``, ``sp``: their meaning is
    :data:`meshtrain.axes.AXIS_TABLE`'s), then how the axes run."""

    zero_stage: int = 0
    """0 = DDP (replicated); 2 = FSDP2 without resharding after forward; 3 = FSDP2 ``fully_shard``."""
    fsdp_unit_mb: float = 25.0
    """zero_stage 2/3: consecutive blocks share one FSDP2 unit (one all-gather, one reduce-scatter) until it
    holds this many MiB of fp32 parameters, like DDP's 25 MiB buckets; 0 = one unit per block
    (:func:`meshtrain.rules.support.fsdp_units`)."""
    sp_mode: str = "ulysses"
    """Sequence-parallel flavour: "ulysses" (all-to-all; n_head % (tp*sp) == 0) or "ring" (ring attention)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: "naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble" or "zbv"
    (:mod:`meshtrain.rules.pipeline_schedules`); its micro-batches are the ``gradient_accumulation_steps``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank: 1, >= 2 for "interleaved-1f1b", 2 for "zbv"."""
    tp_sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropouts split along the sequence inside the tp group."""
    sync_mode: str = "sync"
    """How dp replicas combine their work: "sync" (gradients all-reduced every step), "local-sgd" (each
    replica steps alone, parameters averaged every ``local_sgd_steps``) or "async" (a parameter server,
    :mod:`meshtrain.parallel.async_ps`)."""
    local_sgd_steps: int = 4
    """local-sgd: optimizer steps between two parameter averages (H of Lin et al. 2020)."""
    local_sgd_warmup: int = 0
    """local-sgd: synchronous steps (gradient all-reduce) before local SGD starts (post-local SGD)."""
    ps_servers: int = 1
    """async: ranks 0..ps_servers-1 hold the parameters and the optimizer; the other ranks are workers."""
    max_staleness: int = 4
    """async: a gradient computed on parameters more than this many updates old is not applied."""
    hierarchical_allreduce: bool = False
    """Reduce gradients inside each node first, then across nodes between one rank per node, then
    broadcast inside the node (:mod:`meshtrain.parallel.hierarchical`); DDP (zero_stage 0, tp 1) only."""
    stale_policy: str = "drop"
    """async: "drop" (workers never wait; a too-stale gradient is dropped and counted) or "wait" (workers
    wait for parameters so that no gradient is ever too stale)."""


@dataclass
class BatchConfig:
    micro_batch_size: int = 12
    """Samples one dp replica processes in one forward/backward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate of AdamW, reached after ``warmup_steps``."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay; <= lr."""
    warmup_steps: int = 100
    """Linear warmup steps from 0 to ``lr``."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not to norms and biases)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (across all ranks) to this value; 0 disables clipping."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    lr_scaling: str = "none"
    """Scale ``lr`` and ``min_lr`` with the global batch: "none", "linear" or "sqrt" (:func:`meshtrain.batch.scaled_lr`)."""
    reference_batch_size: int = 0
    """Global batch (samples) at which ``lr`` was tuned; needed (>= 1) when ``lr_scaling`` is not "none"."""
    fused: bool = True
    """AdamW's fastest kernels: the fused kernel (``torch.optim.AdamW(fused=True)``) where every parameter
    is a plain tensor (one rank, DDP, pp), foreach kernels where every one is a DTensor (FSDP2: the fused
    kernel fails on their resumed states); false, or a mix of both (tp), torch's default (a per-tensor
    loop on CPU). The same update up to rounding."""


@dataclass
class TrainConfig:
    steps: int = 2000
    """Optimizer steps to train for."""
    seed: int = 1337
    """Seed for weights, data order and dropout."""
    eval_interval: int = 250
    """Evaluate on the val split every this many steps (and at the last step); 0 = only at the end."""
    eval_steps: int = 20
    """Micro-batches (of ``micro_batch_size`` per dp rank) averaged for one val loss."""
    log_interval: int = 10
    """Write a metrics record every this many steps (and at the last step)."""
    dtype: str = "auto"
    """Compute dtype: "bfloat16" (autocast; master weights stay fp32), "float32", or "auto": bfloat16 where
    the device has bf16 matmul (:func:`meshtrain.runtime.device.compute_dtype`), else float32."""
    out_dir: str = "out"
    """Folder for metrics.jsonl, checkpoints, the loss curve; must not hold another run."""
    compile: str = "auto"
    """``torch.compile`` each transformer block (``nn.Module.compile``: parameter names unchanged): "on",
    "off", or "auto": on for a GPT on CUDA, off on CPU, where it measured no faster (docs/benchmarks.md).
    Every layout compiles (per block, after tp/sp, before DDP/FSDP2) but a parameter-server run (sync_mode
    "async") and the recurrent models, which run uncompiled; "on" there is refused."""
    recompute: str = "none"
    """Activation recomputation per transformer block (:mod:`meshtrain.parallel.recompute`): "none"; "selective"
    (torch's per-operator selective checkpointing: GEMM, attention-kernel and tp/sp collective outputs kept,
    norms, activations, dropout and residual adds recomputed in backward); "full" (only each block's input kept,
    the whole block run again in backward). Trades step time for activation memory (docs/training.md)."""
    check_memory: bool = True
    """Before launch, refuse a run whose predicted peak memory (the planner's, all ranks of this node)
    exceeds the memory available (CPU: MemAvailable; GPU: each device's). false skips the check."""
    max_nonfinite_steps: int = 5
    """A step whose loss or gradient norm is NaN/inf is skipped (no update) and logged; this many in a row
    stop the run, keeping the checkpoints written before."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for its peers before the waiting rank stops with a message naming
    the step's phase and the ranks it waited on (torch's default for gloo, 30 min). Bounds every hang on
    a stuck or dead rank; keep it above the longest checkpoint save."""
    tensorboard: bool = False
    """Global rank 0 also writes every metrics.jsonl record's numbers as TensorBoard scalars to ``OUT/tb/``
    (tags are the record's keys: loss, val_loss, lr, grad_norm, tokens_per_s, peak_memory_bytes, ...); needs
    the ``tb`` extra, ``pip install 'meshtrain[tb]'``."""
    profile_steps: list[int] = field(default_factory=list)
    """``[a, b]``: every rank records a ``torch.profiler`` trace of steps a..b (1 <= a <= b <= steps) with
    memory to ``OUT/profile/rank{r}.json`` (Chrome trace format; on CUDA also a memory snapshot
    ``rank{r}_memory.pickle``); empty = off. On the command line ``--train.profile_steps 3,5``."""


@dataclass
class CheckpointConfig:
    interval: int = 500
    """Save every this many steps (and at the last step); 0 = only at the last step."""
    keep: int = 2
    """Number of most recent checkpoints kept on disk (>= 1)."""
    resume: str = ""
    """Checkpoint to resume from: a step folder, a run folder (its latest step), or "" for none."""
    allow_batch_change: bool = False
    """Resume at another global batch size than the checkpoint's (by default that is refused, since it
    changes the loss and the learning-rate schedule's meaning)."""
    async_save: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``): training waits
    only while the state is copied to CPU memory, and a step becomes a checkpoint once every rank's write
    finished (:mod:`meshtrain.checkpoint_async`). Costs a CPU copy of the model and optimizer state per rank
    while a write runs. Needs a synchronous ``parallel.sync_mode`` (not "async")."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SHORT_FLAGS = {
    **axes.SHORT_FLAGS,
    "steps": "train.steps",
    "seed": "train.seed",
    "out": "train.out_dir",
}


def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _sections() -> dict[str, type]:
    return _field_types(Config)


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'? " if close else ""


def _coerce(key: str, value: Any, typ: type, from_text: bool = True) -> Any:
    """Convert ``value`` to ``typ``, or raise ConfigError naming ``key``. A string is parsed when it comes
    from the command line (``from_text``); in a TOML file, which is typed, a quoted number is an error."""
    if isinstance(typ, types.UnionType):  # pragma: no cover - no union fields today
        typ = typing.get_args(typ)[0]
    if typing.get_origin(typ) is list:
        return _coerce_list(key, value, typing.get_args(typ)[0], from_text)
    if isinstance(value, str) and typ is not str:
        if not from_text:
            raise ConfigError(f"{key} = {value!r} is a string but must be a {typ.__name__}: write it without quotes")
        text = value.strip()
        try:
            if typ is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes")
            if typ is int:
                return int(text)
            if typ is float:
                value = float(text)
        except ValueError:
            raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}") from None
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key} = {value} must be a finite number")
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r} is not a valid bool (use true or false)")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} = {value!r} is not a valid int")
    if not isinstance(value, typ):
        raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}")
    return value


def _coerce_list(key: str, value: Any, item: type, from_text: bool) -> list:
    """A list key: a TOML array, or on the command line comma-separated items (``3,5``, ``[3, 5]``; ``""`` or
    ``[]`` is empty); each item converted as ``item``."""
    if isinstance(value, str) and from_text:
        text = value.strip().removeprefix("[").removesuffix("]").strip()
        value = [part.strip() for part in text.split(",")] if text else []
    if not isinstance(value, list):
        raise ConfigError(f"{key} = {value!r} is not a list: write an array such as [3, 5]")
    return [_coerce(key, v, item, from_text) for v in value]


def set_key(cfg: Config, dotted: str, value: Any, from_text: bool = True) -> None:
    """Set ``section.key`` on ``cfg`` from a TOML value or CLI string.

    Raises:
        ConfigError: unknown section/key (with the closest valid name) or a value of the wrong type.
    """
    sections = _sections()
    if "." not in dotted:
        raise ConfigError(f"'{dotted}' is not a config key: use section.key, e.g. parallel.dp")
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}': {_suggest(section, list(sections))}"
                          f"valid sections are {', '.join(sections)}")
    obj = getattr(cfg, section)
    ftypes = _field_types(type(obj))
    if key not in ftypes:
        raise ConfigError(f"unknown config key '{dotted}': {_suggest(key, list(ftypes))}"
                          f"valid keys of [{section}] are {', '.join(ftypes)}")
    setattr(obj, key, _coerce(dotted, value, ftypes[key], from_text))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a :class:`Config` from an optional TOML file, then apply ``overrides`` (``"section.key" -> value``).

    Raises:
        ConfigError: missing/unparsable file, unknown keys, wrong types or impossible values
            (see :func:`validate`).
    """
    cfg = Config()
    given: set[str] = set()
    if path is not None:
        p = Path(path)
        data = read_toml(p, "config file")
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"'{section}' in {p} must be a [section] table, got {table!r}")
            for key, value in table.items():
                set_key(cfg, f"{section}.{key}", value, from_text=False)
                given.add(f"{section}.{key}")
    for dotted, value in (overrides or {}).items():
        set_key(cfg, dotted, value)
        given.add(dotted)
    apply_init_from(cfg.model, given)
    validate(cfg)
    return cfg


SAVED_KEYS = ("data.val_fraction", "train.seed")
"""Keys of a saved config besides ``[model]`` that a resume compares with the run's (:mod:`meshtrain.preflight`)."""


def check_saved_config(saved: dict[str, Any]) -> ModelConfig:
    """The model of a config a checkpoint saved (``meta.json["config"]``): each ``[model]`` key present, typed
    and in range as :func:`validate` checks a config (the other sections at their defaults), and
    :data:`SAVED_KEYS` too; keys it lacks (older checkpoints) take their defaults.

    Raises:
        ConfigError: the first wrong key, e.g. "model.n_layer = 0 must be >= 1".
    """
    cfg = Config()
    for dotted in [f"model.{key}" for key in saved["model"]] + list(SAVED_KEYS):
        section, key = dotted.split(".")
        table = saved.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"'{section}' = {table!r} (it must be a table)")
        if key in table:
            set_key(cfg, dotted, table[key], from_text=False)
    validate(cfg)
    return cfg.model


def apply_init_from(m: ModelConfig, given: set[str]) -> None:
    """Set the model keys from ``model.init_from``'s ``config.json`` (its family's reader,
    :func:`meshtrain.models.registry.hf_model_keys`); nothing when it is empty. ``given`` holds the dotted keys the
    user set: one of them with another value than the checkpoint's is a contradiction, not an override (the
    weights could not load) -- but a key at its "derive" value (0) is no contradiction when it derives to the
    file's value (``ffn_hidden = 0`` by Llama's rule, :attr:`meshtrain.models.family.Family.derived`), and
    ``vocab_size = 0`` ("from the tokenizer") takes the checkpoint's (the pre-launch check then proves the
    tokenizer fits it). ``block_size`` (the training context) is the run's, at most the checkpoint's positions; a
    default above them is lowered.

    Raises:
        ConfigError: no such folder, no or a broken ``config.json``, an architecture meshtrain does not build,
            a contradicting key, or ``model.block_size`` past the checkpoint's positions.
    """
    if not m.init_from:
        return
    from meshtrain.models import hf_io as hf
    from meshtrain.models.registry import hf_model_keys

    folder = Path(m.init_from).expanduser()
    _require(folder.is_dir(), f"model.init_from = '{m.init_from}' is not a folder: give a local Hugging Face model "
                              f"folder ({hf.CONFIG_FILE} + safetensors weights)")
    where = folder / hf.CONFIG_FILE
    try:
        data = hf.read_json(where, "model.init_from's")
        keys = hf_model_keys(data, where)
    except hf.HFFormatError as e:
        raise ConfigError(str(e)) from None
    mine = {key: getattr(m, key) for key in keys if f"model.{key}" in given}
    for key, value in keys.items():
        setattr(m, key, value)
    derived = family(m.type).derived
    for key, value in mine.items():
        derives = value == 0 and (key == "vocab_size" or (key in derived and derived[key](_with(m, key, 0)) == keys[key]))
        if value != keys[key] and not derives:
            raise ConfigError(f"model.{key} = {value!r} contradicts '{where}', which gives {keys[key]!r}: "
                              f"remove model.{key} or set it to {keys[key]!r}")
    limit = hf.max_positions(data)
    if limit is not None and "model.block_size" not in given:
        m.block_size = min(m.block_size, limit)
    _require(limit is None or m.block_size <= limit, f"model.block_size = {m.block_size} exceeds the "
                                                     f"{limit} positions of '{where}': use <= {limit}")


def _with(m: ModelConfig, key: str, value: Any) -> ModelConfig:
    """A copy of ``m`` with ``key`` set to ``value``."""
    return dataclasses.replace(m, **{key: value})


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The parsed TOML document at ``path``; ``what`` names the file in errors ("config file", ...).

    Raises:
        ConfigError: the file does not exist or is not valid TOML (one line naming the file).
    """
    require_regular_file(path, what)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte {e.start}): save it as UTF-8 TOML") from None
    except OSError as e:
        raise ConfigError(f"{what} '{path}' cannot be read: {e.strerror}") from None
    if not text.strip():
        raise ConfigError(f"{what} '{path}' is empty: give a TOML file with [section] tables, e.g. "
                          f"configs/shakespeare_char.toml")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} '{path}' is not valid TOML: {e}") from None


def require_regular_file(path: Path, what: str) -> None:
    """Raise ConfigError (one line naming ``what`` and the path) unless ``path`` is a regular file."""
    problem = path_problem(path)
    if problem:
        raise ConfigError(f"{what} '{path}' {problem}")


def validate(cfg: Config) -> Config:
    """Check every value and cross-field rule that needs no process group; return ``cfg``.

    Raises:
        ConfigError: the first violated rule, naming the key, the value and what is valid.
    """
    m, d, p, b, o, t, c = cfg.model, cfg.data, cfg.parallel, cfg.batch, cfg.optim, cfg.train, cfg.checkpoint
    fam = family(m.type)
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        _require(getattr(m, key) >= 1, f"model.{key} = {getattr(m, key)} must be >= 1")
        _require(getattr(m, key) <= MAX_MODEL_SIZE[key], f"model.{key} = {getattr(m, key)} must be at most "
                                                         f"{MAX_MODEL_SIZE[key]:,} ({MAX_MODEL_SIZE_WHY[key]})")
    if fam.attention:
        _require(0 < m.norm_eps < 1, f"model.norm_eps = {m.norm_eps} must be in (0, 1)")
    check_model(m)
    _require(0.0 <= m.dropout < 1.0, f"model.dropout = {m.dropout} must be in [0, 1)")
    _require(m.vocab_size >= 0, f"model.vocab_size = {m.vocab_size} must be >= 0 (0 = from the tokenizer)")
    _require(m.vocab_size <= MAX_MODEL_SIZE["vocab_size"], f"model.vocab_size = {m.vocab_size} must be at most "
                                                           f"{MAX_MODEL_SIZE['vocab_size']:,} (an int32 token id)")

    path = d.resolved_path()
    problem = None if path.is_dir() else path_problem(path)
    _require(problem != "does not exist", f"data.path = {d.path!r} does not exist: give a UTF-8 text file, a "
                                          f"folder meshtrain prepare wrote, or leave it empty")
    _require(problem is None, f"data.path = {d.path!r} {problem}: give a UTF-8 text file or a folder meshtrain "
                              f"prepare wrote")
    _require(0.0 < d.val_fraction < 1.0, f"data.val_fraction = {d.val_fraction} must be in (0, 1)")
    tokenizer_kind(d.tokenizer)

    if errors := degree_errors(p, "parallel."):
        raise ConfigError(errors[0])
    _require(b.micro_batch_size >= 1, f"batch.micro_batch_size = {b.micro_batch_size} must be >= 1")
    _require(b.gradient_accumulation_steps >= 1,
             f"batch.gradient_accumulation_steps = {b.gradient_accumulation_steps} must be >= 1")
    _validate_support(cfg)
    fam.check_layout(m, p)
    _validate_packing(cfg)
    _validate_sync_mode(cfg)
    _validate_shapes(cfg)

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

    _require(c.interval >= 0, f"checkpoint.interval = {c.interval} must be >= 0 (0 = only at the last step)")
    _require(c.keep >= 1, f"checkpoint.keep = {c.keep} must be >= 1")
    _require(not c.async_save or p.sync_mode != "async",
             "checkpoint.async_save = true needs a synchronous parallel.sync_mode: the parameter server (sync_mode "
             "= 'async') saves from inside its gradient handling, with no step the ranks share; use false")
    return cfg


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


def _validate_support(cfg: Config) -> None:
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
    if p.pp > 1:
        from meshtrain.rules.pipeline_schedules import schedule_error

        error = schedule_error(p.pp_schedule, p.pp, p.virtual_stages, cfg.batch.gradient_accumulation_steps,
                               cfg.model.n_layer, max(p.dp, 1) * p.sp, p.zero_stage)  # dp = -1: resolve_world
        _require(error is None, error or "")
    _require(not p.tp_sequence_parallel or S.tp_sequence_parallel,
             "parallel.tp_sequence_parallel = true is not supported yet: use false")
    _require(not p.tp_sequence_parallel or p.tp > 1,
             f"parallel.tp_sequence_parallel = true needs parallel.tp > 1 (it is {p.tp}): set tp >= 2 or use false")
    _require(p.sp == 1 or cfg.model.dropout == 0 or p.sp_mode in S.attention_dropout_sp_modes,
             f"model.dropout = {cfg.model.dropout} is not supported with parallel.sp_mode = {p.sp_mode!r} "
             f"(ring attention has no attention dropout): use model.dropout = 0 or sp_mode = 'ulysses'")


def _validate_sync_mode(cfg: Config) -> None:
    """local-sgd and async replace the gradient all-reduce of plain data parallelism, so they run with
    dp only (no tp, pp, sp, FSDP); the rank counts they need are checked in :func:`resolve_world`."""
    p = cfg.parallel
    _require(p.sync_mode in SYNC_MODES, f"parallel.sync_mode = {p.sync_mode!r} is not valid: use one of "
                                        f"{', '.join(SYNC_MODES)}")
    _require(p.local_sgd_steps >= 1, f"parallel.local_sgd_steps = {p.local_sgd_steps} must be >= 1")
    _require(p.local_sgd_warmup >= 0, f"parallel.local_sgd_warmup = {p.local_sgd_warmup} must be >= 0")
    _require(p.ps_servers >= 1, f"parallel.ps_servers = {p.ps_servers} must be >= 1")
    _require(p.max_staleness >= 0, f"parallel.max_staleness = {p.max_staleness} must be >= 0 (0 = only fresh gradients)")
    _require(p.stale_policy in STALE_POLICIES,
             f"parallel.stale_policy = {p.stale_policy!r} is not valid: use one of {', '.join(STALE_POLICIES)}")
    _require(p.sync_mode != "async" or p.stale_policy != "wait" or p.ps_servers == 1,
             f"parallel.stale_policy = 'wait' needs parallel.ps_servers = 1 (got {p.ps_servers}): bounded waiting is "
             f"decided by one server; use stale_policy = 'drop' with several servers")
    if p.hierarchical_allreduce:
        _require(p.sync_mode == "sync" and p.zero_stage == 0 and p.tp == 1,
                 f"parallel.hierarchical_allreduce = true replaces DDP's gradient all-reduce: it needs sync_mode = "
                 f"'sync', zero_stage = 0 and tp = 1 (got {p.sync_mode!r}, {p.zero_stage}, {p.tp})")
    if p.sync_mode == "sync":
        return
    for key, value in ((str(a), axes.degree(p, a)) for a in REPLICA_AXES):
        _require(value == 1, f"parallel.{key} = {value} cannot be combined with parallel.sync_mode = "
                             f"{p.sync_mode!r}: it replaces the data-parallel all-reduce only; use {key} = 1")
    _require(p.zero_stage == 0, f"parallel.zero_stage = {p.zero_stage} cannot be combined with parallel.sync_mode = "
                                f"{p.sync_mode!r}: every replica keeps whole parameters; use zero_stage = 0")


def _validate_packing(cfg: Config) -> None:
    """``data.packing = "document"`` needs an EOS token to split windows at, and an attention that takes the
    block-diagonal mask: the GPT's or Llama's SDPA, whole or under Ulysses (ring attention's blocks are masked
    by chunk index only; a recurrence has no attention; the parameter server runs the model unsharded)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    _require(d.packing in PACKINGS, f"data.packing = {d.packing!r} is not valid: use one of {', '.join(PACKINGS)}")
    if d.packing != "document":
        return
    _require(d.tokenizer != "char", "data.packing = 'document' needs an end-of-document (EOS) token and "
                                    "data.tokenizer = 'char' has none: use a tokenizer file with one or 'concat'")
    _require(family(m.type).attention, f"data.packing = 'document' masks attention, which model.type = "
                                       f"{m.type!r} has none: use an attention model ({attention_families()}), or "
                                       f"data.packing = 'concat'")
    _require(p.sp == 1 or p.sp_mode == "ulysses", f"data.packing = 'document' is not supported with parallel.sp_mode "
                                                  f"= {p.sp_mode!r} (ring attention takes no document mask): use "
                                                  f"sp_mode = 'ulysses' or data.packing = 'concat'")
    _require(p.sync_mode != "async", "data.packing = 'document' is not supported with parallel.sync_mode = 'async' "
                                     "(the parameter server's workers run windows whole): use 'sync' or 'local-sgd'")


def _validate_shapes(cfg: Config) -> None:
    """The sequence split across sp, 2*sp chunks for ring attention, and further across tp with
    tp_sequence_parallel (what the heads need is the family's, :attr:`meshtrain.models.family.Family.check_layout`)."""
    m, p = cfg.model, cfg.parallel
    chunks = p.sp * (2 if p.sp > 1 and p.sp_mode == "ring" else 1) * (p.tp if p.tp_sequence_parallel else 1)
    if chunks > 1:
        what = " * ".join(name for name, on in (("sp", p.sp > 1), ("2 (ring chunks)", p.sp > 1 and p.sp_mode == "ring"),
                                               ("tp (tp_sequence_parallel)", p.tp_sequence_parallel)) if on)
        _require(m.block_size % chunks == 0,
                 f"model.block_size = {m.block_size} is not divisible by {what} = {chunks}: each rank holds "
                 f"block_size/{chunks} tokens of a sample; use a block_size that is a multiple of {chunks}")


def resolve_world(cfg: Config, nproc: int | None) -> tuple[int, int]:
    """Return ``(world_size, dp)`` for launching ``cfg`` on ``nproc`` ranks (None: derive from the config).

    ``world_size = pp * dp * sp * tp`` (docs/architecture.md, mesh). With ``dp = -1``, dp fills the ranks left.

    Raises:
        ConfigError: nproc is not divisible by ``pp*sp*tp``, or disagrees with an explicit dp.
    """
    p = cfg.parallel
    if p.sync_mode == "async":
        return _resolve_async_world(p, nproc)
    inner, names = axes.replica_size(p), axes.product_text(REPLICA_AXES)
    if nproc is None:
        dp = 1 if p.dp == -1 else p.dp
        if p.sync_mode == "local-sgd":
            dp = max(dp, 2)
        return dp * inner, dp
    _require(nproc >= 1, f"--nproc = {nproc} must be >= 1")
    _require(nproc % inner == 0,
             f"--nproc = {nproc} is not divisible by {names} = {inner}: use a multiple of {inner}")
    dp = nproc // inner
    _require(p.dp in (-1, dp),
             f"parallel.dp = {p.dp} does not match --nproc = {nproc} ({names} = {inner} gives dp = {dp}): "
             f"set --dp {dp} or --nproc {p.dp * inner}")
    if p.pp > 1:
        from meshtrain.rules.pipeline_schedules import schedule_error

        error = schedule_error(p.pp_schedule, p.pp, p.virtual_stages, cfg.batch.gradient_accumulation_steps,
                               cfg.model.n_layer, dp * p.sp, p.zero_stage)
        _require(error is None, error or "")
    _require(p.sync_mode != "local-sgd" or dp >= 2,
             f"parallel.sync_mode = 'local-sgd' needs dp >= 2 replicas to average, got dp = {dp}: use --nproc 2 or more")
    return nproc, dp


def _resolve_async_world(p: ParallelConfig, nproc: int | None) -> tuple[int, int]:
    """``(world_size, workers)`` of a parameter-server run: ``ps_servers`` server ranks plus the workers
    (``parallel.dp``; -1 = every rank that is not a server)."""
    if nproc is None:
        workers = 2 if p.dp == -1 else p.dp
        return p.ps_servers + workers, workers
    workers = nproc - p.ps_servers
    _require(workers >= 1, f"parallel.sync_mode = 'async' needs at least one worker besides parallel.ps_servers = "
                           f"{p.ps_servers} server(s), got --nproc = {nproc}: use --nproc {p.ps_servers + 1} or more")
    _require(p.dp in (-1, workers), f"parallel.dp = {p.dp} workers does not match --nproc = {nproc} with "
                                    f"{p.ps_servers} server(s) (= {workers} workers): set --dp {workers} or -1")
    return nproc, workers


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """``["--parallel.dp", "2", "--steps=10"]`` -> ``{"parallel.dp": "2", "train.steps": "10"}``.

    Accepts ``--section.key VALUE``, ``--section.key=VALUE`` and the short flags of ``SHORT_FLAGS``.

    Raises:
        ConfigError: a token that is not such a flag, or a flag without a value.
    """
    out: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"unexpected argument '{token}': overrides look like --section.key VALUE")
        name, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or (tokens[i + 1].startswith("--") and len(tokens[i + 1]) > 2):
                raise ConfigError(f"--{name} needs a value, e.g. --{name} VALUE")
            value = tokens[i + 1]
            i += 1
        if "." not in name:
            if name not in SHORT_FLAGS:
                short = ", ".join(f"--{s}" for s in SHORT_FLAGS)
                raise ConfigError(f"unknown option --{name}: {_suggest(name, list(SHORT_FLAGS))}"
                                  f"use --section.key VALUE or one of {short}")
            name = SHORT_FLAGS[name]
        out[name] = value
        i += 1
    return out
