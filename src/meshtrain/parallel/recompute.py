"""Activation recomputation (``train.recompute``) and compiled blocks (``train.compile``), per transformer block.

Both act on each block of a model (or of a pipeline chunk) after tp and sp have replaced its layers and
before DDP/FSDP2 wrap it -- torchtitan's order (``models/llama3/infra/parallelize.py``: TP -> activation
checkpointing -> compile -> FSDP). The block keeps its module and parameter names: its ``forward`` is
replaced on the instance, so tensor-parallel plans, FSDP2 units and checkpoints see the same model.

Modes (Chen et al. 2016, arXiv:1604.06174, "Training Deep Nets with Sublinear Memory Cost", Sec. 3):

- "full": ``torch.utils.checkpoint.checkpoint`` (non-reentrant) around the block: forward keeps only
  the block's input; backward runs the block's forward again (its tp/sp communication included) and
  then its backward.
- "selective": per-operator selective activation checkpointing, the policy of torchtitan's op-level
  mode (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the weight GEMMs
  (``aten.mm``/``addmm``: Q, K, V, attention projection, MLP up/gate and down), of the fused attention
  kernel (SDPA's output and log-sum-exp) and of tp/sp collectives (functional all-reduce, all-gather,
  reduce-scatter, all-to-all) are kept; everything else in the block -- norms, activation functions,
  dropout, RoPE, residual adds, views -- is recomputed in backward. So no GEMM, attention kernel or
  Megatron/Ulysses collective runs twice; ring attention's point-to-point passes are not functional
  collectives and do run again. The planner models exactly this (:mod:`meshtrain.planner.memory`,
  :mod:`meshtrain.planner.cost`).

Dropout: the checkpoint restores the default generator's state before recomputing, and the blocks'
tensor-parallel dropout stream (:class:`meshtrain.parallel.rng.TPRegionRNG`, ``rng``) is rewound to where
it stood when the block first ran, so every recomputed mask equals the forward's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshtrain.axes import RECOMPUTE_MODES


def _saved_ops() -> frozenset:
    """The operators whose outputs "selective" keeps (see the module docstring); those absent from this
    build of torch (a CUDA-only kernel) are skipped."""
    names = [("aten", "mm"), ("aten", "addmm"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu"), ("aten", "_scaled_dot_product_flash_attention"),
             ("aten", "_scaled_dot_product_efficient_attention"), ("aten", "_scaled_dot_product_cudnn_attention"),
             ("_c10d_functional", "all_reduce"), ("_c10d_functional", "all_gather_into_tensor"),
             ("_c10d_functional", "reduce_scatter_tensor"), ("_c10d_functional", "all_to_all_single")]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            ops.add(packet.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of :data:`SAVED_OPS`, recompute every other operator's."""
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple:
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_recompute(blocks: nn.ModuleDict, mode: str, rng: Any = None) -> None:
    """Make every block of ``blocks`` recompute its activations in backward as ``mode`` says (in place).

    ``mode``: "none" (nothing changes), "selective" or "full" (the module docstring). ``rng``: the model's
    :class:`meshtrain.parallel.rng.TPRegionRNG` under tp (None otherwise), rewound for each recomputation.

    Raises:
        ValueError: ``mode`` not one of :data:`RECOMPUTE_MODES`.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute = {mode!r} is not valid: use one of {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return
    kwargs = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for block in blocks.values():
        block.forward = functools.partial(_checkpointed, block.forward, rng, kwargs)


def _checkpointed(forward: Callable, rng: Any, kwargs: dict, *args: Any, **kw: Any) -> Any:
    """``forward(*args, **kw)`` under a non-reentrant checkpoint, the tp dropout stream rewound on recompute."""
    if rng is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs, **kw)
    start, calls = rng.state, []

    def run(*a: Any, **k: Any) -> Any:
        if not calls:  # the forward pass
            calls.append(True)
            return forward(*a, **k)
        now, rng.state = rng.state, start  # a recomputation: draw the forward's masks again
        try:
            return forward(*a, **k)
        finally:
            rng.state = now

    return checkpoint(run, *args, use_reentrant=False, **kwargs, **kw)


def compile_blocks(blocks: nn.ModuleDict, split_backward: bool = False) -> None:
    """``torch.compile`` every block of ``blocks`` in place (``nn.Module.compile``: names unchanged), after
    :func:`apply_recompute` so that the checkpoint is traced into the compiled graph (torchtitan's order).

    ``split_backward``: the blocks run under a zero-bubble schedule, whose input-gradient pass keeps the graph
    (``retain_graph=True``) for the weight-gradient pass. AOTAutograd's compiled backward donates its saved
    buffers by default, which torch 2.13 refuses under ``retain_graph`` ("compiled with non-empty donated
    buffers"), so donation is turned off for this process (``torch._functorch.config.donated_buffer``).
    """
    if split_backward:
        import torch._functorch.config

        torch._functorch.config.donated_buffer = False
    for block in blocks.values():
        block.compile()
