"""The error of DiLoCo's low-precision exchanges on real pseudo-gradients.

    python bench/bench_diloco_precision.py [--workers 4] [--inner-steps 8 32]      # ~1 min

The main job's GPT (fp32) is trained in this process as ``--workers`` workers (each a model copy with its own
AdamW and its own samples, as ``tests/test_diloco.py``'s simulation) for H inner steps from the same start; their
pseudo-gradients (start minus end) are averaged the three ways ``diloco.precision`` allows, exactly as
:mod:`meshtrain.parallel.diloco` does it: fp32; bf16 (each worker's rounded to bf16 and summed in bf16, as a bf16
all-reduce does); int8 (each worker's blocks of 256 values scaled by their absolute maximum / 127, rounded,
averaged in fp32). Reports the relative L2 error of each average against fp32, the largest error of one value
relative to its block's scale, and the bytes a worker sends per value. Writes ``bench/results/diloco_precision.md``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, write_results  # noqa: E402

from meshtrain.config.load import load_config  # noqa: E402
from meshtrain.data.sampler import ShardedSampler  # noqa: E402
from meshtrain.optim.build import build_optimizer  # noqa: E402
from meshtrain.parallel.diloco import INT8_BLOCK, dequantize_int8, quantize_int8  # noqa: E402
from meshtrain.planner.cost import OUTER_VALUE_BYTES  # noqa: E402
from meshtrain.train.setup import set_up  # noqa: E402


def pseudo_gradients(workers: int, H: int) -> list[torch.Tensor]:
    """Each worker's flat pseudo-gradient after H AdamW steps of the main job from its seed's start."""
    cfg = load_config(REPO / "configs" / "shakespeare_char.toml", {"train.dtype": "float32", "optim.warmup_steps": "0"})
    run = set_up(cfg, torch.device("cpu"))
    T, b = cfg.model.block_size, cfg.batch
    start = torch.cat([p.detach().flatten() for p in run.model.parameters()])
    out = []
    for w in range(workers):
        model = copy.deepcopy(run.model)
        optimizer, scheduler = build_optimizer(model.named_parameters(), cfg, b.micro_batch_size * workers)
        sampler = ShardedSampler(run.corpus.train, T, b.micro_batch_size, 1, workers, w, cfg.train.seed)
        for _ in range(H):
            for x, y in sampler.next_step():
                loss = torch.nn.functional.cross_entropy(model(x, torch.arange(T)).flatten(0, 1), y.flatten())
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        out.append(start - torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


def errors(deltas: list[torch.Tensor]) -> dict[str, tuple[float, float]]:
    """precision -> (relative L2 error of the average, largest |error| of a value / its block's scale (int8))."""
    exact = torch.stack(deltas).double().mean(0)
    bf16 = deltas[0].bfloat16()
    for d in deltas[1:]:
        bf16 = bf16 + d.bfloat16()  # a bf16 all-reduce adds in bf16
    int8 = sum(dequantize_int8(*quantize_int8(d), d.numel()) for d in deltas) / len(deltas)
    worst = max(float(((dequantize_int8(*quantize_int8(d), d.numel()) - d).abs()
                       / quantize_int8(d)[1].repeat_interleave(INT8_BLOCK)[:d.numel()].clamp_min(1e-30)).max())
                for d in deltas)
    rel = lambda avg: float((avg.double() - exact).norm() / exact.norm())  # noqa: E731
    return {"fp32": (rel(torch.stack(deltas).sum(0) / len(deltas)), 0.0),
            "bf16": (rel(bf16.float() / len(deltas)), float("nan")), "int8": (rel(int8), worst)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    rows, data = [], []
    for H in args.inner_steps:
        for precision, (rel, worst) in errors(pseudo_gradients(args.workers, H)).items():
            rows.append([H, precision, f"{OUTER_VALUE_BYTES[precision]:.3g}", f"{rel:.2e}",
                         "-" if worst != worst or precision == "fp32" else f"{worst:.3f}"])
            data.append({"inner_steps": H, "precision": precision, "relative_error": rel, "worst_in_steps": worst})
    notes = [f"{args.workers} workers of the main job's GPT (fp32, micro-batch 12, lr 1e-3 without warmup), each H "
             "AdamW steps on its own samples from the same start; their pseudo-gradients averaged three ways.",
             "relative error: ||average - fp32 average (in float64)|| / ||fp32 average||. int8 worst: the largest "
             "|dequantized - value| / the block's scale (round to nearest promises <= 0.5).",
             "bytes / value: what a worker sends per parameter (int8: 1 + a 4-byte scale per 256 values).",
             f"Command: python bench/bench_diloco_precision.py --workers {args.workers} --inner-steps "
             f"{' '.join(map(str, args.inner_steps))}"]
    path = write_results("diloco_precision", "DiLoCo's exchange precision: error of the averaged pseudo-gradient",
                         ["H", "precision", "bytes / value", "relative error", "int8 worst (scale units)"], rows, notes,
                         {"rows": data})
    print(path.read_text())


if __name__ == "__main__":
    main()
