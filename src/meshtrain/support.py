"""What the trainer can run today: the one table that config validation and the planner both read.

``meshtrain train`` rejects a config that asks for anything outside it (``config.validate``), and the
planner's ``meshtrain`` framework (``planner/layout.py``) is built from it, so ``meshtrain plan``
never ranks a layout that ``meshtrain train`` would reject. When a feature lands, widen it here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    """Features of the trainer, as the values each config key may take."""

    zero_stages: tuple[int, ...]
    """``parallel.zero_stage`` values: 0 DDP, 2 and 3 FSDP2."""
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


SUPPORTED = Support(zero_stages=(0, 2, 3), tp=True, tp_sequence_parallel=True, sp_modes=("ulysses", "ring"),
                    pp_schedules=("1f1b", "gpipe", "interleaved-1f1b", "naive", "zero-bubble", "zbv"), recompute=("none",), attention_dropout_sp_modes=("ulysses",))
