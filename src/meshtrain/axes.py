"""The parallel axes and the option vocabularies, one list each, torch-free: every module that names an axis, an
sp mode, a pipeline schedule, a recompute mode, a zero stage or a sync mode imports it from here (config
validation, the mesh, the strategies, the planner, the CLI).

Axes are ordered outer to inner ``("pp", "dp", "sp", "tp")``: tp innermost so its ranks are neighbours (inside
one node), pp outermost so stages cross nodes; ``world_size = pp * dp * sp * tp``.
"""

from __future__ import annotations

from enum import StrEnum


class Axis(StrEnum):
    """Mesh axis names, outer to inner."""

    PP = "pp"
    DP = "dp"
    SP = "sp"
    TP = "tp"


AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.SP, Axis.TP)
"""The mesh's axes, outer to inner."""
SP_MODES = ("ulysses", "ring")
"""``parallel.sp_mode``: DeepSpeed-Ulysses all-to-all of heads (Jacobs et al. 2023, arXiv:2309.14509) or ring
attention passing K/V around the sp ranks (Liu et al. 2023, arXiv:2310.01889)."""
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "naive", "zero-bubble", "zbv")
"""``parallel.pp_schedule`` (each one's rules: :data:`meshtrain.rules.pipeline_schedules.RULES`)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""``train.recompute`` (:mod:`meshtrain.parallel.recompute`)."""
ZERO_STAGES = (0, 1, 2, 3)
"""``parallel.zero_stage``: 0 DDP, 1 sharded optimizer states, 2 and 3 FSDP2 (without / with resharding)."""
SYNC_MODES = ("sync", "async", "local-sgd")
"""``parallel.sync_mode``: gradients all-reduced every step, a parameter server, or local SGD."""
STALE_POLICIES = ("drop", "wait")
"""``parallel.stale_policy`` of the parameter server."""
