"""A parallel layout (the degrees, batch split and schedule of one run), the software it runs on, and
the divisibility rules a layout must meet.

Terms as in docs/architecture.md: ``world_size = dp * tp * pp * sp``, ``global_batch_size = micro_batch_size *
gradient_accumulation_steps * dp`` (:mod:`meshtrain.batch_math` holds both formulas). Mesh axes are ordered
outer to inner ``(pp, dp, sp, tp)``, so a group of axis X holds ranks ``stride(X)`` apart, and spans
nodes when its extent exceeds a node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from meshtrain import axes, batch_math
from meshtrain.config.checks import check_diloco, diloco_workers, resolve_world
from meshtrain.config.sections import Config, DiLoCoConfig, ParallelConfig, TrainConfig
from meshtrain.errors import ConfigError
from meshtrain.planner.model_specs import ModelSpec
from meshtrain.planner.optimizer import OptimizerPlan
from meshtrain.rules.layout import LayoutShape, layout_errors
from meshtrain.rules.pipeline import RULES, pipeline_error
from meshtrain.rules.support import SUPPORTED, blocks_compiled, compile_eligible, zero_stage_error

from meshtrain.axes import PP_SCHEDULES, SP_MODES, ZERO_STAGES
from meshtrain.axes import RECOMPUTE_MODES as RECOMPUTE


SYNC_FIELDS = {"local_sgd_steps": ("local-sgd", "local_sgd", "steps"), "ps_servers": ("async", "parameter_server", "servers"),
               **{f"diloco_{key}": ("diloco", "diloco", key)
                  for key in ("group", "inner_steps", "fragments", "delay", "precision")}}
"""The ``Layout`` fields of a sync mode -> (the mode, its config section, the key there): taken from and given to the
config under that mode only (:meth:`Layout.from_config`, :meth:`Layout.to_overrides`)."""


LayoutDegrees = axes.degrees_dataclass("LayoutDegrees", "One degree per axis, 1 by default.", defaults="one",
                                       frozen=True)


@dataclass(frozen=True)
class Layout(LayoutDegrees):
    """One way to run a job: one degree per axis (:data:`meshtrain.axes.AXIS_TABLE`, first, in its order: ``dp,
    tp, pp, sp``), then the batch split and how the axes run. Degrees and sizes are counts; see
    docs/architecture.md for the terms."""

    zero_stage: int = 0
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    recompute: str = "none"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    """Model chunks per pipeline rank (Narayanan et al. 2021, Sec. 2.2.2): > 1 for interleaved-1f1b, 2 for zbv."""
    tp_sequence_parallel: bool = False
    """Megatron sequence parallelism in the tp regions (Korthikanti et al. 2022, Sec. 4.2.2)."""
    sp_mode: str = "ulysses"
    """How sp > 1 splits attention: "ulysses" (all-to-all), "ring" (K/V around a ring) or "usp" (both), see
    :data:`SP_MODES`."""
    sp_ulysses: int = 1
    """sp_mode "usp": ranks of its Ulysses all-to-all (a divisor of sp); the ring has sp / sp_ulysses."""
    local_sgd_steps: int = 0
    """> 0: local SGD (``parallel.sync_mode = "local-sgd"``), parameters averaged over dp every this many
    steps instead of a gradient all-reduce every step (:func:`meshtrain.planner.cost.dp_time`)."""
    hierarchical_allreduce: bool = False
    """zero_stage 0: gradients reduced inside each node, all-reduced between one rank per node, then
    broadcast (:mod:`meshtrain.parallel.hierarchical`)."""
    ps_servers: int = 0
    """> 0: an asynchronous parameter-server run (``sync_mode = "async"``): ``dp`` workers plus this many
    server ranks; a "step" is one received gradient of one worker's batch (:func:`cost.async_step_time`)."""
    diloco_group: int = 0
    """> 0: DiLoCo (``sync_mode = "diloco"``): workers of this many ranks, data-parallel over ``dp / workers``
    inside, exchanging pseudo-gradients every ``diloco_inner_steps`` steps (:func:`cost.diloco_time`)."""
    diloco_inner_steps: int = 8
    """DiLoCo's H (with ``diloco_group``)."""
    diloco_fragments: int = 1
    """Streaming DiLoCo's F: fragments exchanged in turn, each 1/F of the weights every H/F steps."""
    diloco_delay: int = 0
    """Streaming DiLoCo's tau: inner steps a fragment's exchange overlaps."""
    diloco_precision: str = "fp32"
    """How pseudo-gradients cross: "fp32", "bf16" or "int8" (:data:`meshtrain.axes.OUTER_PRECISIONS`)."""

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> Layout:
        """The layout a training config runs with on ``world_size`` ranks (the trainer's ``--nproc``).

        Every field ``Layout`` shares by name with :class:`~meshtrain.config.sections.ParallelConfig` or
        :class:`~meshtrain.config.sections.BatchConfig`, or with a sync mode's section under its prefix
        (:data:`SYNC_FIELDS`: ``diloco_inner_steps`` is ``diloco.inner_steps``), is taken from the config as it is;
        only the fields whose meaning differs are spelled out here:

        - ``dp``: the resolved data-parallel degree (:func:`meshtrain.config.checks.resolve_world`; the
          config's -1 fills the ranks; with ``sync_mode = "async"``, the number of workers);
        - ``local_sgd_steps`` (``local_sgd.steps``): the config's only with ``sync_mode = "local-sgd"``, else 0 (every
          step syncs);
        - ``ps_servers`` (``parameter_server.servers``): the config's only with ``sync_mode = "async"``, else 0 (no
          parameter server);
        - ``diloco_group`` (``diloco.group``) and DiLoCo's other fields: the config's only with ``sync_mode =
          "diloco"``, else the group 0 (no DiLoCo) and the others their defaults;
        - ``recompute``: the config's ``train.recompute``;
        - ``micro_batch_size``: in sequences: with ``train.objective = "dpo"`` twice the config's (a pair is a chosen
          and a rejected sequence, :class:`meshtrain.data.conversations.Pairs`).

        Raises:
            ConfigError: ``world_size`` does not suit the config (:func:`meshtrain.config.checks.resolve_world`).
        """
        p = cfg.parallel
        _, dp = resolve_world(cfg, world_size)
        names = {f.name for f in fields(cls)}
        values = {f.name: getattr(section, f.name) for section in (p, cfg.batch) for f in fields(section)
                  if f.name in names}
        values.update({name: getattr(getattr(cfg, section), key) for name, (mode, section, key) in SYNC_FIELDS.items()
                       if mode == p.sync_mode})
        values["micro_batch_size"] *= sequences_per_sample(cfg)
        values.update(dp=dp, recompute=cfg.train.recompute)
        return cls(**values)

    def to_overrides(self) -> dict[str, str]:
        """The ``meshtrain train`` overrides (``section.key`` -> value text) that run this layout: the inverse
        of :meth:`from_config`. Fields shared by name with :class:`~meshtrain.config.sections.ParallelConfig` or
        :class:`~meshtrain.config.sections.BatchConfig` as they are, ``dp`` as ``parallel.dp``, ``recompute`` as
        ``train.recompute``; ``local_sgd_steps``, ``ps_servers`` and ``diloco_group`` (with DiLoCo's other keys) only
        when set (with the ``sync_mode`` they imply); otherwise ``sync_mode = "sync"``.

        Raises:
            ValueError: a field the trainer has no key for holds another value than its default (a layout of
                another framework's, e.g. from ``--framework megatron-core``).
        """
        from meshtrain.config.sections import BatchConfig

        keys = {f.name: f"parallel.{f.name}" for f in fields(ParallelConfig)} | {
            f.name: f"batch.{f.name}" for f in fields(BatchConfig)} | {"recompute": "train.recompute"}
        out = {"parallel.sync_mode": self.sync_mode}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SYNC_FIELDS:
                mode, section, key = SYNC_FIELDS[f.name]
                if mode == self.sync_mode:
                    out[f"{section}.{key}"] = str(value)
            elif f.name in keys:
                out[keys[f.name]] = str(value).lower() if isinstance(value, bool) else str(value)
            elif value != f.default:
                raise ValueError(f"layout field {f.name} = {value!r} has no key in the trainer's config")
        return out

    @property
    def sync_mode(self) -> str:
        """The ``parallel.sync_mode`` this layout runs: "local-sgd", "async" or "diloco" when its field is set, else
        "sync"."""
        return ("local-sgd" if self.local_sgd_steps else "async" if self.ps_servers else
                "diloco" if self.diloco_group else "sync")

    @property
    def world_size(self) -> int:
        return axes.world_size(self) + self.ps_servers

    @property
    def diloco_workers(self) -> int:
        """DiLoCo's workers, ``world_size / diloco_group`` (1 without DiLoCo)."""
        return self.world_size // self.diloco_group if self.diloco_group else 1

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step (:func:`meshtrain.batch_math.global_batch_size`; per parameter-server
        update: one worker's batch, so dp counts 1)."""
        return batch_math.global_batch_size(self.micro_batch_size, self.gradient_accumulation_steps,
                                       1 if self.ps_servers else self.dp)

    def spans_nodes(self, axis: str, devices_per_node: int) -> bool:
        """Whether a group along ``axis`` crosses a node boundary (axes outer to inner: pp, dp, sp, tp)."""
        return self.inner_degree(axis) * getattr(self, axis) > devices_per_node

    def inner_degree(self, axis: str) -> int:
        """Product of the degrees of the axes inside ``axis`` (outer to inner: pp, dp, sp, tp): the rank
        stride of a group along it."""
        return axes.stride(self, axis)

    def ranks_per_node(self, axis: str, devices_per_node: int) -> int:
        """Ranks of one group along ``axis`` that share a node: ``min(degree, devices_per_node // inner)``,
        at least 1 (``inner`` = product of the degrees inside it, axes outer to inner: pp, dp, sp, tp)."""
        return max(1, min(getattr(self, axis), devices_per_node // self.inner_degree(axis)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        """Short text such as ``dp8 tp8 pp2 sp1 z1 mbs1 ga4 full 1f1b`` (``sp2ring`` for ring attention, ``sp4usp2``
        for USP with 2 Ulysses ranks,
        ``dp8hier`` for a hierarchical all-reduce, ``dp8H4`` for local SGD averaging every 4 steps, ``dp8/W2H32`` for
        DiLoCo's 2 workers exchanging every 32 steps)."""
        sched = ""
        if self.pp > 1:
            sched = f" {self.pp_schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        degrees = " ".join(f"{a}{self._axis_label(str(a))}" for a in axes.SHORT_FLAGS
                           if axes.SPECS[a].in_world or axes.degree(self, a) > 1)  # ep only where it is on
        return (f"{degrees} z{self.zero_stage} mbs{self.micro_batch_size} ga{self.gradient_accumulation_steps} "
                f"{self.recompute}{sched}")

    def _axis_label(self, axis: str) -> str:
        """An axis's degree in :meth:`label`, with what runs it: dp's hierarchical all-reduce (``hier``), local SGD
        (``H4``) and servers (``+1ps``), tp's Megatron-SP (``+sp``), sp's ring attention (``ring``)."""
        text = str(axes.degree(self, axis))
        if axis == "dp":
            text += ("hier" if self.hierarchical_allreduce else "") + (f"H{self.local_sgd_steps}" if self.local_sgd_steps else "")
            text += f"+{self.ps_servers}ps" if self.ps_servers else ""
            if self.diloco_group:
                streaming = f"F{self.diloco_fragments}t{self.diloco_delay}" if self.diloco_fragments > 1 else ""
                text += f"/W{self.diloco_workers}H{self.diloco_inner_steps}{streaming}"
        elif axis == "tp" and self.tp_sequence_parallel:
            text += "+sp"
        elif axis == "sp" and self.sp > 1 and self.sp_mode == "ring":
            text += "ring"
        elif axis == "sp" and self.sp > 1 and self.sp_mode == "usp":
            text += f"usp{self.sp_ulysses}"
        return text


ATTENTION_KERNELS = ("flash", "flash2", "flash-triton", "materialized")
"""The attention kernels the cost model tells apart (``Framework.attention``)."""


@dataclass(frozen=True)
class Framework:
    """What the training software does, which the cost model depends on (facts, not fitted constants).

    - ``attention``: "flash" (scores never reach HBM; Dao et al. 2022; at the GEMM rate: FlashAttention-3, cuDNN),
      "flash2" (FlashAttention-2, Dao 2023, or PyTorch SDPA's flash backend: below the GEMM rate on Hopper,
      ``Device.flash2_efficiency``), "flash-triton" (FlashAttention in Triton, slower than FlashAttention-2 by
      ``hardware.FLASH_TRITON_SLOWDOWN``) or "materialized" (the s x s scores are written, soft-maxed and read
      back: Megatron-LM's fused softmax, 2021).
    - ``tp_comm_overlap``: tp collectives hidden behind the GEMMs they feed (Megatron-Core
      ``--tp-comm-overlap``; Wang et al. 2023, "Overlap communication with dependent computation").
    - ``dp_comm_overlap``: gradient reduction overlapped with backward and weight gathers with compute
      (PyTorch DDP buckets, Li et al. 2020, Sec. 3.2.3; FSDP prefetch; Megatron-Core ``--overlap-grad-reduce``).
    - ``sequence_parallel``: Megatron sequence parallelism exists (Korthikanti et al. 2022; not in 2021).
    - ``mixed_precision``: the precision of a "16-bit" run (see :data:`memory.PRECISIONS`).
    - ``zero_stages``, ``pp_schedules``, ``recompute`` (activation recomputation modes), ``sp_modes``
      and ``tensor_parallel``: what the software can run; ``attention_dropout_sp_modes``: the sp modes
      that run a model with attention dropout.
    - ``torch_buffers``: PyTorch DDP's gradient bucket copy (``gradient_as_bucket_view=False``) and the
      foreach AdamW temporaries exist.
    - ``grad_bucket_bytes``: gradients per data-parallel all-reduce at zero_stage 0 (PyTorch DDP
      ``bucket_cap_mb=25``; Megatron-Core buckets of 40M parameters; Megatron-LM 2021 one contiguous buffer).
    - ``grad_first_bucket_bytes``: a smaller first bucket, so that the first all-reduce starts early
      (PyTorch DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB); 0 = all buckets of ``grad_bucket_bytes``.
    - ``fsdp_unit_bytes``: ZeRO-3/FSDP groups consecutive blocks into one unit (one all-gather, one
      reduce-scatter) until it holds this many bytes of fp32 parameters (:func:`meshtrain.rules.support.fsdp_units`,
      the trainer's ``parallel.fsdp_unit_mb``, 25 MiB by default); 0 = one unit per block (torchtitan,
      FSDP's transformer auto-wrap policy).
    - ``grad_sync_every_microstep``: gradients are reduced after every micro-batch (FSDP in Composer) instead
      of only the last (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``).
    - ``cross_entropy_bytes``: HBM bytes per logit of the loss, forward + backward, after the logits GEMM.
      24 = six passes over fp32 values (cast, max, exp-sum, loss; backward 2) for a fused PyTorch loss.
      Megatron's vocab-parallel cross-entropy (Megatron-LM 2021 ``mpu/cross_entropy.py`` on
      ``output.float()``; Megatron-Core r0.8 ``tensor_parallel/cross_entropy.py``, whose fused variant
      ``--cross-entropy-loss-fusion`` is opt-in) runs one PyTorch kernel per step:
      cast 16-bit logits to fp32 (read 2, write 4), max (read 4), subtract in place (8), exp in place (8),
      sum (4), divide in place (8); backward multiply in place (8) and cast the gradient back (6): 52.
    """

    name: str
    attention: str = "flash"
    tp_comm_overlap: bool = False
    dp_comm_overlap: bool = True
    sequence_parallel: bool = True
    mixed_precision: str = "bf16"
    zero_stages: tuple[int, ...] = ZERO_STAGES
    pp_schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "gpipe", "zero-bubble")
    recompute: tuple[str, ...] = RECOMPUTE
    sp_modes: tuple[str, ...] = ("ulysses",)
    attention_dropout_sp_modes: tuple[str, ...] = SP_MODES
    tensor_parallel: bool = True
    torch_buffers: bool = False
    grad_bucket_bytes: float = 25 * 2**20
    grad_first_bucket_bytes: float = 0.0
    fsdp_unit_bytes: float = 0.0
    grad_sync_every_microstep: bool = False
    cross_entropy_bytes: float = 24.0
    hierarchical_allreduce: bool = False
    """The zero_stage-0 gradient all-reduce can run hierarchically (node leaders only cross nodes)."""
    zero1_ddp_only: bool = False
    """zero_stage 1 only at tp = pp = 1 (meshtrain's ZeroRedundancyOptimizer, :func:`zero_stage_error`)."""
    replicates_kv_heads: bool = True
    """Whether tp may exceed the kv heads of grouped-query attention, each kv head replicated over ``tp / kv_heads``
    ranks (Megatron-LM's ``num_query_groups``); False: tp splits whole kv heads (meshtrain,
    :mod:`meshtrain.rules.layout`)."""
    expert_folding: bool = False
    """How expert parallelism meets tp. False (meshtrain, :mod:`meshtrain.parallel.expert`): ``ep`` borrows ranks from
    dp x sp only, and every tp rank runs the whole router and experts on the same tokens (replicated over tp).
    True (Megatron-Core's MoE parallel folding with expert tensor parallelism 1, Liu et al. 2025, arXiv 2504.14960,
    Sec. 3): the ep group is folded into the tp x dp x sp ranks, each tp rank routes its own s/tp tokens (sequence
    parallelism) to whole experts, so the routed work, its activations and its all-to-all rows are 1/tp per rank and the
    experts' ZeRO-sharded states are spread over tp x dp x sp ranks; ep must divide tp*dp*sp."""
    ep_dispatch: str = "all-to-all"
    """How a mixture of experts' tokens reach the experts of other ranks: "all-to-all" (one copy per chosen expert
    through an all-to-all: GShard; meshtrain, Megatron's alltoall dispatcher) or "node-limited" (DeepEP, the dispatch
    DeepSeek-V3 trained with, V3 report arXiv:2412.19437, Sec. 3.2.2: a token crosses to each destination node once,
    over its NIC, and is forwarded inside the node over NVLink: :func:`meshtrain.planner.cost.dispatch_time`)."""
    ep_comm_overlap: bool = False
    """Whether expert parallelism's dispatch and combine run beside other micro-batches' compute (Megatron-Core's
    ``--overlap-moe-expert-parallel-comm``, a forward's all-to-all beside another's backward in 1F1B; DeepSeek's
    DualPipe, V3 report Sec. 3.2.1): exposed only beyond a block's compute (:func:`meshtrain.planner.cost.overlapped`)."""
    mla_up_proj_recompute: bool = False
    """Whether multi-head latent attention's up-projections (and latent norms) run again in backward, so that a layer
    keeps the latents instead of every head's q, k and v (DeepSeek-V3 report, Sec. 3.2.3; Megatron-Core's
    ``--recompute-modules mla_up_proj``): :func:`meshtrain.planner.model_specs.mla_saved_widths`."""
    norm_recompute: bool = False
    """Whether the blocks' RMSNorms run again in backward, so that a layer keeps their inputs (the residual stream) but
    not their outputs, the inputs of the attention's and the MLP's first GEMMs (DeepSeek-V3 report, Sec. 3.2.3,
    "Recomputation of RMSNorm"; Megatron-Core's ``--recompute-modules layernorm``):
    :func:`meshtrain.planner.memory.layer_activation_bytes`."""
    moe_act_recompute: bool = False
    """Whether the experts' (routed and shared) SwiGLU output runs again in backward from its kept inputs, so that the
    down-projection's input is not kept (DeepSeek-V3 report, Sec. 3.3.3, "Inputs of the SwiGLU operator in MoE";
    Megatron-Core's ``--recompute-modules moe_act``)."""
    fp8: bool = False
    """DeepSeek-V3's FP8 mixed precision (V3 report, Sec. 3.3): the Linear operators' three GEMMs (forward, input
    gradient, weight gradient) at the device's FP8 rate (:data:`meshtrain.planner.hardware.FP8_PEAKS`), the
    embedding, the head, the attention kernel and the norms in 16 bits; the Linear inputs cached in FP8 with their
    1x128 tiles' fp32 scales (:data:`meshtrain.planner.memory.FP8_CACHED_BYTES`), the attention output (the output
    projection's input) in E5M6 (1.5 bytes); AdamW's moments in bf16 beside fp32 master weights and gradients
    (:data:`meshtrain.planner.memory.PRECISIONS` "fp8"); the MoE dispatch in FP8 and the combine in bf16. MFU stays
    against the bf16 peak (so an FP8 run can pass 100% of it in principle)."""
    pp_bubble: str = ""
    """A pipeline schedule of the framework's own whose bubble replaces the layout's schedule's: "dualpipe"
    (DeepSeek-V3 report, Sec. 3.2.1 and Table 2: ``(PP/2 - 1)(F&B + B - 3W)`` idle per step, two copies of the
    parameters, ``PP + 1`` micro-batches of activations: :func:`meshtrain.planner.cost.bubble_time`), "zb1p" (zero-bubble
    H1, Qi et al. 2024, as DeepSeek-V2's HAI-LLM ran it under ZeRO-1: 1F1B's memory); "" = none."""
    selective: str = "attention-core"
    """What ``recompute = "selective"`` recomputes: "attention-core", Korthikanti et al. 2022, Sec. 5 (the
    attention scores' QK^T, softmax, dropout and AV; Megatron-LM), "op-level", meshtrain's per-operator
    selective checkpointing (:mod:`meshtrain.parallel.recompute`: GEMM, attention-kernel and tp/sp collective
    outputs kept, every other operator recomputed), which the zero-bubble schedules do not run
    (:func:`selective_runs`), or "op-level-alternate", torchtitan's: the same but only every other GEMM's output
    kept and of the collectives only the reduce-scatters' (:func:`meshtrain.planner.memory.alternate_saved_bytes`)."""
    eager_elementwise: tuple[float, float, float, float] | None = None
    """Bytes per token and layer that the element-wise kernels of an eager Llama block move, forward and backward
    together, as ``(a, b, c, d)``: ``a*h + b*kv + c*f`` with grouped K/V, ``(a + b - d)*h + c*f`` without (no
    ``repeat_kv`` copies and backward sums); 16-bit activations, the attention kernel and GEMMs excluded; counted
    operator by operator from the framework's own block under torch's dispatcher (``bench/eager_elementwise.py``,
    ``bench/results/eager_elementwise.md``). None: one fused kernel per norm, activation and residual add
    (:func:`meshtrain.planner.cost._elementwise_bytes_per_token`; what torch.compile gets close to, and within 11%
    of meshtrain's eager GPT block, whose LayerNorm and GELU are single kernels). Llama blocks:

    - torchtitan's of December 2024 (``models/llama/model.py`` and ``models/norms.py`` at commit 9dec370, bf16):
      its RMSNorm in fp32 (casts, pow, mean, rsqrt, two multiplies), RoPE through fp32 complex views,
      ``repeat_kv`` copies, SwiGLU's silu and product, the residual adds and their backward kernels:
      ``(358, 44, 28, 16)``, 3.8x the fused count for Llama 3 8B;
    - meshtrain's (``models.llama``, counted in fp32, halved): torch's composite RMSNorm, RoPE by halves
      (multiplies, negation, concatenation), ``repeat_kv``, SwiGLU: ``(218, 52, 28, 24)``.

    Both counts are exactly linear in h, kv and f (residual 0 over ten widths), up to a few per-token scalars."""
    pp_split: str = "uniform"
    """How the model is cut into pipeline stages (:func:`meshtrain.planner.memory.stage_loads`): "uniform", ``ceil(L / pp)``
    blocks on the busiest stage and the head beside them (Megatron-LM's split, and Megatron-DeepSpeed's default
    ``type:transformer``); "balanced", the contiguous split of ``[embedding, blocks, head]`` that minimises the
    costliest chunk (the trainer's, :mod:`meshtrain.parallel.pipeline.balance`, so the planner's busiest stage is the
    one it runs); "ends-as-blocks", the embedding and the head counted as one block each and the items spread evenly
    (DeepSpeed's ``partition_method = "type:transformer|embedding"``, as BLOOM ran)."""
    ring_fused: bool = False
    """Context parallelism (``sp_mode = "ring"``) runs each chunk pair through the fused attention kernel on GPUs too:
    Megatron-Core's (Transformer Engine's attention with K/V passed around the ring, one fused call per step) and
    torchtitan's (torch's ``context_parallel``, SDPA per chunk). False: the trainer's ``RingAttention``, which on a GPU
    runs each pair as plain GEMMs and a softmax (fused only on a CPU)."""
    repeats_kv: bool = False
    """Grouped-query attention's K and V are repeated to the query heads before the attention kernel, which then
    keeps them at the query width (meshtrain's ``models.gpt.repeat_kv``, torchtitan's ``repeat_kv`` in its Llama);
    False: the kernel takes the kv heads as they are (Megatron-Core with Transformer Engine)."""
    swiglu_keeps_activation: bool = False
    """An eager ``down(silu(gate(x)) * up(x))`` keeps four f-wide tensors for backward (gate's output for silu's,
    silu's output and up's output for the product's, the product for down's); a fused SwiGLU (Megatron's
    ``bias_swiglu``) keeps three."""
    loss_backward_bytes: float = 12.0
    """Bytes per logit the loss holds while its backward runs. PyTorch's ``F.cross_entropy(logits.float())``
    (meshtrain, torchtitan) keeps the fp32 log-softmax for backward (4); its backward writes the fp32 gradient of
    the log-softmax (``nll_loss_backward``, 4) and then of the logits (``_log_softmax_backward_data``, 4): 12.
    Megatron's vocab-parallel cross-entropy keeps the fp32 softmax (4), turns it into the gradient in place and
    casts that to 16 bits (2): 6. Each micro-batch waiting for its backward holds 4 of them. Measured on the
    logits alone with torch's profiler (``tests/test_planner_memory_mechanisms.py``)."""
    loss_parallel_bytes: float = 16.0
    """``loss_backward_bytes`` under tp > 1, per logit of the rank's vocabulary slice: torch's ``loss_parallel``
    (meshtrain, torchtitan) computes the log-softmax of a vocab-sharded DTensor from fp32 temporaries (the shifted
    logits, their exp) and its backward from ``exp(log-softmax)``: 16, measured as ``loss_backward_bytes``.
    Megatron's vocab-parallel cross-entropy is the same at every tp: 6."""
    loss_chunk_bytes: float = 0.0
    """The chunked cross-entropy (:func:`meshtrain.cross_entropy.token_nll`, ``train.loss_chunk_mb``): fp32 bytes of
    logits one chunk computes at once; 0 = not chunked (``loss_backward_bytes``). Chunked, the loss keeps only the
    logits (``e`` bytes each) for its backward, which writes their gradient (``e``) one chunk at a time: ``2e`` per
    logit plus one chunk's fp32 softmax, and with 16-bit logits one more chunk (their fp32 upcast);
    each micro-batch waiting for its backward holds its logits (``e``) instead of the fp32 log-softmax (4). Under tp the
    vocabulary-parallel loss runs instead (``loss_parallel_bytes``). Measured tensor by tensor with torch's
    ``MemTracker`` (``tests/test_chunked_loss.py``)."""
    master_shards: bool = False
    """ZeRO-3's shards are the fp32 master weights, cast to 16 bits only when gathered: PyTorch FSDP's
    ``MixedPrecision(param_dtype=bfloat16)`` (FSDP1, ``_FlatParameter`` kept in the model's fp32) and FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bfloat16)`` (the sharded DTensor stays fp32; torchtitan, OLMo-core, Composer's
    ``mixed_precision: PURE``). A trained parameter then costs 4 (shard) + 4 (fp32 gradient shard) + 8 (Adam) bytes
    at rest, not 2 + 4 + 12 with a separate 16-bit copy (:func:`meshtrain.planner.memory.shard_bytes`)."""
    optimizer: OptimizerPlan = OptimizerPlan()
    """The run's optimizer (``optim.name`` and Muon's keys, :class:`meshtrain.planner.optimizer.OptimizerPlan`): its
    states per parameter (memory) and its step's time (:func:`meshtrain.planner.cost.optimizer_parts`); AdamW
    unless a config says otherwise (:func:`meshtrain_framework`)."""

    @property
    def per_operator_selective(self) -> bool:
        """Whether ``recompute = "selective"`` is per-operator checkpointing ("op-level", "op-level-alternate":
        activations kept by a policy over the operators, no attention-core recomputation; not run by the
        zero-bubble schedules, :func:`selective_runs`)."""
        return self.selective.startswith("op-level")

    def expert_fold(self, tp: int) -> int:
        """How many tp ranks share one rank's tokens for the routed experts: ``tp`` with :attr:`expert_folding`
        (Megatron's parallel folding: each tp rank routes its own s/tp tokens), else 1 (meshtrain replicates them)."""
        return tp if self.expert_folding else 1

    def grad_buckets(self, nbytes: float) -> int:
        """Number of zero_stage-0 all-reduces for ``nbytes`` of gradients (at least 1)."""
        first = min(self.grad_first_bucket_bytes, nbytes)
        return (1 if first else 0) + max(0 if first else 1, math.ceil((nbytes - first) / self.grad_bucket_bytes))


PP_SPLITS = ("uniform", "balanced", "ends-as-blocks")
"""The pipeline splits a framework may cut by (``Framework.pp_split``)."""

MEGATRON_CE_BYTES = 2 + 4 + 4 + 8 + 8 + 4 + 8 + 8 + 6
"""Bytes per logit of Megatron's unfused vocab-parallel cross-entropy, forward + backward (see ``Framework``)."""

MESHTRAIN = Framework("meshtrain", replicates_kv_heads=False, sequence_parallel=SUPPORTED.tp_sequence_parallel, zero_stages=SUPPORTED.zero_stages,
                      pp_schedules=SUPPORTED.pp_schedules, recompute=SUPPORTED.recompute,
                      sp_modes=SUPPORTED.sp_modes,
                      attention_dropout_sp_modes=SUPPORTED.attention_dropout_sp_modes, tensor_parallel=SUPPORTED.tp,
                      torch_buffers=True, grad_first_bucket_bytes=2**20,
                      fsdp_unit_bytes=ParallelConfig.fsdp_unit_mb * 2**20,
                      hierarchical_allreduce=SUPPORTED.hierarchical_allreduce, zero1_ddp_only=SUPPORTED.zero1_ddp_only,
                      selective="op-level", repeats_kv=True, swiglu_keeps_activation=True,
                      eager_elementwise=(218.0, 52.0, 28.0, 24.0), pp_split="balanced",
                      loss_chunk_bytes=TrainConfig.loss_chunk_mb * 2**20)
"""The trainer: its features are the table of :mod:`meshtrain.rules.support` (the one config validation reads),
so ``meshtrain plan`` never ranks a layout that ``meshtrain train`` rejects."""



def meshtrain_framework(cfg: Config, device_type: str = "cuda") -> Framework:
    """The trainer as ``cfg`` sets it up on ``device_type`` ("cpu"/"cuda"): its FSDP2 unit size
    (``parallel.fsdp_unit_mb``), its optimizer (``[optim]``), and fused element-wise kernels where its blocks are compiled
    (:func:`meshtrain.rules.support.blocks_compiled`), eager ones (``eager_elementwise``) where not. Compiled, it is
    named as the stack ``meshtrain+compile`` (:func:`meshtrain.planner.stack.parse_stack`), so that its fitted speed
    (:func:`meshtrain.planner.stack.speed_for`) is the compiled runs', not the eager ones'."""
    p = cfg.parallel
    compiled = blocks_compiled(cfg.train.compile, compile_eligible(cfg.model.type, p.sync_mode),
                               device_type)
    return replace(MESHTRAIN, name="meshtrain+compile" if compiled else MESHTRAIN.name,
                   fsdp_unit_bytes=p.fsdp_unit_mb * 2**20,
                   eager_elementwise=None if compiled else MESHTRAIN.eager_elementwise,
                   optimizer=OptimizerPlan.from_config(cfg.optim), loss_chunk_bytes=cfg.train.loss_chunk_mb * 2**20)


FRAMEWORKS = {f.name: f for f in (
    MESHTRAIN,
    # context parallelism: Transformer Engine's attention with K/V passed around a ring (cp_comm_type "p2p", the default)
    Framework("megatron-core", tp_comm_overlap=True, zero_stages=(0, 1), pp_schedules=("1f1b", "interleaved-1f1b"),
              sp_modes=("ulysses", "ring"), ring_fused=True, expert_folding=True, grad_bucket_bytes=40e6 * 4, cross_entropy_bytes=MEGATRON_CE_BYTES, loss_backward_bytes=6.0, loss_parallel_bytes=6.0),
    Framework("megatron-2021", attention="materialized", dp_comm_overlap=False, sequence_parallel=False,
              mixed_precision="fp16", zero_stages=(0,), pp_schedules=("1f1b", "interleaved-1f1b"),
              grad_bucket_bytes=float("inf"), cross_entropy_bytes=MEGATRON_CE_BYTES, loss_backward_bytes=6.0, loss_parallel_bytes=6.0),
    # Megatron-LM as Korthikanti et al. 2022 ran it: sequence parallelism and selective recomputation are
    # new, attention still writes the s x s scores (which is what selective recomputation recomputes, their
    # Sec. 5), no tp/dp communication overlap yet (that came with Megatron-Core and Transformer Engine).
    Framework("megatron-2022", attention="materialized", dp_comm_overlap=False, zero_stages=(0,),
              pp_schedules=("1f1b", "interleaved-1f1b"), grad_bucket_bytes=float("inf"),
              cross_entropy_bytes=MEGATRON_CE_BYTES, loss_backward_bytes=6.0, loss_parallel_bytes=6.0),
    # Megatron-DeepSpeed as Megatron-Turing NLG 530B ran it (Smith et al. 2022, Sec. 2.2-2.4): Megatron-LM's tensor
    # parallelism and materialized attention of 2021, DeepSpeed's pipeline engine (1F1B only) and ZeRO-1 data
    # parallelism, gradients reduced after the pipeline's flush (nothing to hide them behind); recomputation of whole
    # blocks only (selective recomputation came in 2022)
    Framework("megatron-deepspeed", attention="materialized", dp_comm_overlap=False, sequence_parallel=False,
              zero_stages=(0, 1), pp_schedules=("1f1b",), recompute=("none", "full"), grad_bucket_bytes=float("inf"),
              cross_entropy_bytes=MEGATRON_CE_BYTES, loss_backward_bytes=6.0, loss_parallel_bytes=6.0),
    # llm-foundry's MPT benchmarks (Composer's FSDP) of 2023: scripts/train/benchmarking/submit_benchmarks.py at
    # 061f2c7c (the tables' commit) sets attn_impl 'triton' by default, MPT's FlashAttention in Triton
    # Its loss is flash_attn's fused cross-entropy (llmfoundry/models/mpt/modeling_mpt.py at 061f2c7c: loss_fn
    # 'fused_crossentropy' by default, flash_attn.losses.cross_entropy.CrossEntropyLoss): it saves the 16-bit logits
    # and a per-row fp32 log-sum-exp, and its backward (xentropy_cuda_lib, inplace_backward=False) writes a 16-bit
    # gradient: 2 + 2 bytes per logit
    Framework("fsdp", attention="flash-triton", zero_stages=(0, 2, 3), pp_schedules=("1f1b",),
              grad_sync_every_microstep=True, master_shards=True, loss_backward_bytes=4.0),
    # torchtitan (pytorch/torchtitan, FSDP2 one unit per block, docs/fsdp.md): its "selective op" activation
    # checkpointing saves every other matmul's, the attention kernel's and the reduce-scatters' outputs and
    # recomputes the rest (op-level-alternate); context parallelism is ring attention.
    Framework("torchtitan", zero_stages=(0, 3), selective="op-level-alternate", sp_modes=("ring",), ring_fused=True,
              repeats_kv=True, master_shards=True,
              swiglu_keeps_activation=True, eager_elementwise=(358.0, 44.0, 28.0, 16.0)),
    # the same under torch.compile (train.compile / --training.compile), whose fused element-wise kernels are
    # what the default count models
    Framework("torchtitan-compile", zero_stages=(0, 3), selective="op-level-alternate", sp_modes=("ring",),
              ring_fused=True, repeats_kv=True, swiglu_keeps_activation=True, master_shards=True),
    # OLMo-core (allenai/OLMo-core at e27ba74, 2024-11): FSDP2 one unit per block (Transformer.apply_fsdp), compiled
    # blocks, K/V repeated to the query heads (nn/attention.py), gradients reduce-scattered after every micro-batch
    # (train/trainer.py skips the sync of non-final micro-batches only under DDP), and a compiled loss
    # (compile_loss = True), which holds only the 16-bit gradient of the logits for backward (measured:
    # tests/test_planner_memory_mechanisms.py)
    Framework("olmo-core", zero_stages=(0, 3), repeats_kv=True, swiglu_keeps_activation=True,
              grad_sync_every_microstep=True, loss_backward_bytes=2.0, master_shards=True),
)}


def layout_shape(model: ModelSpec) -> LayoutShape:
    """What the layout rules read of ``model`` (:class:`meshtrain.rules.layout.LayoutShape`): tp splits the dense MLP's
    width, and leaves experts whole."""
    return LayoutShape(f"model {model.name!r}", heads=model.heads, kv_heads=model.kv_heads,
                       ffn_hidden=0 if model.experts else model.ffn_hidden, seq_len=model.seq_len, experts=model.experts,
                       nf4_base=bool(model.nf4_layer_params))


def divisibility_errors(model: ModelSpec, layout: Layout, global_batch_size: int | None = None,
                        schedule: bool = True) -> list[str]:
    """Every rule ``layout`` breaks for ``model`` in any framework, as one line each (empty list: some framework runs
    it; :func:`framework_errors` adds what a given one refuses beyond these).

    The model's rules are the trainer's rule book (:func:`meshtrain.rules.layout.layout_errors`) with every other
    stack's difference allowed (kv heads replicated past tp, expert ranks folded into tp); then the pipeline
    schedule's (:func:`meshtrain.rules.pipeline.pipeline_error`; ``schedule=False`` leaves out those on the
    micro-batch split), the values each key may take, DiLoCo's, and the global batch.
    """
    L, e = layout, axes.degree_errors(layout)
    for key in ("micro_batch_size", "gradient_accumulation_steps", "virtual_stages"):
        if getattr(L, key) < 1:
            e.append(f"{key} = {getattr(L, key)} must be >= 1")
    if e:
        return e
    if L.sp_mode not in SP_MODES:
        e.append(f"sp_mode = {L.sp_mode!r} is not one of {', '.join(SP_MODES)}")
    e += layout_errors(layout_shape(model), L, L.dp, L.sync_mode, replicate_kv_heads=True, expert_folding=True)
    if L.pp_schedule not in PP_SCHEDULES:
        e.append(f"pp_schedule = {L.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    elif schedule or L.pp == 1:
        error = pipeline_error(L.pp_schedule, L.pp, L.virtual_stages, L.gradient_accumulation_steps, model.layers,
                               L.dp * L.sp, L.zero_stage)
        e += [error] if error else []
    if L.recompute not in RECOMPUTE:
        e.append(f"recompute = {L.recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if L.zero_stage not in ZERO_STAGES:
        e.append(f"zero_stage = {L.zero_stage} is not one of 0, 1, 2, 3")
    e += _diloco_errors(L)
    if global_batch_size is not None and L.global_batch_size != global_batch_size:
        e.append(f"micro_batch_size*gradient_accumulation_steps*dp = {L.micro_batch_size}*"
                 f"{L.gradient_accumulation_steps}*{L.dp} = {L.global_batch_size} != global_batch_size = {global_batch_size}")
    return e


def _diloco_errors(L: Layout) -> list[str]:
    """DiLoCo's rules on a layout: the trainer's own (:func:`meshtrain.config.checks.check_diloco` and
    :func:`meshtrain.config.checks.diloco_workers`), run on the layout's degrees and DiLoCo fields; the first broken."""
    if not L.diloco_group:
        return []
    if L.local_sgd_steps or L.ps_servers or L.hierarchical_allreduce:
        return ["diloco_group replaces the other sync modes and the hierarchical all-reduce: set only one"]
    cfg = Config()
    for axis in axes.AXIS_TABLE:
        setattr(cfg.parallel, str(axis.axis), getattr(L, str(axis.axis)))
    cfg.parallel.sync_mode, cfg.parallel.zero_stage = "diloco", L.zero_stage
    cfg.diloco = DiLoCoConfig(group=L.diloco_group, inner_steps=L.diloco_inner_steps, fragments=L.diloco_fragments,
                              delay=L.diloco_delay, precision=L.diloco_precision)
    try:
        check_diloco(cfg)
        diloco_workers(cfg, L.world_size)
    except ConfigError as error:
        return [str(error)]
    return []


def framework_errors(framework: Framework, layout: Layout, model: ModelSpec | None = None) -> list[str]:
    """Features ``layout`` (of ``model``, when given) needs that ``framework`` does not have, one line each: the
    rule book's refusals under the framework's differences (:func:`meshtrain.rules.layout.layout_errors`; the
    trainer's own for ``meshtrain``) beyond those of :func:`divisibility_errors`, then its missing features."""
    e = []
    if model is not None:
        shape, L = layout_shape(model), layout
        every = layout_errors(shape, L, L.dp, L.sync_mode, replicate_kv_heads=True, expert_folding=True)
        e += [x for x in layout_errors(shape, L, L.dp, L.sync_mode, framework.replicates_kv_heads,
                                       framework.expert_folding) if x not in every]
    if layout.tp > 1 and not framework.tensor_parallel:
        e.append(f"tp = {layout.tp} is not available in {framework.name} (it has no tensor parallelism)")
    if layout.sp > 1 and layout.sp_mode not in framework.sp_modes:
        e.append(f"sp_mode = {layout.sp_mode!r} is not available in {framework.name} "
                 f"(it has {', '.join(framework.sp_modes) or 'no sequence parallelism'})")
    elif (layout.sp > 1 and model is not None and model.dropout
          and layout.sp_mode not in framework.attention_dropout_sp_modes):
        e.append(f"sp_mode = {layout.sp_mode!r} with dropout is not available in {framework.name} "
                 f"(attention dropout only with {', '.join(framework.attention_dropout_sp_modes) or 'no sp mode'})")
    if layout.recompute not in framework.recompute:
        e.append(f"recompute = {layout.recompute!r} is not available in {framework.name} "
                 f"(it has {', '.join(framework.recompute)})")
    elif not selective_runs(framework, layout):
        e.append(f"recompute = 'selective' does not run with pp_schedule = {layout.pp_schedule!r} in {framework.name} "
                 f"(its per-operator checkpoint allows one backward per block; the schedule's weight pass is a second)")
    if layout.zero_stage not in framework.zero_stages:
        e.append(f"zero_stage = {layout.zero_stage} is not available in {framework.name} "
                 f"(it has {', '.join(map(str, framework.zero_stages))})")
    if framework.zero1_ddp_only and (error := zero_stage_error(layout.zero_stage, layout.tp, layout.pp)):
        e.append(f"{error} in {framework.name}")
    if layout.pp > 1 and layout.pp_schedule not in framework.pp_schedules:
        e.append(f"pp_schedule = {layout.pp_schedule!r} is not available in {framework.name} "
                 f"(it has {', '.join(framework.pp_schedules) or 'no pipeline parallelism'})")
    if layout.tp_sequence_parallel and not framework.sequence_parallel:
        e.append(f"tp_sequence_parallel is not available in {framework.name}")
    if layout.hierarchical_allreduce and not (framework.hierarchical_allreduce and layout.zero_stage == 0
                                              and layout.tp == 1):
        e.append(f"hierarchical_allreduce is not available in {framework.name} with zero_stage = "
                 f"{layout.zero_stage} and tp = {layout.tp} (meshtrain: zero_stage 0 and tp 1)")
    return e


def selective_runs(framework: Framework, layout: Layout) -> bool:
    """False where ``layout`` asks for "selective" recomputation under a pipeline schedule whose split backward
    the framework's selective mode does not take (op-level under zero-bubble and zbv:
    :attr:`meshtrain.rules.pipeline.ScheduleRule.selective_recompute`), else True."""
    return not (layout.recompute == "selective" and framework.per_operator_selective and layout.pp > 1
                and layout.pp_schedule in RULES and not RULES[layout.pp_schedule].selective_recompute)


def recompute_modes(framework: Framework, modes: list[str], pp: int, pp_schedule: str) -> list[str]:
    """``modes`` without those :func:`selective_runs` refuses at ``pp`` and ``pp_schedule`` (the search's list)."""
    if pp == 1 or not framework.per_operator_selective or RULES[pp_schedule].selective_recompute:
        return modes
    return [m for m in modes if m != "selective"]


def field_kinds() -> dict[str, str]:
    """``{"dp": "int", ..., "recompute": "str", "tp_sequence_parallel": "bool"}``: each :class:`Layout` field's
    type by name (the degree fields come from :mod:`meshtrain.axes` as types, the rest as annotation text)."""
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(Layout)}


def parse_layout(text: str, world_size: int, global_batch_size: int) -> Layout:
    """``"tp=8,pp=4,zero_stage=1,micro_batch_size=2,recompute=full"`` -> :class:`Layout`.

    Unnamed degrees default to 1 (dp to world_size / (tp*pp*sp), :func:`meshtrain.batch_math.data_parallel_size`),
    micro_batch_size to 1, and gradient_accumulation_steps to global_batch_size / (micro_batch_size * dp),
    the inverse of :func:`meshtrain.batch_math.global_batch_size`.

    Raises:
        ConfigError: unknown key (with the valid ones), bad value, or sizes that do not divide.
    """
    kinds = field_kinds()
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in kinds:
            raise ConfigError(f"--explain item '{item}' is not key=value with a key among {', '.join(kinds)}")
        kind = kinds[key]
        try:
            values[key] = (value in ("1", "true", "True", "yes") if kind == "bool"
                           else int(value) if kind == "int" else value)
        except ValueError:
            raise ConfigError(f"--explain {key} = {value!r} is not a valid {kind}") from None
    replica = {str(a): values.get(str(a), 1) for a in axes.REPLICA_AXES}
    dp = batch_math.data_parallel_size(world_size, **replica)
    values.setdefault("dp", dp)
    if values["dp"] != dp:
        raise ConfigError(f"{axes.product_text(axes.AXES)} = {values['dp'] * axes.replica_size(replica)} != "
                          f"num_gpus = {world_size}")
    if "gradient_accumulation_steps" not in values:
        unit = batch_math.global_batch_size(values.get("micro_batch_size", 1), 1, dp)  # samples per micro-step
        if global_batch_size % unit:
            raise ConfigError(f"global_batch_size = {global_batch_size} is not a multiple of "
                              f"micro_batch_size*dp = {unit}")
        values["gradient_accumulation_steps"] = global_batch_size // unit
    return Layout(**values)


def parse_fix(text: str, flag: str = "--fix") -> dict:
    """``"tp=8,recompute=full"`` -> ``{"tp": 8, "recompute": "full"}`` (ints where the Layout field is int): the
    layout fields ``meshtrain plan --fix`` (and ``--measured``, named by ``flag`` in errors) and ``meshtrain train
    --layout auto`` (its pinned keys) hold fixed.

    Raises:
        ConfigError: unknown key, a key given twice, a value of the wrong type, a recompute/pp_schedule/zero_stage/
            sp_mode not valid, or a degree, micro-batch size, accumulation or virtual stage count below 1.
    """
    kinds = field_kinds()
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in kinds:
            raise ConfigError(f"{flag} item '{item}' is not key=value with a key among {', '.join(kinds)}")
        if key in out:
            raise ConfigError(f"{flag} {text!r} gives {key} twice: give each field once")
        try:
            out[key] = int(value) if kinds[key] == "int" else (value.lower() in ("1", "true", "yes")
                                                                 if kinds[key] == "bool" else value)
        except ValueError:
            raise ConfigError(f"{flag} {key} = {value!r} is not a valid {kinds[key]}") from None
    for key, valid in (("recompute", RECOMPUTE), ("pp_schedule", PP_SCHEDULES), ("zero_stage", ZERO_STAGES),
                       ("sp_mode", SP_MODES)):
        if key in out and out[key] not in valid:
            raise ConfigError(f"{flag} {key} = {out[key]!r} is not valid: use one of {', '.join(map(str, valid))}")
    for key in (*axes.SHORT_FLAGS, "micro_batch_size", "gradient_accumulation_steps", "virtual_stages"):
        if key in out and out[key] < 1:
            raise ConfigError(f"{flag} {key} = {out[key]} must be >= 1")
    return out


def pinned_model_errors(fixed: dict, model: ModelSpec, flag: str = "--fix") -> None:
    """Raise ConfigError where the pinned ``tp`` and ``ep`` of ``fixed`` (:func:`parse_fix`) break a rule of the rule
    book for ``model`` whatever the other degrees (:func:`meshtrain.rules.layout.layout_errors` with every stack's
    differences allowed and dp not known: heads, kv heads and the MLP width tp splits, experts ep splits, an NF4 base)."""
    pinned = Layout(dp=1, tp=fixed.get("tp", 1), ep=fixed.get("ep", 1))
    errors = layout_errors(layout_shape(model), pinned, -1, replicate_kv_heads=True, expert_folding=True)
    if errors:
        raise ConfigError(f"{flag} {', '.join(f'{k} = {fixed[k]}' for k in ('tp', 'ep') if k in fixed)}: {errors[0]}")


def sequences_per_sample(cfg: Config) -> int:
    """Sequences the trainer runs per sample of the config's batch: 2 for ``train.objective = "dpo"`` (a preference
    pair), else 1. The planner counts sequences; the reference's log-probabilities, computed once before the first
    step (:mod:`meshtrain.train.reference`), are not in a step's time."""
    return 2 if cfg.train.objective == "dpo" else 1
