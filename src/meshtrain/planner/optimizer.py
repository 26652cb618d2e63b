"""The optimizer as the planner counts it: its row of :data:`meshtrain.optim.table.TABLE` (``optim.name``), the
parameters Muon takes, and where Newton-Schulz runs. Torch-free.

States (bytes per parameter a rank updates, Rajbhandari et al. 2020, Sec. 3.1): a precision's
``optimizer_bytes`` is AdamW's, a master copy (4 bytes where the weights are 16-bit, 0 where they are fp32) plus
``exp_avg`` and ``exp_avg_sq`` (2 x 4). Another row keeps its own states beside the same master copy::

    optimizer bytes = T * optimizer_bytes - 4 * (2 - s_rest) * T - 4 * (s_rest - s_taken) * M

with T the trained parameters the rank updates, M those of them Muon takes (:func:`meshtrain.optim.table.takes_muon`:
the blocks' matrices and expert stacks, not embeddings, head, norms, biases, routers), s_taken the row's states on
them and s_rest on the rest: AdamW 2 and 2 (nothing subtracted), SGD 0 and 0 (``8 T`` fewer), Muon 1 and AdamW's 2
(``4 M`` fewer).

Newton-Schulz (:mod:`meshtrain.optim.muon`): each Muon matrix is orthogonalized whole, ``k (4 m^2 n + 2 m^3)``
FLOPs for an (m <= n) matrix (:func:`meshtrain.optim.table.newton_schulz_flops`). Where a rank runs it depends on
how the matrix is held (:func:`muon_groups`): whole on every rank (one process, DDP, pp: repeated on each replica),
dealt out by ZeRO-1, local expert stacks (ep, FSDP2 dim 0 of a 3-D stack), or sharded (tp, FSDP2 dim 0 of a 2-D
matrix) and then either orthogonalized on one owner among the ranks holding its shards (``muon_exchange =
"owner"``: two all-to-alls in the Newton-Schulz dtype) or gathered and orthogonalized on every one of them
("gather"). Owners are dealt as the trainer deals them (:func:`deal`: largest first to the least loaded rank), so
the busiest rank's share is ``~ total / n`` until there are fewer matrices than ranks, when the largest matrix
alone sets it. Takeaway: sharding over more ranks divides Muon's matrix work until each rank owns one matrix; for a
405B model that floor is one 16k x 53k MLP matrix (~0.3 PFLOP per step).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

from meshtrain.config.sections import OptimConfig
from meshtrain.optim.table import ADAMW_STATES, TABLE, OptimizerSpec, newton_schulz_flops
from meshtrain.planner.hardware import Device
from meshtrain.planner.model_specs import ModelSpec

BUCKET_BYTES = 256 * 2**20
"""The trainer's owner-exchange bucket (:data:`meshtrain.optim.muon.BUCKET_BYTES`: whole matrices at 4 bytes an
element per exchange); the same number, not imported (the planner does not import torch)."""
STATE_BYTES = 4
"""Bytes of one optimizer state element (fp32, as every row of the table keeps them)."""
NS_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
"""Bytes per element of the Newton-Schulz dtype (``optim.muon_ns_dtype``)."""

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OptimizerPlan:
    """The run's optimizer as the planner needs it: ``optim.name`` and, for Muon, its Newton-Schulz steps, dtype
    and exchange (:class:`meshtrain.config.sections.OptimConfig`'s ``muon_*`` keys, the same defaults)."""

    name: str = "adamw"
    ns_steps: int = OptimConfig.muon_ns_steps
    ns_dtype: str = OptimConfig.muon_ns_dtype
    exchange: str = OptimConfig.muon_exchange

    @classmethod
    def from_config(cls, optim: OptimConfig) -> OptimizerPlan:
        return cls(optim.name, optim.muon_ns_steps, optim.muon_ns_dtype, optim.muon_exchange)

    @property
    def row(self) -> OptimizerSpec:
        return TABLE[self.name]

    @property
    def muon(self) -> bool:
        """Whether the row takes the blocks' matrices apart (Muon), AdamW the rest."""
        return self.row.hidden_matrices

    @property
    def rest_states(self) -> int:
        """fp32 states per parameter the row keeps on the parameters it does not take apart: AdamW's on Muon's rest."""
        return TABLE["adamw"].states if self.muon else self.row.states

    @property
    def ns_bytes(self) -> int:
        return NS_DTYPE_BYTES[self.ns_dtype]

    def state_bytes(self, trained: float, taken: float, optimizer_bytes: float) -> float:
        """Bytes of the optimizer's states and master copy for ``trained`` parameters of which Muon takes ``taken``
        (the module docstring's formula); ``optimizer_bytes``: the precision's AdamW bytes per parameter. AdamW's
        are ``trained * optimizer_bytes`` exactly."""
        value = trained * optimizer_bytes
        if self.rest_states != ADAMW_STATES:
            value -= STATE_BYTES * (ADAMW_STATES - self.rest_states) * trained
        if self.muon:
            value -= STATE_BYTES * (self.rest_states - self.row.states) * taken
        return value

    def fewest_state_bytes(self, optimizer_bytes: float) -> float:
        """Bytes per parameter at least (every parameter with the row's fewest states): a lower bound's."""
        return optimizer_bytes - STATE_BYTES * (ADAMW_STATES - min(self.row.states, self.rest_states))


@dataclass(frozen=True)
class BlockMatrices:
    """One transformer block's parameters Muon takes, whole shapes as the trainer's models hold them
    (``models/<family>/model.py``: separate q, k, v, proj; gate, up, down or fc, proj; (E, rows, cols) expert
    stacks): ``split`` tp splits (column- and row-parallel), ``stacks`` ep splits by experts (tp replicates them),
    ``replicated`` tp replicates (a shared expert's)."""

    split: tuple[Shape, ...]
    stacks: tuple[Shape, ...]
    replicated: tuple[Shape, ...]

    def params(self, tp: int = 1, ep: int = 1) -> float:
        """Muon parameters of one block on one rank of ``tp`` x ``ep`` (before ZeRO)."""
        return (sum(map(math.prod, self.split)) / tp + sum(map(math.prod, self.stacks)) / ep
                + sum(map(math.prod, self.replicated)))


def block_matrices(model: ModelSpec) -> BlockMatrices:
    """:class:`BlockMatrices` of ``model``: attention ``q (q, h)``, ``k, v (kv, h)``, ``proj (h, q)`` (MLA:
    :func:`_mla_matrices`); a dense MLP ``m - 1`` of ``(f, h)`` and ``(h, f)``; a mixture of experts the same as
    ``(E, ., .)`` stacks and a shared expert's of width S, split by tp as a dense MLP where the trainer splits it
    (DeepSeek's, :attr:`ModelSpec.shared_tp_split`), else replicated (its one-row gate and the router stay with AdamW:
    :data:`meshtrain.optim.table.NOT_MUON`). A MoE model's block is a MoE block (dense first layers not told apart)."""
    h, q, kv, f, m = model.hidden, model.q_dim, model.kv_dim, model.ffn_hidden, model.mlp_matrices
    attention, whole = _mla_matrices(model) if model.kv_lora_rank else (((q, h), (kv, h), (kv, h), (h, q)), ())
    mlp = ((f, h),) * (m - 1) + ((h, f),)
    if not model.experts:
        return BlockMatrices(attention + mlp, (), ())
    s = model.shared_ffn
    shared = ((s, h),) * (m - 1) + ((h, s),) if s else ()
    stacks = tuple((model.experts, *shape) for shape in mlp)
    if model.shared_tp_split:
        return BlockMatrices(attention + shared, stacks, whole)
    return BlockMatrices(attention, stacks, whole + shared)


def _mla_matrices(model: ModelSpec) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """(tp-split, tp-replicated) matrices of multi-head latent attention (DeepSeek-V2 report, Sec. 2.1; the trainer's
    :class:`meshtrain.models.deepseek_v3.model.MLAttention`): the up-projections ``q_b (a*dqk, rq)`` (or ``q (a*dqk,
    h)`` without a q latent) and ``kv_b (a*(dn + dv), rkv)`` and the output ``proj (h, a*dv)`` split by head; the
    down-projections ``q_a (rq, h)`` and ``kv_a (rkv + dr, h)`` whole on every tp rank."""
    h, q, rq, rkv, dr = model.hidden, model.q_dim, model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    up_q = (q, rq) if rq else (q, h)
    split = (up_q, (model.heads * (model.head_dim - dr + model.v_head_dim), rkv), (h, model.v_dim))
    return split, (((rq, h),) if rq else ()) + ((rkv + dr, h),)


@dataclass(frozen=True)
class MuonGroup:
    """Matrices that one set of ranks orthogonalizes together. ``kind``: "whole" (every rank of the set runs all of
    them), "dealt" (ZeRO-1: each to one of the ``n`` ranks), "owner" or "gather" (sharded over ``n`` ranks, the
    exchange); ``axes``: the mesh axes of the ranks sharing them (their links); ``items``: (count, shape)."""

    kind: str
    n: int
    axes: tuple[str, ...]
    items: tuple[tuple[int, Shape], ...]


def muon_groups(model: ModelSpec, blocks: int, tp: int, dp_sp: int, ep: int, zero_stage: int,
                exchange: str) -> list[MuonGroup]:
    """Where the Muon matrices of a rank's ``blocks`` blocks are orthogonalized (:mod:`meshtrain.optim.muon`): a
    tp-split matrix is sharded over tp, and under FSDP2 (``zero_stage >= 2``) over ``dp_sp`` too (2-D: both); a
    shared expert's over ``dp_sp`` under FSDP2; an expert stack is local (E/ep experts, FSDP2 splits them on over
    the ``dp_sp / ep`` ranks that hold the same ones). ZeRO-1 deals whole matrices out over ``dp_sp``; otherwise
    whole ones are orthogonalized on every rank that holds them. LoRA adapters are not counted (r x h matrices:
    r/h of a block's work)."""
    mats = block_matrices(model)
    fsdp = zero_stage >= 2 and dp_sp > 1
    dealt = zero_stage == 1 and dp_sp > 1
    dp_axes = ("dp", "sp")

    def place(shapes: tuple[Shape, ...], n: int, axes: tuple[str, ...]) -> tuple[str, int, tuple[str, ...]]:
        if n > 1:
            return exchange, n, axes
        return ("dealt", dp_sp, dp_axes) if dealt else ("whole", 1, ())

    placed = [(place(mats.split, tp * (dp_sp if fsdp else 1), ("tp",) + (dp_axes if fsdp else ())), mats.split),
              (place(mats.replicated, dp_sp if fsdp else 1, dp_axes), mats.replicated)]
    if mats.stacks:
        local = model.experts // ep
        if fsdp:
            local = math.ceil(local / max(1, dp_sp // ep))
        placed.append(((("dealt", dp_sp, dp_axes) if dealt else ("whole", 1, ())),
                       tuple((local, *shape[1:]) for shape in mats.stacks)))
    groups: dict[tuple[str, int, tuple[str, ...]], list[tuple[int, Shape]]] = {}
    for key, shapes in placed:
        groups.setdefault(key, []).extend((blocks, shape) for shape in shapes)
    return [MuonGroup(kind, n, axes, tuple(items)) for (kind, n, axes), items in groups.items() if items]


@lru_cache(maxsize=4096)
def deal(items: tuple[tuple[int, Shape], ...], n: int, steps: int) -> tuple[int, ...]:
    """How many of each of ``items`` (count, shape) the busiest of ``n`` ranks orthogonalizes when they are dealt
    as the trainer deals owners (:func:`meshtrain.optim.muon._plan`; ZeroRedundancyOptimizer deals by size, the
    same order for these shapes): by Newton-Schulz FLOPs, largest first, each to the least loaded rank (ties to the
    lowest). Fewer matrices than ranks: one of the largest."""
    flops = [newton_schulz_flops(shape, steps) for _, shape in items]
    order = sorted(range(len(items)), key=lambda i: -flops[i])
    if sum(count for count, _ in items) <= n:
        return tuple(int(i == order[0]) for i in range(len(items)))
    held = [[0] * len(items) for _ in range(n)]
    heap = [(0.0, rank) for rank in range(n)]
    for i in order:
        for _ in range(items[i][0]):
            load, rank = heapq.heappop(heap)
            held[rank][i] += 1
            heapq.heappush(heap, (load + flops[i], rank))
    busiest = max(heap, key=lambda entry: (entry[0], -entry[1]))[1]
    return tuple(held[busiest])


@dataclass(frozen=True)
class MuonWork:
    """Muon's matrix work on the busiest rank in one step: Newton-Schulz ``flops`` and their ``seconds``, the
    ``exchanges`` (collective kind, ranks, mesh axes, bytes of the buffer as
    :func:`meshtrain.planner.cost.collective_time` takes it) and the step's ``temporaries`` (bytes)."""

    flops: float = 0.0
    seconds: float = 0.0
    exchanges: tuple[tuple[str, int, tuple[str, ...], float], ...] = ()
    temporaries: float = 0.0


def ns_seconds(shape: Shape, steps: int, device: Device, dtype: str) -> float:
    """Seconds of ``steps`` Newton-Schulz iterations on ``shape`` (a stack: each matrix) at the device's GEMM rate in
    ``dtype`` (:meth:`~meshtrain.planner.hardware.Device.matmul_flops` at the inner size m) plus the GEMMs' operand
    traffic as :func:`meshtrain.planner.cost.gemm_traffic_bytes` counts it: ``X X^T`` (rows m, K n, N m), ``A A``
    (m, m, m) and ``B X`` (m, m, n), ``e (4 m n + 5 m^2)`` bytes per iteration and matrix."""
    m, n = sorted(shape[-2:])
    matrices = shape[0] if len(shape) == 3 else 1
    traffic = steps * matrices * NS_DTYPE_BYTES[dtype] * (4.0 * m * n + 5.0 * m * m)
    return newton_schulz_flops(shape, steps) / device.matmul_flops(dtype, m) + device.gemm_traffic_seconds(dtype, traffic)


def working_bytes(shape: Shape, e: int) -> float:
    """Bytes Newton-Schulz holds besides its input while it runs on ``shape`` (:func:`meshtrain.optim.muon.newton_schulz`):
    X and the next X (m x n each), the Gram matrix S and ``b S + c S^2`` (m x m each), in the dtype of ``e`` bytes:
    ``e (2 m n + 2 m^2)`` per matrix of a stack (a stack runs batched)."""
    m, n = sorted(shape[-2:])
    return (shape[0] if len(shape) == 3 else 1) * e * (2.0 * m * n + 2.0 * m * m)


def muon_work(groups: list[MuonGroup], plan: OptimizerPlan, device: Device) -> MuonWork:
    """:class:`MuonWork` of the busiest rank over ``groups`` (:func:`muon_groups`), each group's busiest summed.

    Per group, with L the Muon elements the rank updates (its shards, its dealt share, or all whole ones), O those
    of the whole matrices it owns, e the Newton-Schulz dtype's bytes:

    - Newton-Schulz on the matrices it runs (all of a "whole" or "gather" group, its :func:`deal` of the others);
    - "owner": two all-to-alls (shards to the owners, the results back), each moving the larger of what the rank
      sends (its shards, ``L e``) and what an owner receives (``O e``: (n-1)/n of it from the others), ``(n-1)/n``
      of the buffer over the group's links; "gather": an all-gather of every matrix's fp32 update;
    - temporaries, the largest of any group's (the trainer orthogonalizes one matrix or one bucket at a time,
      :mod:`meshtrain.optim.muon`): whole matrices, the largest one's fp32 update; "owner", per bucket of
      ``B = max(BUCKET_BYTES / 4, the largest matrix)`` whole elements, the fp32 updates of its shards
      ``4 L_b`` (``L_b = min(L, B / n)``), the send pieces and their concatenation ``2 L_b e`` and the received
      shards and assembled matrices ``2 O_b e`` (``O_b = min(O, B)``); "gather", the largest matrix's update shard,
      its gathered fp32 whole and the orthogonalized shard; plus :func:`working_bytes` of the largest matrix it
      orthogonalizes."""
    e, steps = plan.ns_bytes, plan.ns_steps
    flops = seconds = held = 0.0
    working, exchanges = 0.0, []
    for g in groups:
        counts = deal(g.items, g.n, steps) if g.kind in ("dealt", "owner") else tuple(c for c, _ in g.items)
        shapes = [shape for _, shape in g.items]
        flops += sum(c * newton_schulz_flops(s, steps) for c, s in zip(counts, shapes))
        seconds += sum(c * ns_seconds(s, steps, device, plan.ns_dtype) for c, s in zip(counts, shapes))
        working = max([working] + [working_bytes(s, e) for c, s in zip(counts, shapes) if c])
        total = float(sum(c * math.prod(s) for c, s in g.items))
        mine = float(sum(c * math.prod(s) for c, s in zip(counts, shapes)))
        local = total / g.n if g.kind in ("owner", "gather") else mine
        largest = float(max(math.prod(s) for s in shapes))
        if g.kind == "owner":
            exchanges += [("all-to-all", g.n, g.axes, max(local, mine) * e)] * 2
            bucket = max(BUCKET_BYTES / STATE_BYTES, largest)
            local_b, mine_b = min(local, bucket / g.n), min(mine, bucket)
            held = max(held, STATE_BYTES * local_b + 2 * local_b * e + 2 * mine_b * e)
        elif g.kind == "gather":
            exchanges.append(("all-gather", g.n, g.axes, total * STATE_BYTES))
            held = max(held, STATE_BYTES * largest / g.n + STATE_BYTES * largest + e * largest / g.n)
        else:
            held = max(held, STATE_BYTES * largest)
    return MuonWork(flops, seconds, tuple(exchanges), held + working)
