"""The device a rank computes on and the precision it computes in: ``cuda:LOCAL_RANK`` with nccl or the CPU
with gloo, and ``train.dtype`` resolved to what the hardware runs fast (bf16 autocast or fp32)."""

from __future__ import annotations

import contextlib
import os

import torch


def device_and_backend() -> tuple[torch.device, str]:
    """(device, backend): ``cuda:LOCAL_RANK`` with nccl when CUDA is present, else ``cpu`` with gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def compute_dtype(name: str, device_type: str) -> str:
    """The dtype ``train.dtype = name`` trains in on ``device_type`` ("cpu"/"cuda"): "float32" or "bfloat16".

    "auto" is bfloat16 where matmuls have bf16 hardware: a CUDA GPU with bf16 (Ampere and newer,
    ``torch.cuda.is_bf16_supported()``) or a CPU with AVX512-BF16/AMX (oneDNN's bf16 path,
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); elsewhere float32, because bf16 GEMMs emulated on
    an AVX2-only CPU ran 30-180x slower than fp32 (docs/benchmarks.md)."""
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def autocast(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context a forward runs in for ``dtype`` (a :func:`compute_dtype` result) on ``device_type``:
    bf16 autocast (fp32 master weights, matmuls in bf16) for "bfloat16", nothing for "float32"."""
    return torch.autocast(device_type, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()
