"""Bytes that the element-wise kernels of one eager transformer block move, forward + backward, counted operator
by operator under torch's dispatcher, next to the planner's fused count; the source of
``Framework.eager_elementwise`` (docs/planner.md, "Validation against published runs").

    python bench/eager_elementwise.py [--torchtitan PATH]     # a few seconds; writes bench/results/eager_elementwise.md

Every aten operator a block's forward and backward dispatch is counted except the GEMMs, the attention kernel,
the embedding and views/allocations: the bytes of its tensor inputs and outputs that hold values per token, shaped
(B, ..., T, ...) or (B*T, ...) (weights, norm scales and RoPE tables are left out), divided by the tokens. Each block runs at several widths, and ``a*h + b*kv + c*f`` is solved from them (least
squares; the residual says whether the count is exactly linear).

- meshtrain's GPT and Llama blocks (``meshtrain.models``), fp32;
- with ``--torchtitan PATH`` (a checkout of pytorch/torchtitan at commit 9dec370, December 2024: the version of
  its published performance tables), its Llama ``TransformerBlock`` in bf16, with its own RMSNorm (fp32 inside)
  and complex RoPE. Its ``models/norms.py`` imports Triton for a fused norm that the tables did not use; the
  script loads only the file's part before that kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_results  # noqa: E402

NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "embedding", "embedding_dense_backward",
                   "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                   "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                   "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select",
                   "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "alias", "detach", "as_strided",
                   "view_as_complex", "view_as_real", "_reshape_alias", "lift_fresh", "empty", "empty_like",
                   "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros", "ones",
                   "ones_like", "full", "scalar_tensor"}
WIDTHS = [(256, 8, 2, 16), (512, 8, 2, 64), (384, 6, 3, 32), (512, 16, 4, 256), (384, 12, 4, 128), (256, 8, 4, 64),
          (256, 8, 8, 16), (384, 6, 6, 128), (512, 8, 8, 64), (320, 10, 10, 256)]
"""(h, heads, kv heads, multiple_of: the SwiGLU width's rounding, so that f varies apart from h) of the blocks
counted, grouped K/V first; B = 3 sequences of T = 32 tokens (distinct sizes, so per-token tensors are told apart)."""
B, T = 3, 32


class ElementwiseBytes(TorchDispatchMode):
    """Sums the per-token tensor bytes of every element-wise operator dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NOT_ELEMENTWISE:
            self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if per_token(t))
        return out


def per_token(t: object) -> bool:
    """Whether ``t`` holds values per token: shaped (B, ..., T, ...) or (B*T, ...) (not a weight, a norm scale or a
    (T, head_dim) RoPE table)."""
    return isinstance(t, torch.Tensor) and t.dim() >= 1 and (
        t.shape[0] == B * T or (t.dim() >= 2 and t.shape[0] == B and T in t.shape[1:]))


def count(block, x: torch.Tensor, *extra) -> float:
    """Element-wise bytes per token of ``block(x, *extra)`` forward and backward."""
    mode = ElementwiseBytes()
    with mode:
        y = block(x, *extra)
        y.backward(torch.ones_like(y))
    return mode.total / (B * T)


def meshtrain_block(kind: str, h: int, heads: int, kv: int, multiple_of: int):
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model

    overrides = {"model.n_layer": "1", "model.n_head": str(heads), "model.n_embd": str(h), "model.block_size": str(T),
                 "model.dropout": "0.0"}
    if kind == "llama":
        overrides |= {"model.type": "llama", "model.n_kv_head": str(kv), "model.multiple_of": str(multiple_of)}
    cfg = load_config(REPO / "configs" / "shakespeare_char.toml", overrides)
    model = build_model(cfg.model, 50)
    block = next(iter(model.blocks.values()))
    extra = model.rope(torch.arange(T), torch.float32) if kind == "llama" else ()
    f = cfg.model.ffn_hidden_size() if kind == "llama" else 4 * h
    x = torch.randn(B, T, h, requires_grad=True)
    kv_dim = h // heads * (kv if kind == "llama" else heads)
    return count(block, x, *extra), kv_dim, f


