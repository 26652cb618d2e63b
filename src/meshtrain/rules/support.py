"""What the trainer can run today: the one table that config validation and the planner both read.

``meshtrain train`` rejects a config that asks for anything outside it (``config.validate``), and the
planner's ``meshtrain`` framework (``planner/layout.py``) is built from it, so ``meshtrain plan``
never ranks a layout that ``meshtrain train`` would reject. When a feature lands, widen it here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshtrain.axes import PP_SCHEDULES, RECOMPUTE_MODES, SP_MODES, ZERO_STAGES
from meshtrain.models.registry import attention_families, family
from meshtrain.rules.pipeline import RULES


@dataclass(frozen=True)
class Support:
    """Features of the trainer, as the values each config key may take."""

    zero_stages: tuple[int, ...]
    """``parallel.zero_stage`` values: 0 DDP, 1 DDP with sharded AdamW states, 2 and 3 FSDP2."""
    tp: bool
    """Tensor parallelism (``parallel.tp > 1``)."""
    tp_sequence_parallel: bool
    """Megatron sequence parallelism inside the tp group."""
    sp_modes: tuple[str, ...]
    """``parallel.sp_mode`` values for ``parallel.sp > 1`` (empty: no sequence parallelism)."""
    pp_schedules: tuple[str, ...]
    """``parallel.pp_schedule`` values for ``parallel.pp > 1`` (empty: no pipeline parallelism)."""
    recompute: tuple[str, ...]
    """Activation recomputation modes (the planner's ``recompute``)."""
    attention_dropout_sp_modes: tuple[str, ...]
    """sp modes that apply ``model.dropout`` to attention weights (ring attention does not)."""
    hierarchical_allreduce: bool = True
    """``parallel.hierarchical_allreduce`` (DDP at zero_stage 0 without tp)."""
    zero1_ddp_only: bool = True
    """zero_stage 1 only at tp = pp = 1 (:func:`zero_stage_error`)."""


SUPPORTED = Support(zero_stages=ZERO_STAGES, tp=True, tp_sequence_parallel=True, sp_modes=SP_MODES,
                    pp_schedules=PP_SCHEDULES, recompute=RECOMPUTE_MODES,
                    attention_dropout_sp_modes=("ulysses",))


def zero_stage_error(zero_stage: int, tp: int, pp: int) -> str:
    """Why ``zero_stage`` cannot run at these degrees ("" when it can). zero_stage 1 is torch's
    ``ZeroRedundancyOptimizer`` over DDP: it broadcasts each updated parameter whole, so it takes neither
    tp's ``DTensor`` shards (``replicate``, not DDP, syncs those) nor, untested, a pipeline stage's parts."""
    if zero_stage == 1 and (tp > 1 or pp > 1):
        return (f"zero_stage = 1 needs tp = 1 and pp = 1 (got tp = {tp}, pp = {pp}; zero_stage 2 and 3 "
                f"shard the optimizer states there)")
    return ""


def uses_parameter_server(sync_mode: str) -> bool:
    """Whether ``parallel.sync_mode`` trains with servers and workers (``"async"``,
    :mod:`meshtrain.parallel.async_ps`) instead of collectives: a loop of its own
    (``meshtrain.train.async_run``) with no step all ranks share, where one gradient is one worker's batch."""
    return sync_mode == "async"


def compile_error(model_type: str, sync_mode: str) -> str:
    """Why ``train.compile`` cannot compile this layout's blocks ("" when it can): ``torch.compile`` per block,
    after tp/sp and before DDP/FSDP2 wrap it (torchtitan's order), under every layout of a family with attention
    blocks (:attr:`meshtrain.models.family.Family.attention`) but a parameter-server run
    (:mod:`meshtrain.parallel.recompute`)."""
    if not family(model_type).attention:
        return f"model.type = {model_type!r} has no transformer blocks to compile ({attention_families()} have)"
    if uses_parameter_server(sync_mode):
        return "sync_mode = 'async' workers run their own loop, uncompiled"
    return ""


def compile_eligible(model_type: str, sync_mode: str) -> bool:
    """Whether ``train.compile`` may compile this layout's blocks (:func:`compile_error` is empty)."""
    return not compile_error(model_type, sync_mode)


def recompute_error(recompute: str, model_type: str, pp: int, pp_schedule: str, sync_mode: str) -> str:
    """Why ``train.recompute`` cannot run this layout ("" when it can; "none" always can)."""
    if recompute == "none":
        return ""
    if not family(model_type).attention:
        return (f"train.recompute = {recompute!r} recomputes transformer blocks: model.type = {model_type!r} has none "
                f"({attention_families()} have); use 'none'")
    if uses_parameter_server(sync_mode):
        return f"train.recompute = {recompute!r} does not run with sync_mode = 'async' (its workers' own loop); use 'none'"
    rule = RULES.get(pp_schedule)
    if recompute == "selective" and pp > 1 and rule is not None and not rule.selective_recompute:
        return (f"train.recompute = 'selective' cannot run with pp_schedule = {pp_schedule!r}: its weight pass is a "
                f"second backward through each block, and torch 2.13's selective checkpointing allows one; use "
                f"train.recompute = 'full' or another pp_schedule")
    return ""


def blocks_compiled(compile_mode: str, eligible: bool, device_type: str) -> bool:
    """Whether the blocks are compiled on ``device_type`` ("cpu"/"cuda"): ``compile_mode`` "on", or "auto" on
    CUDA only (on the CPU it measured no faster for the main job, docs/benchmarks.md); never when not
    :func:`compile_eligible` (config validation refuses "on" there)."""
    return eligible and (compile_mode == "on" or (compile_mode == "auto" and device_type == "cuda"))


def fsdp_units(block_bytes: Sequence[float], unit_bytes: float) -> tuple[list[list[int]], list[int]]:
    """How FSDP2 (``zero_stage`` 2 and 3) groups a model's transformer blocks into units, each unit one
    all-gather and one reduce-scatter (``fully_shard`` of a list of modules).

    Consecutive blocks join a unit until it holds at least ``unit_bytes`` (bytes of the blocks' fp32
    parameters on this rank, before dp sharding); ``unit_bytes = 0`` gives every block its own unit, as
    torchtitan and FSDP's transformer auto-wrap policy do. Blocks after the last full unit stay in the
    root unit (embedding, final norm, head), which ``fully_shard`` gathers for the whole step. The
    trainer (:func:`meshtrain.parallel.data_parallel.apply_dp`) and the planner's cost and memory models read the
    same grouping. Like DDP's gradient buckets (``bucket_cap_mb = 25``, Li et al. 2020, Sec. 3.2.3),
    fewer larger collectives pay the per-collective latency and host cost fewer times.

    Returns:
        ``(units, rest)``: lists of block indices, one per unit in order, and the indices left to the root.
    """
    units: list[list[int]] = []
    current: list[int] = []
    held = 0.0
    for i, nbytes in enumerate(block_bytes):
        current.append(i)
        held += nbytes
        if held >= unit_bytes:
            units.append(current)
            current, held = [], 0.0
    return units, current
