"""The run's sections: one dataclass per ``[section]`` of a config, each key with its default and meaning, and
the value lists they take. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.axes import degrees_dataclass
from meshtrain.models.registry import ModelConfig
from meshtrain.rules.support import SUPPORTED

BUNDLED_CORPUS = Path(__file__).parents[1] / "assets" / "tinyshakespeare.txt"

COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
COMPILES = ("auto", "on", "off")
RECOMPUTES = SUPPORTED.recompute
LR_SCALINGS = ("none", "linear", "sqrt")
"""How the peak learning rate follows the global batch (``optim.lr_scaling``, :func:`meshtrain.batch_math.scaled_lr`)."""
OPTIMIZERS = ("adamw", "sgd", "muon")
"""``optim.name`` values: the rows of :data:`meshtrain.optim.table.TABLE`."""
MUON_LR_ADJUSTS = ("match_rms_adamw", "original", "none")
"""``optim.muon_lr_adjust`` values: how the learning rate of a (A, B) matrix is scaled
(:func:`meshtrain.optim.table.muon_lr_ratio`)."""
MUON_EXCHANGES = ("owner", "gather")
"""``optim.muon_exchange`` values: how a sharded matrix is orthogonalized (:mod:`meshtrain.optim.muon`)."""
MUON_NS_DTYPES = ("bfloat16", "float32")
"""``optim.muon_ns_dtype`` values: the precision of the Newton-Schulz iteration."""
PACKINGS = ("concat", "document", "pad")
OBJECTIVES = ("lm", "dpo")
"""``train.objective`` values (:mod:`meshtrain.objectives`)."""
DPO_LOSSES = ("sigmoid", "robust", "ipo")
"""``train.dpo_loss`` values (:func:`meshtrain.objectives.dpo_loss`)."""
DPO_REFERENCES = ("precomputed", "copy")
"""``train.dpo_reference`` values (:mod:`meshtrain.train.reference`)."""
"""``data.packing`` values (:mod:`meshtrain.data.packing`)."""
TOKENIZER_KINDS = ("char", "hf", "tiktoken", "sentencepiece")
"""Kinds of ``data.tokenizer`` (:mod:`meshtrain.data.tokenizers`)."""
HF_TOKENIZER_FILE = "tokenizer.json"


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
    needs a tokenizer with an EOS token (not "char"), an attention model, and a synchronous sync_mode (every
    sp_mode takes the mask). Prepared conversations (:mod:`meshtrain.data.conversations`) take
    "document" (whole conversations packed into a window, each masked to itself) or "pad" (one per sample)."""

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
    """Sequence-parallel flavour: "ulysses" (all-to-all; n_head % (tp*sp) == 0), "ring" (ring attention) or "usp"
    (Ulysses over ``sp_ulysses`` ranks inside, ring attention over ``sp / sp_ulysses`` across)."""
    sp_ulysses: int = 1
    """sp_mode "usp" only: the Ulysses degree U, which divides sp (n_head % (tp*U) == 0); the ring degree is sp / U."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: "naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble" or "zbv"
    (:mod:`meshtrain.rules.pipeline`); its micro-batches are the ``gradient_accumulation_steps``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank: 1, >= 2 for "interleaved-1f1b", 2 for "zbv"."""
    tp_sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropouts split along the sequence inside the tp group."""
    sync_mode: str = "sync"
    """How dp replicas combine their work: "sync" (gradients all-reduced every step), "local-sgd" (each
    replica steps alone, parameters averaged every ``local_sgd.steps``), "async" (a parameter server,
    :mod:`meshtrain.parallel.async_ps`, ``[parameter_server]``) or "diloco" (workers of ``diloco.group`` ranks, each a
    synchronous layout, take ``diloco.inner_steps`` alone, then an outer Nesterov step on their averaged
    pseudo-gradient, :mod:`meshtrain.parallel.diloco`). Each mode other than "sync" has its own section of keys
    (:data:`meshtrain.axes.SYNC_MODE_SECTIONS`), which keeps its defaults under another mode."""
    hierarchical_allreduce: bool = False
    """Reduce gradients inside each node first, then across nodes between one rank per node, then
    broadcast inside the node (:mod:`meshtrain.parallel.hierarchical`); DDP (zero_stage 0, tp 1) only."""


@dataclass
class LocalSGDConfig:
    """The ``[local_sgd]`` section: ``parallel.sync_mode = "local-sgd"`` (:mod:`meshtrain.parallel.local_sgd`)."""

    steps: int = 4
    """Optimizer steps between two parameter averages (H of Lin et al. 2020)."""
    warmup: int = 0
    """Synchronous steps (gradient all-reduce) before local SGD starts (post-local SGD)."""


@dataclass
class ParameterServerConfig:
    """The ``[parameter_server]`` section: ``parallel.sync_mode = "async"`` (:mod:`meshtrain.parallel.async_ps`)."""

    servers: int = 1
    """Ranks 0..servers-1 hold the parameters and the optimizer; the other ranks are workers."""
    max_staleness: int = 4
    """A gradient computed on parameters more than this many updates old is not applied."""
    stale_policy: str = "drop"
    """"drop" (workers never wait; a too-stale gradient is dropped and counted) or "wait" (workers wait for
    parameters so that no gradient is ever too stale)."""


@dataclass
class DiLoCoConfig:
    """The ``[diloco]`` section: ``parallel.sync_mode = "diloco"`` (:mod:`meshtrain.parallel.diloco`; Douillard et al.
    2023, arXiv:2311.08105; Streaming DiLoCo, Douillard et al. 2025, arXiv:2501.18512)."""

    group: int = 0
    """Ranks per worker (a multiple of pp*sp*tp that divides the world); 0 = the ranks of one node (``--nproc``)."""
    inner_steps: int = 8
    """H, inner optimizer steps between two outer steps of a fragment."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov SGD (DiLoCo's 0.7)."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (Nesterov; 0 = plain SGD)."""
    fragments: int = 1
    """F, contiguous groups of blocks synced in turn, one every H/F steps (Streaming DiLoCo); 1 = all at once."""
    delay: int = 0
    """tau, inner steps a fragment's outer all-reduce overlaps before it is applied (Streaming DiLoCo); < H/F."""
    alpha: float = 0.0
    """Mixing, local <- alpha * local + (1 - alpha) * outer weights after a fragment's outer step (0 = replace)."""
    precision: str = "fp32"
    """How the pseudo-gradients cross between workers: "fp32", "bf16" (all-reduce in bf16) or "int8" (each worker's
    quantized per row, all-gathered, averaged in fp32)."""
    lighthouse: str = ""
    """Elastic workers: the torchft lighthouse (``http://HOST:PORT``, started with ``torchft_lighthouse``) through
    which separately launched jobs, one worker each, form the outer all-reduce at every outer step; a worker may
    leave and rejoin (``--max-restarts``), the others go on (:mod:`meshtrain.parallel.diloco.elastic`). "" = the
    workers are this job's rank groups."""
    worker: int = 0
    """Elastic: this job's worker, 0 .. ``workers - 1`` (which share of the data it reads)."""
    workers: int = 0
    """Elastic: the workers of the run (the data is split in that many shares); 0 without a lighthouse."""


