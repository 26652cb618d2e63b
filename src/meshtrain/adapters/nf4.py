"""QLoRA's frozen base: each block's linear weights stored as 4-bit NormalFloat (NF4) with double-quantized scales,
dequantized inside the forward (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv:2305.14314, Sec. 3, Eq. 5-6).

The quantization is bitsandbytes' own (``bitsandbytes.functional.quantize_4bit`` / ``dequantize_4bit``, the QLoRA
paper's implementation, which runs on CPU), not a re-implementation: a weight (out, in) is cut into blocks of 64
consecutive values, each stored as 4-bit indices into the 16 NF4 levels (two per byte) times its absolute maximum;
the absolute maxima (one per block) are themselves quantized to 8 bits in blocks of 256 ("double quantization",
Sec. 3), with a fp32 scale per such block and one offset. Bytes per weight: 0.5 + 1/64 + 4/(64*256) ~ 0.516.

Layout: ``in`` must be a multiple of 64, so each block lies in one row; the 4-bit data (out, in/2) and the 8-bit
scales (out, in/64) are frozen ``uint8`` parameters, which FSDP2 shards by rows like any weight (and all-gathers
before the forward); the second-level scales are small buffers every rank holds whole. The base is quantized once,
after it was read (``model.init_from``) and before dp wraps the model; checkpoints never hold it.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.adapters.lora import LoRALinear
from meshtrain.adapters.spec import NF4_BLOCK

BLOCK = NF4_BLOCK
"""Weights per first-level block (QLoRA, Sec. 3: "blocksize of 64")."""
BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK + 4 / (BLOCK * 256)
"""4 bits, 8-bit scale per 64 weights, fp32 scale per 256 scales (QLoRA, Sec. 3, Double Quantization)."""


def _functional():
    """``bitsandbytes.functional``, its warning about an optional CPU kernel package (``kernels``, which would download
    a kernel from the Hugging Face hub) silenced."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes.functional as bnb

    return bnb


class _Dequantized(torch.autograd.Function):
    """``x W^T`` with ``W`` dequantized from ``module``'s NF4 storage in the forward and again in the backward (only
    the 4-bit data stays saved, as bitsandbytes' ``MatMul4Bit`` does); ``W`` is frozen: the gradient goes to ``x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        return F.linear(x, dequantized(module).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ dequantized(ctx.module).to(grad.dtype), None


def dequantized(module: nn.Module) -> torch.Tensor:
    """The weight (out, in) fp32 of an NF4-stored ``module`` (:func:`quantize_linear`), whole (under FSDP2: between
    its all-gather and its reshard): the scales ``code2[scales] * scales2 + offset`` per block of 256, then each weight
    ``code[index] * its block's scale`` (QLoRA, Eq. 6). Computed by bitsandbytes' portable torch kernels (its
    "default" backend, which equal its compiled CPU kernels bit for bit, ``tests/test_qlora.py``): the compiled ones
    run their own OpenMP threads, which contend with torch's and took 16 ms instead of 0.07 ms per call here at 2
    threads."""
    blockwise, four_bit = _portable_kernels()
    packed, scales = (_local(t) for t in (module.nf4_data, module.nf4_scales))
    absmax = blockwise(scales.reshape(-1), module.nf4_scales2, module.nf4_code2, 256, torch.float32) + module.nf4_offset
    return four_bit(packed.reshape(-1), absmax, module.nf4_code, BLOCK, module.nf4_shape, torch.float32)


def _portable_kernels():
    """bitsandbytes' portable dequantization kernels (blockwise 8-bit, 4-bit), as plain torch code: bitsandbytes wraps
    them in ``torch.compile(dynamic=False)``, which compiles again for every weight shape (seconds each); the
    functions under the wrapper (``__wrapped__``) are the same operations run eagerly."""
    _functional()
    from bitsandbytes.backends.default import ops

    return tuple(getattr(f, "__wrapped__", f) for f in (ops._dequantize_blockwise_compute, ops._dequantize_4bit_compute))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose weight is stored as NF4 (:func:`quantize_linear`): ``x W^T + b``, ``W`` dequantized."""

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., in) -> (..., out) through the dequantized frozen weight."""
        y = _Dequantized.apply(x, self)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_output(x)


class NF4LoRALinear(LoRALinear):
    """A :class:`meshtrain.adapters.lora.LoRALinear` whose base weight is stored as NF4: QLoRA's layer (Eq. 6)."""

    base_output = NF4Linear.base_output


@torch.no_grad()
def quantize_linear(module: nn.Linear) -> None:
    """Replace ``module.weight`` (out, in), plain fp32, by its NF4 storage, in place: frozen parameters ``nf4_data``
    (out, in/2) uint8 and ``nf4_scales`` (out, in/64) uint8, buffers ``nf4_scales2`` (fp32, one per 256 scales),
    ``nf4_code2`` (the 256 levels of the scales), ``nf4_code`` (NF4's 16 levels), ``nf4_offset``; the module then
    computes with :func:`dequantized`.

    Raises:
        ValueError: ``in`` is not a multiple of 64 (a block would straddle two rows), or the weight is a DTensor.
    """
    out_features, in_features = module.weight.shape
    if in_features % BLOCK:
        raise ValueError(f"NF4 needs the input width ({in_features}) to be a multiple of {BLOCK}")
    bnb = _functional()
    packed, state = bnb.quantize_4bit(module.weight.detach().float(), blocksize=BLOCK, quant_type="nf4",
                                      compress_statistics=True, quant_storage=torch.uint8)
    del module.weight
    module.nf4_data = nn.Parameter(packed.reshape(out_features, in_features // 2), requires_grad=False)
    module.nf4_scales = nn.Parameter(state.absmax.reshape(out_features, in_features // BLOCK), requires_grad=False)
    for name, value in (("nf4_scales2", state.state2.absmax), ("nf4_code2", state.state2.code), ("nf4_code", state.code),
                        ("nf4_offset", state.offset.reshape(()))):
        module.register_buffer(name, value.clone(), persistent=False)
    module.nf4_shape = (out_features, in_features)
    module.__class__ = NF4LoRALinear if isinstance(module, LoRALinear) else NF4Linear


@torch.no_grad()
def dequantize_linear(module: nn.Linear) -> None:
    """Undo :func:`quantize_linear` in place: ``weight`` becomes the dequantized fp32 (out, in) again, the NF4 storage
    goes, and the module is a plain ``nn.Linear`` (or :class:`LoRALinear`) -- for a merged export."""
    weight = dequantized(module)
    for name in ("nf4_data", "nf4_scales", "nf4_scales2", "nf4_code2", "nf4_code", "nf4_offset", "nf4_shape"):
        delattr(module, name)
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.__class__ = LoRALinear if isinstance(module, LoRALinear) else nn.Linear
