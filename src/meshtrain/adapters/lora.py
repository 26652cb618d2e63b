"""Low-rank adapters (LoRA) on a model's linear maps, after tensor parallelism has split them, and the frozen base.

``h = W x + s * B(A(dropout(x)))`` with ``A`` (r, in) and ``B`` (out, r) trained and ``W`` frozen (Hu et al. 2021,
arXiv:2106.09685, Eq. 3; ``s`` from :func:`meshtrain.adapters.spec.lora_scaling`). Initialised as peft does it
(``LoraLayer.reset_lora_parameters``): ``A`` uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` (``nn.Linear``'s own
initialisation, Kaiming-uniform with ``a = sqrt(5)``), ``B`` zero, so the adapted model starts equal to the base.

Adapters are added to a module that is already tensor-parallel, by giving it two more linear maps and the forward
above (its class becomes :class:`LoRALinear`, a subclass of ``nn.Linear``, in place, as FSDP2's ``fully_shard``
changes a module's class): the module keeps its name, its weight and the input/output hooks the tensor-parallel
plan put on it, so checkpoints, Hugging Face import and the plan are unchanged. The adapters follow their base
(Megatron-LM's layout, Shoeybi et al. 2019, Sec. 3):

- column-parallel ``W`` (``Shard(0)``: out/tp rows per rank): ``A`` replicated, ``B`` sharded by output rows, so
  each rank computes its out/tp features of ``B A x``; ``A``'s gradient is a partial sum over the tp ranks
  (each holds out/tp rows of ``B``) that :func:`meshtrain.parallel.reduce.reduce_partial_grads` all-reduces;
- row-parallel ``W`` (``Shard(1)``): ``A`` sharded by input columns, ``B`` replicated: each rank's ``B A_i x_i``
  is a partial sum that the base's own all-reduce (reduce-scatter with sequence parallelism) adds up with
  ``W_i x_i``, so the forward needs no collective of its own; ``B``'s gradient is a partial sum, all-reduced.

Shape legend: in, out the base's features (global), r the rank.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshtrain.adapters.experts import LoRAExperts, add_expert_lora, merge_expert_lora
from meshtrain.adapters.saved import SAVED_MODULES, saved_modules, tied_embeddings
from meshtrain.adapters.spec import EXPERTS_PATH, lora_scaling, targeted_experts, targeted_paths
from meshtrain.models.base import is_adapter


MERGED_FORWARD = True
"""Whether :class:`LoRALinear` may take :class:`_MergedLoRA` (the same numbers up to rounding);
``bench/bench_lora_steps.py`` turns it off for some steps to time the unmerged path beside it."""
FUSED_FORWARD = True
"""Whether :class:`LoRALinear` may take :class:`_FusedLoRA` in 16-bit compute (the same numbers up to rounding);
``bench/bench_lora_steps.py`` turns it off for some steps to time the plain path beside it."""
_HALF = (torch.bfloat16, torch.float16)
"""The 16-bit compute dtypes :class:`_FusedLoRA` runs in."""


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` ``W`` (out, in) with a low-rank adapter: ``lora_A`` (r, in), ``lora_B`` (out, r), both
    without bias, ``lora_dropout`` on the adapter's input and the factor ``scaling``. Made by :func:`add_lora`."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + b``: the frozen base's output (NF4-stored in :class:`meshtrain.adapters.nf4.NF4LoRALinear`)."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., in) -> (..., out): ``W x + b + scaling * B A dropout(x)`` (under tp: this rank's features, or
        a partial sum the base's reduction finishes). The scaling multiplies ``B`` (out x r), not the adapter's
        output (tokens x out) as peft does: one small product instead of an activation-sized one and its backward
        (the same value up to rounding). With no dropout on the adapter's input (``lora_dropout = 0``, or eval), a
        frozen ``W`` and a plain base (:meth:`_plain`), an fp32 base without autocast takes :class:`_MergedLoRA`
        (through ``W + scaling * B A``) and 16-bit compute (bf16 autocast, or 16-bit weights) :class:`_FusedLoRA`
        (``W x`` and the adapter's term accumulated in one output); both compute the same output with fewer
        activation-sized operations."""
        if self._mergeable(x):
            return _MergedLoRA.apply(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling)
        if self._fusable(x):
            dtype = _compute_dtype(x)
            return _FusedLoRA.apply(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                                    dtype)
        h = self.lora_A(self.lora_dropout(x))  # (..., r)
        return self.base_output(x) + F.linear(h, self.lora_B.weight * self.scaling)

    def _plain(self) -> bool:
        """Whether the adapter may run inside one autograd function: this very class (not DoRA's, not an NF4 base),
        plain tensors (no tp DTensors), no dropout in effect and a frozen base weight (and bias), whose gradient
        neither fast path computes."""
        return (type(self) is LoRALinear and not isinstance(self.weight, DTensor)
                and (isinstance(self.lora_dropout, nn.Identity) or not self.training)
                and not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad))

    def _mergeable(self, x: torch.Tensor) -> bool:
        """Whether :class:`_MergedLoRA` computes this forward: :meth:`_plain`, fp32 (or fp64) throughout and no
        autocast. A 16-bit ``W + s B A`` would round the adapter's update away (bf16 keeps 8 significant bits: next
        to a weight in [1/32, 1/16) the spacing is 2^-12, and an update under ~1.2e-4 vanishes), so bf16 runs
        (``train.dtype = "bfloat16"``: autocast) take :class:`_FusedLoRA` instead (:meth:`_fusable`), where
        ``s B A x`` stays a term of its own."""
        return (MERGED_FORWARD and self._plain() and self.weight.dtype == x.dtype == self.lora_A.weight.dtype
                and x.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled(x.device.type))

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether :class:`_FusedLoRA` computes this forward: :meth:`_plain` and 16-bit compute, either autocast to
        bf16/fp16 (the weights fp32 masters, as ``train.dtype = "bfloat16"`` runs) or a model held in bf16/fp16
        without autocast (``x``, ``W`` and ``A`` of that dtype)."""
        if not (FUSED_FORWARD and self._plain()):
            return False
        if torch.is_autocast_enabled(x.device.type):  # autocast leaves fp64 alone: so does this
            return x.dtype in _HALF + (torch.float32,) and _compute_dtype(x) in _HALF
        return self.weight.dtype == x.dtype == self.lora_A.weight.dtype and x.dtype in _HALF


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear map of ``x`` computes in: autocast's on ``x``'s device where it is on, else ``x``'s own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _MergedLoRA(torch.autograd.Function):
    """``y = x (W + s B A)^T + b`` with ``W`` and ``b`` frozen: LoRA's output (Hu et al. 2021, Eq. 3, ``h = W0 x +
    B A x``, scaled by ``s``) computed through the merged weight, which Sec. 4.1 of the paper uses for inference, and
    trained through it with the adapters' own gradients (no ``out x in`` weight gradient is formed).

    Shapes: ``x`` (..., in), ``W`` (out, in), ``b`` (out,) or None, ``A`` (r, in), ``B`` (out, r), ``s`` a float;
    N the tokens of ``x``. Forward: ``h^T = A x^T`` (r, N), kept for ``B``'s gradient; ``M = W + s B A`` (out, in),
    one (out, r) x (r, in) product; ``y = x M^T + b``. Backward, with ``g = dL/dy`` (N, out): ``dL/dB = s (h^T g)^T``,
    ``dL/dA = s (g B)^T x``, ``dL/dx = g M`` (``M`` recomputed, not saved: it is the size of the weight). Against
    the unmerged ``x W^T + s (x A^T) B^T`` this drops the (N, out) addition and the (N, r) x (r, out) product of the
    forward, and the (N, in) addition and (N, r) x (r, in) product of the backward, for two (out, r) x (r, in)
    products and two weight-sized additions; the value is the same up to the rounding of the reordered sums. ``h``
    is kept transposed, (r, N), because ``h^T g`` (a wide (r, out) result) runs about twice as fast on this CPU's
    BLAS as ``g^T h`` (a skinny (out, r) one) at r = 8, N = 1536 (``torch.mm`` timed alone on one thread)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling):
        ctx.scaling = scaling
        ht = torch.mm(a, x.reshape(-1, x.shape[-1]).t())  # (r, N): h^T
        ctx.save_for_backward(x, ht, weight, a, b)
        return F.linear(x, torch.addmm(weight, b, a, alpha=scaling), bias)  # x (W + s B A)^T + b

    @staticmethod
    def backward(ctx, grad):
        x, ht, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])  # (N, out)
        grad_a = grad_b = grad_x = None
        if ctx.needs_input_grad[3]:
            grad_a = torch.mm(torch.mm(g, b).t(), x.reshape(-1, x.shape[-1])).mul_(s)  # (r, in)
        if ctx.needs_input_grad[4]:
            grad_b = torch.mm(ht, g).mul_(s).t()  # (out, r)
        if ctx.needs_input_grad[0]:
            grad_x = grad @ torch.addmm(weight, b, a, alpha=s)  # (..., in)
        return grad_x, None, None, grad_a, grad_b, None