@dataclass
class BatchConfig:
    micro_batch_size: int = 12
    """Samples one dp replica processes in one forward/backward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """The optimizer: "adamw"; "sgd" (plain SGD, no momentum, the same schedule and weight decay as L2); or "muon"
    (orthogonalized momentum on the blocks' matrices, AdamW on the rest: docs/optimizers.md)."""
    lr: float = 1e-3
    """Peak learning rate, reached after ``warmup_steps``."""
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
    """Scale ``lr`` and ``min_lr`` with the global batch: "none", "linear" or "sqrt" (:func:`meshtrain.batch_math.scaled_lr`)."""
    reference_batch_size: int = 0
    """Global batch (samples) at which ``lr`` was tuned; needed (>= 1) when ``lr_scaling`` is not "none"."""
    fused: bool = True
    """AdamW's fastest kernels: the fused kernel (``torch.optim.AdamW(fused=True)``) where every parameter
    is a plain tensor (one rank, DDP, pp), foreach kernels where every one is a DTensor (FSDP2: the fused
    kernel fails on their resumed states); false, or a mix of both (tp), torch's default (a per-tensor
    loop on CPU). The same update up to rounding."""
    muon_momentum: float = 0.95
    """Muon's momentum (Jordan et al. 2024; ``torch.optim.Muon``'s default)."""
    muon_nesterov: bool = True
    """Muon orthogonalizes the Nesterov look-ahead ``(1 - m) g + m buf`` rather than the buffer."""
    muon_ns_steps: int = 5
    """Quintic Newton-Schulz iterations per step (Jordan et al. 2024: 5)."""
    muon_ns_dtype: str = "bfloat16"
    """Precision of Newton-Schulz: "bfloat16" (as published and as ``torch.optim.Muon``) or "float32"."""
    muon_lr_adjust: str = "match_rms_adamw"
    """Learning rate of a (A, B) matrix: "match_rms_adamw" ``0.2 * sqrt(max(A, B)) * lr`` (Liu et al. 2025, Sec. 2.2:
    AdamW's ``lr`` and ``weight_decay`` carry over), "original" ``sqrt(max(1, A / B)) * lr`` (Jordan et al. 2024),
    or "none"."""
    muon_adamw_lr: float = 0.0
    """Peak learning rate of the parameters Muon does not take (embeddings, head, norms, biases, routers), trained
    by AdamW with ``beta1``, ``beta2``; 0 = ``lr``. Follows the same schedule and batch scaling."""
    qk_clip: float = 0.0
    """QK-clip's threshold tau (MuonClip, Kimi K2 report, Sec. 2.1; K2 used 100): after each step, a head whose
    largest attention logit exceeded it has its q (and, with a key head of its own, k) projection scaled down to it
    (:mod:`meshtrain.optim.qk_clip`); 0 = off. Any optimizer; not with q/k-normalised attention or sp > 1."""
    muon_exchange: str = "owner"
    """How a matrix sharded by FSDP2 or tp is orthogonalized: "owner" (each whole matrix on one rank of those
    that hold its shards: one all-to-all gathers it, one sends the result's shards back) or "gather" (every
    rank gathers every matrix and orthogonalizes all of them: the naive way, kept for the benchmark)."""


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
    loss_chunk_mb: float = 64.0
    """fp32 MiB of logits the loss computes at once (:func:`meshtrain.cross_entropy.token_nll`): the cross-entropy runs
    over chunks of tokens and recomputes each chunk's softmax in backward, so the (tokens x vocabulary) logits never
    exist in fp32 all at once. 0 = ``F.cross_entropy`` on all of them (12 more bytes per logit held in backward).
    Under tp the vocabulary-parallel loss applies instead (docs/training.md, "Memory")."""
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
    objective: str = "lm"
    """What a step minimises (:mod:`meshtrain.objectives`): "lm", the cross-entropy over the supervised tokens of
    the global batch (every token for text; assistant tokens for prepared conversations), or "dpo", direct
    preference optimization on pairs that ``meshtrain prepare --format preference`` wrote."""
    dpo_beta: float = 0.1
    """DPO's beta (Rafailov et al. 2023, Eq. 7): how far the policy may move from the reference, > 0 (TRL's 0.1)."""
    dpo_loss: str = "sigmoid"
    """DPO's loss: "sigmoid" (DPO, Rafailov et al. 2023), "robust" (robust DPO, Chowdhury et al. 2024, with
    ``dpo_label_smoothing``) or "ipo" (IPO, Azar et al. 2023, per completion token), as TRL's loss types of those
    names."""
    dpo_label_smoothing: float = 0.0
    """The probability eps that a pair's preference is flipped, in [0, 0.5) ("robust" only; 0 = plain DPO)."""
    dpo_reference: str = "precomputed"
    """DPO's reference model, the model as training starts (:mod:`meshtrain.train.reference`): "precomputed", its
    log-probability of every train sequence computed once before step 1 (one model held; TRL's
    ``precompute_ref_log_probs``), or "copy", a frozen copy of the starting weights sharded like the policy, run
    forward on each micro-batch (two models held, an extra forward per step; the planner counts both). Equal."""
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
    fresh_optimizer: bool = False
    """On resume, load the weights, the data position and the schedule's step but start the optimizer's states
    fresh: needed to resume with another ``optim.name`` than the checkpoint's (refused otherwise)."""
    async_save: bool = False
    """Write checkpoints in the background (``torch.distributed.checkpoint.async_save``): training waits
    only while the state is copied to CPU memory, and a step becomes a checkpoint once every rank's write
    finished (:mod:`meshtrain.checkpoint.writer`). Costs a CPU copy of the model and optimizer state per rank
    while a write runs. Needs a synchronous ``parallel.sync_mode`` (not "async")."""


@dataclass
class AdapterConfig:
    """Low-rank adapters (LoRA) on a frozen base (:mod:`meshtrain.adapters`); the keys are ``peft``'s
    ``LoraConfig``'s, with its defaults."""

    lora_rank: int = 0
    """r, the adapters' rank; 0 = no adapters (every parameter trains). With r > 0 every base parameter is frozen
    (no gradient, no optimizer state) and only the adapters train."""
    lora_alpha: float = 8.0
    """alpha: the adapter's output is scaled by ``alpha / r`` (Hu et al. 2021), ``alpha / sqrt(r)`` with
    ``use_rslora``."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1) (tp = 1 only for now)."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """The modules adapted, by their Hugging Face names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``gate_proj``, ``up_proj``, ``down_proj``), or ``["all-linear"]``; peft's default for Llama and Qwen is
    ``q_proj`` and ``v_proj``. On the command line ``--adapter.lora_targets q_proj,v_proj``."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski 2023): scale by ``alpha / sqrt(r)``."""
    use_dora: bool = False
    """Weight-decomposed LoRA (DoRA, Liu et al. 2024): a trained magnitude per output feature times the direction
    ``W + (alpha / r) B A`` normalised by its rows' norms (treated as a constant, as peft does)."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (peft's ``modules_to_save``), by their Hugging Face names: the
    token embedding (``embed_tokens``) and the output head (``lm_head``); both are needed to grow the vocabulary
    with LoRA (:mod:`meshtrain.data.growth`). On the command line ``--adapter.modules_to_save embed_tokens,lm_head``."""
    quantize_base: str = "none"
    """"nf4": QLoRA (Dettmers et al. 2023): the frozen base's linear maps in the blocks stored as 4-bit NormalFloat
    with double-quantized scales (~0.52 bytes a weight) and dequantized in the forward (bitsandbytes' code:
    ``pip install 'meshtrain[qlora]'``); "none": the base in the run's dtype."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    local_sgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    parameter_server: ParameterServerConfig = field(default_factory=ParameterServerConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)

    @property
    def elastic(self) -> bool:
        """Whether this job is one elastic DiLoCo worker (``sync_mode = "diloco"`` with ``diloco.lighthouse``)."""
        return self.parallel.sync_mode == "diloco" and bool(self.diloco.lighthouse)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)
