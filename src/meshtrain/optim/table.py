"""The table of optimizers: one :class:`OptimizerSpec` row per ``optim.name``, read by the trainer
(:func:`meshtrain.optim.build.build_optimizer`), the checkpoints (a resumed run's optimizer must be the saved one's)
and the planner (states per parameter, update FLOPs, the Muon exchange). Torch-free.

Which parameters an optimizer takes is :func:`takes_muon`'s rule, by name and shape only, so the planner can count
them from a model's shapes as the trainer sorts its parameters."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.sections import OPTIMIZERS, MUON_LR_ADJUSTS, MUON_EXCHANGES, MUON_NS_DTYPES  # noqa: F401 (the vocabularies of the rows' keys)

ADAMW_STATES = 2
"""fp32 states per parameter AdamW keeps: ``exp_avg`` and ``exp_avg_sq`` (Loshchilov & Hutter 2019, Alg. 2)."""
ADAMW_UPDATE_FLOPS = 12
"""Elementwise FLOPs per parameter of one AdamW update (two moment updates, bias corrections, the division by
``sqrt(v) + eps``, decoupled decay and the step: PyTorch's ``_single_tensor_adam``, ~12 operations)."""
MUON_STATES = 1
"""fp32 states per parameter Muon keeps: the momentum buffer (Jordan et al. 2024)."""
MUON_UPDATE_FLOPS = 8
"""Elementwise FLOPs per parameter of Muon outside Newton-Schulz: the momentum lerp (3), the Nesterov lerp (3),
decay and step (2)."""
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T`` (Jordan et al.
2024, "Muon: an optimizer for hidden layers", the published coefficients that maximise the slope at zero; the
same as ``torch.optim.Muon``'s)."""
NOT_MUON = ("router", "shared_gate")
"""Module names inside a block whose matrices stay with AdamW: a mixture of experts' router and a shared expert's
gate (one row: a vector, not a matrix to orthogonalize)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: what it keeps and computes per parameter, and which parameters it takes.

    ``states``: fp32 tensors of the parameter's shape kept per parameter it takes; ``update_flops``: elementwise FLOPs
    per parameter per step; ``hidden_matrices``: it takes the blocks' matrices only (:func:`takes_muon`), AdamW the
    rest; ``source``: the paper and equation. Matrix FLOPs beyond the elementwise ones (Newton-Schulz) are
    :func:`newton_schulz_flops`."""

    name: str
    states: int
    update_flops: int
    hidden_matrices: bool
    source: str


TABLE: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", ADAMW_STATES, ADAMW_UPDATE_FLOPS, False,
                           "Loshchilov & Hutter 2019, Decoupled Weight Decay Regularization, Alg. 2"),
    "sgd": OptimizerSpec("sgd", 0, 2, False, "plain SGD, weight decay as an L2 term"),
    "muon": OptimizerSpec("muon", MUON_STATES, MUON_UPDATE_FLOPS, True,
                          "Jordan et al. 2024 (Muon); Liu et al. 2025, Muon is Scalable for LLM Training, Sec. 2"),
}
assert tuple(TABLE) == OPTIMIZERS, "optim.name's values (config.sections.OPTIMIZERS) are the table's rows"


def takes_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon trains the parameter ``name`` (its dotted name, any wrapper prefix) of ``shape``: a matrix (2-D)
    or a stack of experts' matrices (3-D) inside a transformer block whose two matrix dimensions both exceed 1,
    except a router or a shared expert's gate (:data:`NOT_MUON`); a recurrent family's gate matrices are its blocks'
    matrices too. Embeddings, the output head, norms, biases and routers stay with AdamW, as in Liu et al. 2025 (Sec. 2.2) and
    ``torch.optim.Muon``'s documentation."""
    parts = name.split(".")
    return ("blocks" in parts and len(shape) in (2, 3) and min(shape[-2:]) > 1
            and not any(part in NOT_MUON for part in parts))


def muon_lr_ratio(rule: str, shape: tuple[int, ...]) -> float:
    """Muon's learning-rate factor for a matrix of the last two dimensions (A, B) of ``shape``: "match_rms_adamw"
    ``0.2 * sqrt(max(A, B))`` (Liu et al. 2025, Sec. 2.2, Eq. 4: the update's RMS matches AdamW's, so AdamW's
    learning rate and weight decay carry over), "original" ``sqrt(max(1, A / B))`` (Jordan et al. 2024), "none" 1.
    ``torch.optim.Muon``'s ``adjust_lr_fn`` with the same names."""
    a, b = shape[-2:]
    if rule == "match_rms_adamw":
        return 0.2 * max(a, b) ** 0.5
    if rule == "original":
        return max(1.0, a / b) ** 0.5
    return 1.0


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on each (A, B) matrix of ``shape`` (a stack for 3-D): with
    m = min(A, B), n = max(A, B), each iteration computes ``X X^T`` (2 m^2 n), ``A^2`` (2 m^3) and ``(bA + cA^2) X``
    (2 m^2 n), so ``steps * (4 m^2 n + 2 m^3)`` per matrix."""
    m, n = sorted(shape[-2:])
    matrices = shape[0] if len(shape) == 3 else 1
    return matrices * steps * (4.0 * m * m * n + 2.0 * m ** 3)