class _FusedLoRA(torch.autograd.Function):
    """``y = x W^T + b + (x A^T)(s B)^T`` with ``W`` and ``b`` frozen, in 16-bit compute: LoRA's output (Hu et al.
    2021, Eq. 3) unmerged, as the plain path computes it, in one autograd function whose products accumulate into
    one output each (``torch.Tensor.addmm_``: the GEMM adds its result to the tensor it writes, with the same fp32
    accumulator) instead of a separate activation-sized product, addition and cast per term.

    Shapes: ``x`` (..., in), ``W`` (out, in), ``b`` (out,) or None, ``A`` (r, in), ``B`` (out, r), ``s`` a float,
    ``dtype`` the compute dtype (bf16 or fp16: autocast's, or the weights' own); N the tokens of ``x``. The inputs are
    cast to ``dtype`` as autocast casts them (``s B`` formed in ``B``'s dtype, then cast, as the plain path's
    ``F.linear(h, B * s)``). Forward: ``h = x A^T`` (N, r), ``y = x W^T + b``, then ``y += h (s B)^T``. Backward, with
    ``g = dL/dy`` (N, out): ``e = g (s B)`` (N, r), ``dL/dA = e^T x``, ``dL/dB = s (g^T h)``, ``dL/dx = g W`` then
    ``+= e A``; no gradient of the frozen ``W``. Saved: ``x`` and ``W`` in ``dtype`` (what autocast's ``F.linear``
    saves), ``h`` and the small ``A``, ``s B``. The gradients are cast back to the inputs' dtypes (fp32 masters
    under autocast), as autocast's casts do.

    Rounding against the plain path (u = 2^-8 for bf16): the plain path rounds ``x W^T + b`` and ``h (s B)^T`` to
    ``dtype`` and their sum again; here the second product is added before its rounding, so ``y`` is rounded twice,
    not three times. ``dL/dx``: the plain path rounds ``g W`` and ``e A`` (and, for a 16-bit ``x``, their sum);
    here ``g W`` is rounded and then the sum. With the rounding of ``h`` (or ``e``) each path is within 3u M of the
    exact value, M the sum of the terms' magnitudes (``tests/test_lora_more.py`` holds the two within 6u M); the
    16-bit ``W + s B A`` that :class:`_MergedLoRA` would form, which loses small updates, is never formed."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling, dtype):
        ctx.scaling, ctx.dtypes = scaling, (x.dtype, a.dtype, b.dtype)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)  # (N, in)
        w, a16, bs = weight.to(dtype), a.to(dtype), (b * scaling).to(dtype)  # (out, in), (r, in), (out, r)
        h = torch.mm(x2, a16.t())  # (N, r)
        y = F.linear(x2, w, None if bias is None else bias.to(dtype))  # (N, out): x W^T + b
        y.addmm_(h, bs.t())  # += h (s B)^T, in the GEMM's accumulator
        ctx.save_for_backward(x2, w, h, a16, bs)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, w, h, a16, bs = ctx.saved_tensors
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        g = grad.reshape(-1, grad.shape[-1]).to(w.dtype)  # (N, out)
        e = torch.mm(g, bs)  # (N, r): dL/dh
        grad_a = torch.mm(e.t(), x2).to(a_dtype) if ctx.needs_input_grad[3] else None  # (r, in)
        grad_b = torch.mm(h.t(), g).t().to(b_dtype).mul_(ctx.scaling) if ctx.needs_input_grad[4] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g, w).addmm_(e, a16)  # (N, in): g W + e A
            grad_x = grad_x.view(*grad.shape[:-1], grad_x.shape[-1]).to(x_dtype)
        return grad_x, None, None, grad_a, grad_b, None, None


def _placements(weight: torch.Tensor) -> tuple[tuple, tuple] | None:
    """The placements of ``A`` and ``B`` that follow the base ``weight`` (a DTensor on a 1-D tp mesh), see the module
    docstring; None for a plain tensor."""
    if not isinstance(weight, DTensor):
        return None
    kind = weight.placements[0]
    if isinstance(kind, Shard) and kind.dim == 0:  # column-parallel
        return (Replicate(),), (Shard(0),)
    if isinstance(kind, Shard) and kind.dim == 1:  # row-parallel
        return (Shard(1),), (Replicate(),)
    return (Replicate(),), (Replicate(),)


def add_lora(linear: nn.Linear, rank: int, scaling: float, dropout: float, seed: int) -> LoRALinear:
    """Give ``linear`` (plain, or tensor-parallel: a DTensor weight) an adapter of rank ``rank``, in place; return it.

    ``A`` is drawn from a CPU generator seeded with ``seed`` (the same on every rank and layout), ``B`` is zero;
    under tp each rank keeps its slice of them (``distribute_tensor`` of equal tensors, no communication).
    """
    weight = linear.weight
    out_features, in_features = weight.shape  # global, for a DTensor too
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(in_features)  # nn.Linear's Kaiming-uniform (a = sqrt(5)), peft's init of A
    a = (torch.rand(rank, in_features, generator=generator, dtype=torch.float32) * 2 - 1) * bound
    b = torch.zeros(out_features, rank)
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    a, b = (t.to(device=local.device, dtype=local.dtype) for t in (a, b))
    placements = _placements(weight)
    if placements is not None:
        a, b = (distribute_tensor(t, weight.device_mesh, p, src_data_rank=None) for t, p in zip((a, b), placements))
    linear.lora_A = _linear_of(a)
    linear.lora_B = _linear_of(b)
    linear.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    linear.scaling = scaling
    linear.__class__ = LoRALinear
    return linear


def tp_split_dropouts(model: nn.Module) -> list[nn.Module]:
    """The adapters' dropouts whose input is split across tp ranks: those of row-parallel bases (``A`` sharded by
    input columns), whose ranks each hold a slice of the input's features and so need independent masks, drawn on
    the per-rank stream (:class:`meshtrain.parallel.rng.TPRegionRNG`). A column-parallel base's input is whole
    (replicated, or all-gathered from sequence shards) on every tp rank: its dropout draws from the default stream,
    the same mask on every rank, as one process's single mask over the same input (Megatron's rule, Shoeybi et al.
    2019, Sec. 3)."""
    return [m.lora_dropout for m in model.modules()
            if isinstance(m, LoRALinear) and isinstance(m.lora_A.weight, DTensor)
            and any(isinstance(p, Shard) and p.dim == 1 for p in m.lora_A.weight.placements)]


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` without bias whose weight (out, in) is ``weight`` (plain or DTensor)."""
    module = nn.Linear(1, 1, bias=False, device="meta")
    module.weight = nn.Parameter(weight)
    module.in_features, module.out_features = weight.shape[1], weight.shape[0]
    return module


