"""One GPU, at most ~8 minutes: a GEMM shape sweep and a dozen single-GPU meshtrain runs, written as measured runs
that ``meshtrain plan --validate`` reads (what the planner's GEMM-by-shape model and its meshtrain stack factor
need; docs/planner.md, "Stacks and calibration").

    python bench/gpu_sweep.py [--budget-s 480]          # on a CUDA machine
    python bench/gpu_sweep.py --smoke --out DIR          # tiny shapes on this CPU: checks the plumbing

1. GEMM sweep: bf16 ``(M x K) @ (K x N)`` for every M in :data:`GEMM_M` and N, K in :data:`GEMM_NK`, each the median
   of 5 timings (CUDA events) after 2 warm-ups: TFLOP/s and the fraction of the planner catalog's datasheet peak.
   Writes ``bench/results/gpu_gemm.{md,json}``.
2. Runs (:data:`RUNS`): ``meshtrain train configs/llama_tiny.toml --nproc 1`` at Llama shapes (125M, 350M and 1B-like,
   2048 tokens, a 32,000 vocabulary over Tiny Shakespeare's characters: the extra rows are never a target), several
   micro-batch sizes, recompute modes and compiled or eager blocks, 20 steps each; a run's ``summary.json`` gives the
   median step time after the warm-up steps and the CUDA allocator's peak. Writes ``bench/results/gpu_runs.toml`` in
   the format of ``src/meshtrain/planner/data/published_runs.toml`` (``source`` names the GPU and the git revision,
   ``stack`` is ``meshtrain`` or ``meshtrain+compile``), and ``gpu_runs.md`` with the planner's prediction of each.
   Runs that would pass ``--budget-s`` are left out and listed.

Commit what a GPU measured; append the runs to ``published_runs.toml`` (and refit: ``python -m
meshtrain.planner.refit``) to make them part of the validation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, machine, meshtrain_command, write_results  # noqa: E402

CONFIG = REPO / "configs" / "llama_tiny.toml"
GEMM_M = (512, 2048, 8192, 16384)
GEMM_NK = (256, 512, 1024, 2048, 4096, 8192, 14336)
SHAPES = {  # name: overrides of configs/llama_tiny.toml
    "125m": {"model.n_layer": "12", "model.n_embd": "768", "model.n_head": "12", "model.n_kv_head": "4"},
    "350m": {"model.n_layer": "24", "model.n_embd": "1024", "model.n_head": "16", "model.n_kv_head": "8"},
    "1b": {"model.n_layer": "16", "model.n_embd": "2048", "model.n_head": "32", "model.n_kv_head": "8",
           "model.ffn_hidden": "8192"},
}
"""Llama-shaped (RMSNorm, RoPE, SwiGLU, grouped K/V, untied head): GPT-3 Small's and Medium's widths and depths (Brown
et al. 2020, Table 2.1) and Llama 3.2 1B's (16 layers, 2048 wide, 32 heads, 8 kv heads, MLP 8192)."""
COMMON = {"model.block_size": "2048", "model.vocab_size": "32000", "train.steps": "20", "train.eval_interval": "1000",
          "train.eval_steps": "1", "train.log_interval": "5", "checkpoint.interval": "1000", "train.dtype": "bfloat16"}
RUNS = [  # (shape, micro_batch_size, recompute, compile)
    ("125m", 8, "none", "off"), ("125m", 8, "none", "on"),
    ("350m", 4, "none", "off"), ("350m", 8, "none", "on"), ("350m", 8, "selective", "on"), ("350m", 8, "full", "on"),
    ("1b", 2, "none", "off"), ("1b", 4, "none", "on"), ("1b", 8, "selective", "on"), ("1b", 8, "full", "on"),
    ("1b", 8, "full", "off"), ("1b", 16, "full", "on"),
]
SMOKE_SHAPES = {"tiny": {"model.n_layer": "2", "model.n_embd": "64", "model.n_head": "4", "model.n_kv_head": "2"}}
SMOKE_COMMON = {**COMMON, "model.block_size": "64", "model.vocab_size": "0", "train.steps": "6",
                "train.dtype": "float32"}