def torchtitan_module(path: Path) -> types.ModuleType:
    """torchtitan's ``models/llama/model.py`` from a checkout, with ``models/norms.py`` up to its Triton kernel."""
    norms_src = (path / "torchtitan/models/norms.py").read_text()
    norms_src = norms_src.split("# FusedRMSNorm in Triton")[0]
    norms_src = "\n".join(line for line in norms_src.splitlines()
                          if not line.startswith(("import triton", "from torchtitan.utils")))
    for name in ("torchtitan", "torchtitan.models"):
        sys.modules.setdefault(name, types.ModuleType(name))
    norms = types.ModuleType("torchtitan.models.norms")
    exec(compile(norms_src, str(path / "torchtitan/models/norms.py"), "exec"), norms.__dict__)
    sys.modules["torchtitan.models.norms"] = norms
    spec = importlib.util.spec_from_file_location("torchtitan_llama", path / "torchtitan/models/llama/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchtitan_block(module: types.ModuleType, h: int, heads: int, kv: int, multiple_of: int):
    args = module.ModelArgs(dim=h, n_layers=1, n_heads=heads, n_kv_heads=kv, vocab_size=100, multiple_of=multiple_of,
                            max_seq_len=T)
    block = module.TransformerBlock(0, args).to(torch.bfloat16)
    x = torch.randn(B, T, h, dtype=torch.bfloat16, requires_grad=True)
    return count(block, x, module.precompute_freqs_cis(h // heads, T)), h // heads * kv, block.feed_forward.w1.weight.shape[0]


def solve(rows: list[tuple[float, int, int, int]], grouped: bool) -> tuple[list[float], float]:
    """(a, b, c) of ``a*h + b*kv + c*f (+ a constant, dropped)`` over the rows with (grouped) or without grouped
    K/V (where kv = h, so b is 0 and a counts both), and the largest residual in bytes per token. A GPT (f = 4h)
    gets ``a`` alone."""
    rows = [r for r in rows if (r[2] < r[1]) == grouped]
    columns = [lambda h, kv, f: h] + ([lambda h, kv, f: kv] if grouped else [])
    if len({f / h for _, h, _, f in rows}) > 1:
        columns.append(lambda h, kv, f: f)
    columns.append(lambda h, kv, f: 1.0)  # per-token scalars (a norm's rstd, a loss of one value per token)
    A = np.array([[col(h, kv, f) for col in columns] for _, h, kv, f in rows], float)
    y = np.array([c for c, *_ in rows])
    solution = np.linalg.lstsq(A, y, rcond=None)[0]
    residual = float(np.abs(A @ solution - y).max())
    coef = list(solution[:-1])
    if not grouped:
        coef.insert(1, 0.0)
    if len(coef) == 2:
        coef.append(0.0)
    return coef, residual


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchtitan", type=Path, help="a pytorch/torchtitan checkout (commit 9dec370)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    blocks = {"meshtrain GPT (fp32, f = 4h)": lambda h, a, k, m: meshtrain_block("gpt", h, a, h // a, m),
              "meshtrain Llama (fp32)": lambda h, a, k, m: meshtrain_block("llama", h, a, k, m)}
    if args.torchtitan:
        module = torchtitan_module(args.torchtitan)
        blocks["torchtitan Llama, 9dec370 (bf16)"] = lambda h, a, k, m: torchtitan_block(module, h, a, k, m)
    table, data = [], {}
    for name, build in blocks.items():
        rows = [(c, h, kv, f) for (h, heads, kv_heads, m) in WIDTHS for c, kv, f in [build(h, heads, kv_heads, m)]]
        data[name] = {"counts": rows}
        for grouped in (True, False):
            if not any((kv < h) == grouped for _, h, kv, _ in rows):
                continue
            (a, b, c), residual = solve(rows, grouped)
            data[name]["grouped" if grouped else "per_head"] = {"h": a, "kv": b, "f": c, "residual": residual}
            table.append([name, "grouped K/V" if grouped else "one K/V per head", f"{a:.1f} h + {b:.1f} kv + {c:.1f} f",
                          f"{residual:.1f}"])
    write_results("eager_elementwise", "Element-wise bytes of one eager block, counted per operator",
                  ["block", "attention", "bytes per token and layer, forward + backward",
                   "largest residual (bytes/token)"], table, data=data,
                  notes=[f"{len(WIDTHS)} widths (h, heads, kv heads, multiple_of) = {WIDTHS}, {B} x {T} tokens; GEMMs, the attention "
                         "kernel, the embedding, views and allocations excluded; only tensors of one value or more per "
                         "token counted.",
                         "The planner's fused count (one kernel per norm, activation and residual add, 16-bit) is "
                         "3 x 2 x (10h + m f) bytes: 60h + 18f for a SwiGLU block.",
                         "The fits keep a constant (per-token scalars such as a norm's rstd: 120 bytes in meshtrain's "
                         "fp32 Llama), which the planner leaves out. A single K/V head (kv heads = 1, not counted "
                         "here) moves 16 kv bytes less in meshtrain's Llama."])


if __name__ == "__main__":
    main()