def add_adapters(model: nn.Module, adapter, model_cfg) -> list[str]:
    """Adapt the modules of every block of ``model`` (a whole model or a pipeline chunk, after tp) that
    ``adapter.lora_targets`` names, then freeze every other parameter but those of the modules
    ``adapter.modules_to_save`` names (the embedding, the head: trained in full, peft's ``ModulesToSaveWrapper``
    without its second copy, since the base here is never needed again beside them); return the adapted modules'
    names (:func:`meshtrain.adapters.apply.adapt` also adds DoRA's magnitudes, and quantizes the base for QLoRA).

    ``adapter``: the ``[adapter]`` section (``lora_rank`` > 0); ``model_cfg``: the ``[model]`` section. Each
    adapter's ``A`` is seeded from the model's ``init_seed`` and the module's name, so it is the same whichever
    layout or pipeline stage holds it.
    """
    paths = targeted_paths(model_cfg, list(adapter.lora_targets))
    kinds = targeted_experts(model_cfg, list(adapter.lora_targets))
    scaling = lora_scaling(adapter.lora_alpha, adapter.lora_rank, adapter.use_rslora)
    names = []
    for key, block in model.blocks.items():
        for path in paths:
            name = f"blocks.{key}.{path}"
            add_lora(block.get_submodule(path), adapter.lora_rank, scaling, adapter.lora_dropout, _seed(model, name))
            names.append(name)
        if kinds:  # the routed experts' stacks (:mod:`meshtrain.adapters.experts`)
            name = f"blocks.{key}.{EXPERTS_PATH}"
            add_expert_lora(block.get_submodule(EXPERTS_PATH), kinds, adapter.lora_rank, scaling, _seed(model, name))
            names.append(name)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    saved = saved_modules(model_cfg, list(adapter.modules_to_save))
    for module in SAVED_MODULES if saved and tied_embeddings(model_cfg) else saved:  # a pipeline's untied copies too
        if getattr(model, module, None) is not None:  # a pipeline chunk may hold neither
            getattr(model, module).requires_grad_(True)
    return names


def _seed(model: nn.Module, name: str) -> int:
    """The seed of the adapter of module ``name``: the model's ``init_seed`` and the name, whatever the layout."""
    return (model.init_seed + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter of ``model`` (one process, plain tensors; an NF4 base dequantized first, by
    :func:`meshtrain.adapters.apply.merge`) into its base, ``W <- W + scaling * B A`` (Hu et
    al. 2021, Sec. 4.1: "we can explicitly compute and store W = W0 + BA"), and make the module a plain
    ``nn.Linear`` again, so the state is a plain model's (an ``export --format hf --merge``). Returns how many
    modules were merged."""
    merged = 0
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight += module.scaling * (module.lora_B.weight @ module.lora_A.weight)  # (out, r) @ (r, in)
            del module.lora_A, module.lora_B, module.lora_dropout, module.scaling
            module.__class__ = nn.Linear
            merged += 1
        elif isinstance(module, LoRAExperts):
            merge_expert_lora(module)
            merged += 1
    return merged
