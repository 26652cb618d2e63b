"""The parallel axes and the option vocabularies, one table and one list each, torch-free.

:data:`AXIS_TABLE` is the only place an axis is spelled: the degree fields of the config's ``[parallel]``
section (:class:`meshtrain.config.sections.ParallelConfig`), of the planner's :class:`~meshtrain.planner.layout.Layout`
and of the run's :class:`~meshtrain.mesh.ParallelDims` are made from it (:func:`degrees_dataclass`), and so are
the short flags (``--dp``), the ">= 1" checks, the world-size product, the mesh's dims and strides, and the
axes a checkpoint records. Adding an axis is one row here plus what the axis does (its strategy module, its
planner costs); an axis whose ranks are borrowed from others rather than multiplying the world (experts over
``dp x sp``, Megatron's "parallel folding") is a row with ``in_world=False``.

Mesh order is outer to inner ``("pp", "dp", "sp", "tp")``: tp innermost so its ranks are neighbours (inside
one node), pp outermost so stages cross nodes; ``world_size = pp * dp * sp * tp``. Every other module that
names an sp mode, a pipeline schedule, a recompute mode, a zero stage or a sync mode imports its list from
here (config validation, the mesh, the strategies, the planner, the CLI).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Axis(StrEnum):
    """Mesh axis names."""

    DP = "dp"
    TP = "tp"
    PP = "pp"
    SP = "sp"
    EP = "ep"


@dataclass(frozen=True)
class AxisSpec:
    """One row of :data:`AXIS_TABLE`.

    - ``axis``: the name (config key ``parallel.<axis>``, flag ``--<axis>``, mesh dim, Layout field);
    - ``nesting``: place in the mesh, 0 outermost (strides grow outwards);
    - ``doc``: what the degree splits (the config key's documentation);
    - ``fills``: -1 means "the ranks left over" (dp only), the config's default;
    - ``holds_batch``: its ranks hold different tokens of the global batch, so gradients and the loss are
      averaged over it (the flattened batch mesh, :data:`BATCH_MESH`);
    - ``in_world``: its degree multiplies ``world_size`` (False: ranks borrowed from other axes).
    """

    axis: Axis
    nesting: int
    doc: str
    fills: bool = False
    holds_batch: bool = False
    in_world: bool = True


AXIS_TABLE: tuple[AxisSpec, ...] = (
    AxisSpec(Axis.DP, 1, "Data-parallel degree: replicas that each take their own samples of the global batch; -1 "
                         "fills the ranks left over: world_size / (pp * sp * tp).", fills=True, holds_batch=True),
    AxisSpec(Axis.TP, 3, "Tensor-parallel degree: each block's matrices split across tp ranks (Megatron); the "
                         "family says what it must divide (heads, kv heads, the MLP width)."),
    AxisSpec(Axis.PP, 0, "Pipeline-parallel degree: consecutive layers split across pp ranks (parallel.pp_schedule)."),
    AxisSpec(Axis.SP, 2, "Sequence-parallel degree (the seeds' sp_size): each sample's sequence split across sp "
                         "ranks (parallel.sp_mode).", holds_batch=True),
    AxisSpec(Axis.EP, 4, "Expert-parallel degree: a mixture of experts' experts split across ep ranks borrowed from "
                         "dp*sp (it must divide dp*sp and model.num_experts; it does not multiply the world size): "
                         "each token is sent to the rank that holds its expert and back (all-to-all).", in_world=False),
)
"""The parallel axes in the order users write them (``dp tp pp sp``): one row each."""

SPECS: dict[str, AxisSpec] = {str(s.axis): s for s in AXIS_TABLE}
AXES: tuple[Axis, ...] = tuple(s.axis for s in sorted(AXIS_TABLE, key=lambda s: s.nesting) if s.in_world)
"""The mesh's axes, outer to inner."""
BATCH_AXES: tuple[Axis, ...] = tuple(a for a in AXES if SPECS[a].holds_batch)
"""Axes whose ranks hold different tokens of the batch, outer to inner (``dp``, ``sp``)."""
BATCH_MESH = "_".join(BATCH_AXES)
"""Name of the flattened mesh of :data:`BATCH_AXES` (``"dp_sp"``): the gradient reduction and the loss mean span it."""
REPLICA_AXES: tuple[Axis, ...] = tuple(a for a in AXES if not SPECS[a].fills)
"""The axes inside one data-parallel replica (``pp``, ``sp``, ``tp``): their product is a replica's ranks."""
EXPERT_MESH = "ep"
"""Name of the 1-D mesh of ``ep`` consecutive ranks of the batch mesh that split the experts between them."""
EXPERT_REPLICA_MESH = "edp"
"""Name of the 1-D mesh of the ``dp*sp/ep`` ranks of the batch mesh that hold the same experts (Megatron-Core's
"expert data parallel" group): the experts' gradients are summed over it."""
SHORT_FLAGS: dict[str, str] = {str(s.axis): f"parallel.{s.axis}" for s in AXIS_TABLE}
"""``--dp`` -> ``parallel.dp``, one per axis."""


def degrees_dataclass(name: str, doc: str, *, defaults: str = "config", frozen: bool = False) -> type:
    """A dataclass with one ``int`` field per axis, in :data:`AXIS_TABLE` order, to inherit from.

    ``defaults``: "config" (-1 for a filling axis, else 1: the ``[parallel]`` section's), "one" (every degree
    1: the planner's Layout), or "none" (every degree of the world required, a borrowed axis 1 unless given: the
    run's resolved dims). Each field's
    ``metadata["doc"]`` is its row's ``doc``.
    """
    def default(s: AxisSpec) -> dict[str, Any]:
        if defaults == "none":
            return {} if s.in_world else {"default": 1, "kw_only": True}
        return {"default": -1 if defaults == "config" and s.fills else 1}

    specs = [(str(s.axis), int, dataclasses.field(metadata={"doc": s.doc}, **default(s))) for s in AXIS_TABLE]
    return dataclasses.make_dataclass(name, specs, frozen=frozen, namespace={"__doc__": doc, "__module__": __name__})


def degree(degrees: Any, axis: Axis | str) -> int:
    """The degree of ``axis`` in ``degrees``: a mapping or an object with one attribute per axis."""
    return degrees[str(axis)] if isinstance(degrees, Mapping) else getattr(degrees, str(axis))


def _getter(axes: tuple[Axis, ...]) -> Any:
    """A function of a mapping or object to the tuple of its degrees of ``axes`` (attrgetter's speed for the
    objects the planner builds by the thousand)."""
    names = [str(a) for a in axes]
    if not names:
        return lambda degrees: ()
    attributes = operator.attrgetter(*names)

    def get(degrees: Any) -> tuple[int, ...]:
        if isinstance(degrees, Mapping):
            return tuple(degrees[n] for n in names)
        values = attributes(degrees)
        return values if isinstance(values, tuple) else (values,)

    return get


degrees_of = _getter(tuple(s.axis for s in AXIS_TABLE))
"""``degrees_of(layout)``: the degree of every axis in table order, as :func:`as_dict`'s values (a tuple: a cheap
cache key)."""
_world_degrees, _replica_degrees, _batch_degrees = _getter(AXES), _getter(REPLICA_AXES), _getter(BATCH_AXES)


def world_size(degrees: Any) -> int:
    """``pp * dp * sp * tp``: the product of the degrees of the axes that multiply the world."""
    return math.prod(_world_degrees(degrees))


def replica_size(degrees: Any) -> int:
    """Ranks of one data-parallel replica, ``pp * sp * tp`` (:data:`REPLICA_AXES`)."""
    return math.prod(_replica_degrees(degrees))


def batch_degree(degrees: Any) -> int:
    """``dp * sp``: ranks that hold different tokens of the global batch (:data:`BATCH_AXES`)."""
    return math.prod(_batch_degrees(degrees))


def stride(degrees: Any, axis: Axis | str) -> int:
    """Rank distance between neighbours along ``axis``: the product of the degrees of the axes inside it
    (mesh order outer to inner, :data:`AXES`); a borrowed axis (ep: consecutive ranks of the flattened batch mesh)
    has the innermost batch axis's."""
    return math.prod(_inner_degrees[str(axis)](degrees))


def _inside(axis: AxisSpec) -> tuple[Axis, ...]:
    within = axis.axis if axis.in_world else BATCH_AXES[-1]
    return AXES[AXES.index(within) + 1:]


_inner_degrees = {str(s.axis): _getter(_inside(s)) for s in AXIS_TABLE}


def product_text(axes: tuple[Axis, ...], degrees: Any = None) -> str:
    """``"pp*sp*tp"``, or with ``degrees`` ``"pp*sp*tp = 2*1*2"``."""
    names = "*".join(map(str, axes))
    return names if degrees is None else f"{names} = {'*'.join(str(degree(degrees, a)) for a in axes)}"


def degree_errors(degrees: Any, prefix: str = "") -> list[str]:
    """``"<prefix>tp = 0 must be >= 1"`` for each degree below 1 (-1 allowed where the axis fills)."""
    out = []
    for s in AXIS_TABLE:
        value = degree(degrees, s.axis)
        if s.fills and value == -1:
            continue
        if value < 1:
            fill = ", or -1 to fill the remaining ranks" if s.fills else ""
            out.append(f"{prefix}{s.axis} = {value} must be >= 1{fill}")
    return out


def describe(degrees: Any) -> str:
    """``"dp=2 tp=1 pp=1 sp=1"`` (table order)."""
    return " ".join(f"{s.axis}={degree(degrees, s.axis)}" for s in AXIS_TABLE)


def as_dict(degrees: Any) -> dict[str, int]:
    """``{"dp": 2, "tp": 1, "pp": 1, "sp": 1}`` (table order)."""
    return {str(s.axis): degree(degrees, s.axis) for s in AXIS_TABLE}


def expert_degree_error(ep: int, dp: int, sp: int) -> str:
    """The one-line refusal of an ``ep`` that does not divide ``dp*sp`` (its ranks are borrowed from them)."""
    batch = dp * sp
    valid = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
    return (f"parallel.ep = {ep} does not divide dp*sp = {dp}*{sp} = {batch}: expert parallelism borrows its ranks "
            f"from the data- and sequence-parallel ones; use ep in {valid}, or more dp ranks")



SP_MODES = ("ulysses", "ring", "usp")
"""``parallel.sp_mode``: DeepSpeed-Ulysses all-to-all of heads (Jacobs et al. 2023, arXiv:2309.14509), ring
attention passing K/V around the sp ranks (Liu et al. 2023, arXiv:2310.01889), or both at once (USP, Fang and Zhao
2024, arXiv:2405.07719): Ulysses over ``parallel.sp_ulysses`` consecutive sp ranks inside, ring attention over the
``sp / sp_ulysses`` such groups across (:data:`SP_RING_MESH`, :data:`SP_ULYSSES_MESH`)."""
SP_RING_MESH = "sp_ring"
"""Name of the 1-D mesh of the ``sp / sp_ulysses`` sp ranks at this rank's place in each Ulysses group (USP's ring)."""
SP_ULYSSES_MESH = "sp_ulysses"
"""Name of the 1-D mesh of ``sp_ulysses`` consecutive sp ranks (USP's Ulysses all-to-all, innermost)."""
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "naive", "zero-bubble", "zbv")
"""``parallel.pp_schedule`` (each one's rules: :data:`meshtrain.rules.pipeline.RULES`)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""``train.recompute`` (:mod:`meshtrain.parallel.recompute`)."""
ZERO_STAGES = (0, 1, 2, 3)
"""``parallel.zero_stage``: 0 DDP, 1 sharded optimizer states, 2 and 3 FSDP2 (without / with resharding)."""
SYNC_MODES = ("sync", "async", "local-sgd", "diloco")
"""``parallel.sync_mode``: gradients all-reduced every step, a parameter server, local SGD, or DiLoCo (workers of
any synchronous layout joined by an outer optimizer, :mod:`meshtrain.parallel.diloco`)."""
SYNC_MODE_SECTIONS: dict[str, str] = {"local-sgd": "local_sgd", "async": "parameter_server", "diloco": "diloco"}
"""The config section of each sync mode's own keys: under any other mode they must keep their defaults
(``config.checks`` refuses them in one line, as a model family's keys under another family). A new sync mode is its
module, its section and a row here."""
OUTER_PRECISIONS = ("fp32", "bf16", "int8")
"""``diloco.precision``: how DiLoCo's pseudo-gradients cross between workers (:mod:`meshtrain.parallel.diloco`)."""
WORKER_MESH = "diloco"
"""Name of the mesh dimension outside every axis whose ranks are DiLoCo's workers (:class:`meshtrain.mesh.ParallelDims`)."""
STALE_POLICIES = ("drop", "wait")
"""``parameter_server.stale_policy``."""