SMOKE_RUNS = [("tiny", 4, "none", "off"), ("tiny", 4, "full", "off")]


def gemm_sweep(device: str, shapes_m: tuple[int, ...], shapes_nk: tuple[int, ...], peak: float) -> list[dict[str, Any]]:
    """TFLOP/s of ``(M x K) @ (K x N)`` in bf16 (fp32 on a CPU) for each shape: median of 5 timings after 2 warm-ups."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for m in shapes_m:
        for n in shapes_nk:
            for k in shapes_nk:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)
                times = []
                for i in range(7):
                    if device == "cuda":
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        a @ b
                        end.record()
                        torch.cuda.synchronize()
                        seconds = start.elapsed_time(end) / 1e3
                    else:
                        t0 = time.perf_counter()
                        a @ b
                        seconds = time.perf_counter() - t0
                    if i >= 2:
                        times.append(seconds)
                flops = 2 * m * n * k / statistics.median(times)
                rows.append({"m": m, "n": n, "k": k, "tflops": flops / 1e12, "fraction_of_peak": flops / peak})
    return rows


def planner_run(name: str, out: Path, overrides: dict[str, str], summary: dict[str, Any], gpu: str,
                source: str) -> dict[str, Any]:
    """The published-runs entry of one run: its model as the planner reads it, its layout, what it measured."""
    from dataclasses import asdict

    from meshtrain.config.load import load_config
    from meshtrain.planner.model_specs import PLANNER_KEYS, from_config

    cfg = load_config(CONFIG, overrides)
    spec = asdict(from_config(cfg, int(summary["vocab_size"])))
    model = {k: v for k, v in spec.items() if k in PLANNER_KEYS and k != "name"}
    mbs = int(overrides["batch.micro_batch_size"])
    compiled = bool(summary.get("compiled"))
    return {"name": name, "source": source, "gpu": gpu, "num_gpus": 1, "stack": "meshtrain+compile" if compiled else "meshtrain",
            "model": model,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": mbs, "gradient_accumulation_steps": 1,
                       "global_batch_size": mbs, "recompute": overrides["train.recompute"], "zero_stage": 0},
            "measured": {"iteration_time_s": summary["step_time_s"],
                         "peak_memory_gib": summary["peak_memory_bytes"] / 2**30}}


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def write_runs_toml(path: Path, runs: list[dict[str, Any]], header: str) -> None:
    """``[[run]]`` tables in ``published_runs.toml``'s format."""
    tables = ["[[run]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in run.items()) for run in runs]
    path.write_text(f"# {header}\n\n" + "\n".join(tables))


def train_runs(runs: list[tuple[str, int, str, str]], shapes: dict[str, dict[str, str]], common: dict[str, str],
               work: Path, budget_s: float, started: float) -> tuple[list[tuple[str, dict[str, str], dict]], list[str]]:
    """Run each of ``runs`` with ``meshtrain train``; stop starting runs once the last one's time would pass the
    budget. Returns ([(name, overrides, summary)], [names left out])."""
    done, skipped, last = [], [], 0.0
    for shape, mbs, recompute, compile_ in runs:
        name = f"{shape}-mbs{mbs}-{recompute}-{'compiled' if compile_ == 'on' else 'eager'}"
        if time.perf_counter() - started + last > budget_s:
            skipped.append(name)
            continue
        overrides = {**shapes[shape], **common, "batch.micro_batch_size": str(mbs), "train.recompute": recompute,
                     "train.compile": compile_, "batch.gradient_accumulation_steps": "1"}
        out = work / name
        args = [f"--{k}={v}" for k, v in overrides.items()]
        t0 = time.perf_counter()
        proc = subprocess.run([*meshtrain_command(), "train", str(CONFIG), "--nproc", "1", "--out", str(out), *args],
                              cwd=REPO, capture_output=True, text=True)
        last = time.perf_counter() - t0
        summary_path = out / "summary.json"
        if proc.returncode != 0 or not summary_path.is_file():
            print(f"{name}: failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        done.append((name, overrides, json.loads(summary_path.read_text())))
        print(f"{name}: {done[-1][2]['step_time_s']:.4f} s/step ({last:.0f} s)", file=sys.stderr)
    return done, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting runs after this (default 480)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device (CPU: plumbing only)")
    parser.add_argument("--out", type=Path, help="with --smoke: where to write (default: a temporary folder)")
    args = parser.parse_args()
    import torch

    from meshtrain.planner.actual import GPU_NAMES
    from meshtrain.planner.hardware import get_hardware

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_sweep: no CUDA device here: nothing measured (use --smoke to check the plumbing on a CPU)",
              file=sys.stderr)
        return 2
    if cuda:
        name = torch.cuda.get_device_name()
        gpu = next((c for key, c in GPU_NAMES if key.lower() in name.lower()), name)
    else:
        name, gpu = "cpu", "cpu"
    peak = get_hardware(gpu).device.peak("bfloat16" if cuda else "float32") if cuda else 50e9
    m, nk = (GEMM_M, GEMM_NK) if not args.smoke else ((64, 256), (64, 256))
    gemms = gemm_sweep("cuda" if cuda else "cpu", m, nk, peak)
    out = args.out or (RESULTS_DIR if not args.smoke else Path(tempfile.mkdtemp(prefix="gpu_sweep_")))
    out.mkdir(parents=True, exist_ok=True)
    runs, shapes, common = (SMOKE_RUNS, SMOKE_SHAPES, SMOKE_COMMON) if args.smoke else (RUNS, SHAPES, COMMON)
    with tempfile.TemporaryDirectory(prefix="gpu_sweep_runs_") as work:
        done, skipped = train_runs(runs, shapes, common, Path(work), args.budget_s, started)
    header = machine()
    source = f"meshtrain bench/gpu_sweep.py on {name}, git {header['git']} ({header['date']})"
    entries = [planner_run(n, out, o, s, gpu, source) for n, o, s in done]
    write_runs_toml(out / "gpu_runs.toml", entries, f"Written by bench/gpu_sweep.py: {source}")
    from meshtrain.planner.validate import validate_file

    predicted = validate_file(out / "gpu_runs.toml", cross=False) if entries and gpu != "cpu" else {"runs": []}
    (out / "gpu_gemm.json").write_text(json.dumps({"machine": header, "device": name, "gemm": gemms}, indent=1) + "\n")
    summary = {"machine": header, "device": name, "runs": [{"name": n, "summary": s} for n, _, s in done],
               "skipped": skipped, "validation": predicted}
    (out / "gpu_runs.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.smoke:
        write_results("gpu_gemm", f"GEMM sweep on {name}", ["M", "N", "K", "TFLOP/s", "of peak"],
                      [[g["m"], g["n"], g["k"], f"{g['tflops']:.1f}", f"{g['fraction_of_peak']:.1%}"] for g in gemms],
                      [f"bf16, median of 5 after 2 warm-ups; peak {peak / 1e12:.0f} TFLOP/s (planner catalog {gpu})"],
                      {"device": name, "gemm": gemms})
        rows = [[r["name"], r["layout"], f"{r['predicted'].get('iteration_time_s', float('nan')):.4f}",
                 f"{r['measured'].get('iteration_time_s', float('nan')):.4f}",
                 f"{r['relative_error'].get('iteration_time_s', float('nan')):+.1%}"] for r in predicted["runs"]]
        write_results("gpu_runs", f"meshtrain on one {name}: measured runs and the planner's prediction",
                      ["run", "layout", "predicted s/step", "measured s/step", "error"], rows,
                      [f"left out for the budget: {', '.join(skipped) or 'none'}", "runs: bench/results/gpu_runs.toml"],
                      summary)
    print(f"wrote {out / 'gpu_runs.toml'} ({len(entries)} runs, {len(skipped)} left out) and {out / 'gpu_gemm.json'} "
          f"in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
