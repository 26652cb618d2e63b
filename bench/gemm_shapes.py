"""The planner's GEMM time by shape against a published H100 sweep: how well its law (a FLOP term plus the operand
traffic at the memory bandwidth, ``planner.cost.gemm_traffic_bytes``) follows measured bf16 GEMMs, and where its
training-step constant sits below them.

    python bench/gemm_shapes.py          # no GPU needed: reads bench/data/h100_bf16_gemm_openxla.csv

The measurements: OpenXLA's default matmul performance table for sm_90 (125 shapes, m, n, k in 256-4,096, batch 1;
``bench/data/h100_bf16_gemm_openxla.csv`` names the file and commit), and this project's own 8192^3 GEMM on an H100
(``bench/results/cuda.json``, ``peaks_flops``; ``bench/bench_cuda.py``). Each law predicts a GEMM's seconds:

- ``roofline`` (the planner's): ``t = F / (e * peak) + B / (memory_efficiency * bandwidth)``, F = 2mnk FLOPs,
  B = 2(mk + kn + mn) bytes (each operand read and the result written once; Isaev et al. 2023, Calculon, Sec. 3,
  "no overlap"), the catalog's bandwidth terms;
- ``constant``: ``t = F / (e * peak)``;
- ``fixed cost``: ``t = F / (e * peak) + t0``, a launch and tail cost per GEMM.

``e`` (and ``t0``) are fitted to the sweep's training-sized shapes (m, n, k all >= 1,024; least squares on the log
of the time), and each law is scored on those and on all shapes. The catalog's ``matmul_efficiency`` (0.56 on an
H100) is not fitted to GEMMs but to whole published training steps (docs/planner.md, "Constants"), so the roofline
with the catalog constant sits below the sweep by the share of a training step that is not its GEMMs' math.
Writes ``bench/results/gemm_shapes.{md,json}`` and ``docs/gemm_shapes.png``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, write_results  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "h100_bf16_gemm_openxla.csv"
PLOT = REPO / "docs" / "gemm_shapes.png"
TRAINING = 1024
"""Shapes with m, n and k all at least this many are "training-sized" (a micro-batch's tokens, hidden / tp >= 1k)."""
Shape = tuple[int, int, int]


def read_sweep(path: Path = DATA) -> dict[Shape, float]:
    """{(m, n, k): measured FLOP/s} of the CSV (TFLOP/s there); comment lines start with '#'."""
    with path.open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {(int(r["m"]), int(r["n"]), int(r["k"])): float(r["tflops"]) * 1e12 for r in rows}


def flops(shape: Shape) -> float:
    m, n, k = shape
    return 2.0 * m * n * k


def traffic_bytes(shape: Shape) -> float:
    """bf16 bytes the planner charges a GEMM (``planner.cost.gemm_traffic_bytes`` with rows m, (K, N) = (k, n))."""
    from meshtrain.planner.cost import gemm_traffic_bytes

    m, n, k = shape
    return gemm_traffic_bytes(m, ((k, n),), 2)


def law(kind: str, peak: float, bandwidth: float) -> Callable[[Shape, float, float], float]:
    """Seconds of a GEMM under ``kind`` ("roofline", "constant", "fixed cost") at efficiency e and fixed cost t0."""
    def seconds(s: Shape, e: float, t0: float) -> float:
        return flops(s) / (e * peak) + extra(kind, s, bandwidth, t0)
    return seconds


def extra(kind: str, s: Shape, bandwidth: float, t0: float) -> float:
    """The seconds a law adds to a GEMM's FLOP time: its traffic (roofline), nothing (constant), t0 (fixed cost)."""
    return {"roofline": traffic_bytes(s) / bandwidth, "constant": 0.0, "fixed cost": t0}[kind]


def log_errors(seconds: Callable[[Shape, float, float], float], sweep: dict[Shape, float], shapes: list[Shape],
               e: float, t0: float) -> list[float]:
    """log(predicted / measured seconds) of ``shapes``."""
    return [math.log(seconds(s, e, t0) / (flops(s) / sweep[s])) for s in shapes]


def fit(kind: str, peak: float, bandwidth: float, sweep: dict[Shape, float], shapes: list[Shape]) -> tuple[float, float]:
    """(e, t0) of law ``kind`` minimizing the squared log errors over ``shapes``: a grid over e in [0.30, 1.20] by
    0.001 and, for "fixed cost", t0 in [0, 20] us by 0.1 us (the optimum of this smooth one- or two-parameter problem
    to that resolution)."""
    import numpy as np

    grid = np.arange(300, 1201) / 1000
    best = (math.inf, 0.0, 0.0)
    for t0 in ([i * 1e-7 for i in range(201)] if kind == "fixed cost" else [0.0]):
        cost = np.zeros_like(grid)
        for s in shapes:
            cost += np.log((flops(s) / (grid * peak) + extra(kind, s, bandwidth, t0)) * sweep[s] / flops(s)) ** 2
        i = int(np.argmin(cost))
        best = min(best, (float(cost[i]), float(grid[i]), t0))
    return best[1], best[2]


def score(seconds, sweep, shapes, e, t0) -> dict[str, float]:
    """Median and max |relative error| of the predicted time, and the median signed one."""
    errors = [math.expm1(x) for x in log_errors(seconds, sweep, shapes, e, t0)]
    return {"median_abs": statistics.median(abs(x) for x in errors), "max_abs": max(abs(x) for x in errors),
            "median": statistics.median(errors)}


def main() -> None:
    from meshtrain.planner.hardware import get_hardware

    device = get_hardware("H100-SXM-80GB").device
    peak, bandwidth, catalog = device.peak("bfloat16"), device.bandwidth(), device.matmul_efficiency
    sweep = read_sweep()
    shapes = sorted(sweep)
    training = [s for s in shapes if min(s) >= TRAINING]
    own = json.loads((RESULTS_DIR / "cuda.json").read_text())
    own_8192 = own["peaks_flops"]["bfloat16"]

    rows, laws = [], {}
    for kind in ("roofline", "constant", "fixed cost"):
        seconds = law(kind, peak, bandwidth)
        e, t0 = fit(kind, peak, bandwidth, sweep, training)
        big = (8192, 8192, 8192)
        at_8192 = flops(big) / seconds(big, e, t0)
        laws[kind] = {"e": e, "t0_s": t0, "training": score(seconds, sweep, training, e, t0),
                      "all": score(seconds, sweep, shapes, e, t0), "predicted_8192_flops": at_8192}
        fitted = f"e = {e:.3f}" + (f", t0 = {t0 * 1e6:.1f} us" if kind == "fixed cost" else "")
        rows.append([kind, fitted, f"{laws[kind]['training']['median_abs']:.1%}",
                     f"{laws[kind]['training']['max_abs']:.1%}", f"{laws[kind]['all']['median_abs']:.1%}",
                     f"{laws[kind]['all']['max_abs']:.1%}", f"{at_8192 / 1e12:.0f} ({at_8192 / own_8192 - 1:+.1%})"])
    roofline = law("roofline", peak, bandwidth)
    planner = score(roofline, sweep, training, catalog, 0.0)
    planner_all = score(roofline, sweep, shapes, catalog, 0.0)
    at_8192 = flops((8192,) * 3) / roofline((8192,) * 3, catalog, 0.0)
    rows.append(["roofline, catalog constant (the planner)", f"e = {catalog:.2f} (fitted to training steps)",
                 f"{planner['median_abs']:.1%} (median {planner['median']:+.1%})", f"{planner['max_abs']:.1%}",
                 f"{planner_all['median_abs']:.1%}", f"{planner_all['max_abs']:.1%}",
                 f"{at_8192 / 1e12:.0f} ({at_8192 / own_8192 - 1:+.1%})"])
    plot(sweep, peak, bandwidth, laws, catalog, own_8192)
    notes = [f"{len(shapes)} shapes of OpenXLA's sm_90 table ({DATA.relative_to(REPO)}), {len(training)} of them "
             f"training-sized (m, n, k >= {TRAINING}); the laws' constants are fitted to those (least squares on log "
             "time); errors are of the predicted GEMM time.",
             f"H100 bf16 dense peak {peak / 1e12:.0f} TFLOP/s, GEMM traffic at {bandwidth / 1e12:.2f} TB/s (the "
             "catalog's bandwidth x memory_efficiency); measured 8192^3 on an H100 by bench/bench_cuda.py: "
             f"{own_8192 / 1e12:.0f} TFLOP/s ({own['machine']['date']}).",
             f"Figure: {PLOT.relative_to(REPO)}."]
    write_results("gemm_shapes", "GEMM time by shape: the planner's law against a published H100 sweep",
                  ["law", "constants", "training-sized: median |error|", "max", "all shapes: median |error|", "max",
                   "8192^3 TFLOP/s (vs measured)"], rows, notes,
                  {"laws": laws, "planner": {"e": catalog, "training": planner, "all": planner_all},
                   "measured_8192_flops": own_8192, "shapes": len(shapes), "training_shapes": len(training)})
    print("\n".join(" | ".join(map(str, r)) for r in rows))


def plot(sweep: dict[Shape, float], peak: float, bandwidth: float, laws: dict[str, dict], catalog: float,
         own_8192: float) -> None:
    """Left: measured TFLOP/s by a GEMM's FLOPs, with the fixed-cost law and the planner's roofline at its catalog
    constant. Right: predicted / measured time of the two fitted laws by arithmetic intensity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    markers = ((256, "x"), (512, "+"), (1024, "o"), (2048, "s"), (4096, "D"))
    for smallest, marker in markers:
        pts = [s for s in sweep if min(s) == smallest]
        left.scatter([flops(s) for s in pts], [sweep[s] / 1e12 for s in pts], marker=marker, s=22,
                     label=f"measured (OpenXLA sm_90), smallest of m, n, k = {smallest}")
    big = (8192, 8192, 8192)
    left.scatter([flops(big)], [own_8192 / 1e12], marker="*", s=160, color="black",
                 label="measured 8192^3 (bench/bench_cuda.py)")
    roofline = law("roofline", peak, bandwidth)
    shapes = sorted([*sweep, big], key=flops)
    left.scatter([flops(s) for s in shapes], [flops(s) / roofline(s, catalog, 0.0) / 1e12 for s in shapes],
                 marker=".", s=14, color="grey", label=f"planner (roofline, catalog e = {catalog:.2f})")
    e, t0 = laws["fixed cost"]["e"], laws["fixed cost"]["t0_s"]
    xs = [10 ** (7.5 + i * 0.05) for i in range(115)]
    left.plot(xs, [x / (x / (e * peak) + t0) / 1e12 for x in xs], color="black",
              label=f"fixed cost: e = {e:.2f}, t0 = {t0 * 1e6:.1f} us (fitted)")
    left.axhline(peak / 1e12, color="grey", lw=0.8, ls=":", label="datasheet peak")
    left.set_xscale("log")
    left.set_xlabel("FLOPs of one GEMM, 2mnk")
    left.set_ylabel("TFLOP/s")
    left.set_title("H100 bf16 GEMMs")
    left.legend(fontsize=7, loc="upper left")
    for kind, marker in (("roofline", "o"), ("fixed cost", "x")):
        seconds, (e, t0) = law(kind, peak, bandwidth), (laws[kind]["e"], laws[kind]["t0_s"])
        for training in (True, False):
            pts = [s for s in sweep if (min(s) >= TRAINING) == training]
            right.scatter([flops(s) / traffic_bytes(s) for s in pts],
                          [seconds(s, e, t0) * sweep[s] / flops(s) for s in pts], marker=marker, s=20,
                          alpha=1.0 if training else 0.35,
                          label=f"{kind} (fitted), {'training-sized' if training else 'smaller'} shapes")
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("arithmetic intensity, FLOP per byte of operands and result (bf16)")
    right.set_ylabel("predicted / measured time")
    right.set_title("Two laws fitted to the training-sized shapes")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
