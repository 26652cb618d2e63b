"""meshtrain on one GPU against the same hand-written loop: bf16 tokens/s and MFU of a 355M-parameter GPT.

The model is GPT-2 medium's shape in meshtrain's GPT (24 layers, 16 heads, 1024 wide, 1024 tokens,
vocabulary 50304: 355 M parameters, the embedding tied to the head), trained on Tiny Shakespeare's
characters (the extra vocabulary rows are never a target, as in nanoGPT's padded vocabularies). All
contenders: global batch ``--batch`` sequences, AdamW with the main job's hyperparameters, warmup +
cosine, clipping at 1.0, ``--steps`` steps, run one at a time in interleaved rounds:

1. the plain loop of ``bench/contenders.py``, fp32 (torch's default full-precision matmuls, no TF32);
2. the same loop with bf16 autocast and ``AdamW(fused=True)``, what a user would write for a GPU;
3. that loop with ``model.compile()`` too;
4. ``meshtrain train CONFIG --nproc 1`` at bf16 with ``train.compile = off``, and with meshtrain's default
   settings (on CUDA: bf16, fused AdamW, compiled blocks).

MFU = model FLOPs per step (Korthikanti et al. 2022, Eq. 7, ``planner.cost.model_flops``) / step time /
the GPU's dense matmul peak for the dtype measured in this run (8192^3 GEMM, mean of 10 after 3
warm-ups, CUDA events). Step time: the median over the steps after ``SKIP_STEPS`` of a run, then over
rounds. Without CUDA it keeps the results of an earlier GPU run, or writes a table that says no GPU
was there, rather than leaving the row out.

    python bench/bench_cuda.py [--job gpt2-medium|main-job] [--steps 30] [--rounds 2] [--batch 16]

``--job main-job`` runs the same contenders on the main job's own model and global batch (24 x 64).
``--job mixtral`` is the mixture of experts on one GPU: a Mixtral-shaped model (8 layers, 1024 wide, 8 experts of
width 3584, top-2: 0.8 B parameters, 0.27 B active per token) on ``configs/llama_tiny.toml``'s data, against
``transformers``' ``MixtralForCausalLM`` holding the same initial weights in the bf16 loop (2.), and meshtrain with
the experts as one grouped GEMM (default) or one GEMM per expert (``model.moe_compute = "loop"``); its MFU counts
the active parameters' FLOPs (top-k experts and the router).
Writes ``bench/results/cuda.{md,json}`` (main-job: ``cuda_main``, mixtral: ``cuda_moe``) and the table into
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, meshtrain_command, update_benchmarks_doc, write_results  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"
LLAMA = REPO / "configs" / "llama_tiny.toml"
CONTENDERS = REPO / "bench" / "contenders.py"
SKIP_STEPS = 10  # first steps of a run left out (cuBLAS heuristics, allocator growth, autotuning)
MODEL = {"model.n_layer": "24", "model.n_head": "16", "model.n_embd": "1024", "model.block_size": "1024",
         "model.vocab_size": "50304"}
"""GPT-2 medium (Radford et al. 2019, Table 2: 24 layers, 1024 wide; 345 M there with vocabulary 50257)."""
MIXTRAL = {"model.type": "mixtral", "model.n_layer": "8", "model.n_head": "16", "model.n_kv_head": "8",
           "model.n_embd": "1024", "model.ffn_hidden": "3584", "model.num_experts": "8", "model.num_experts_per_tok": "2",
           "model.block_size": "1024", "model.vocab_size": "32000"}
"""Mixtral 8x7B's ratios (Jiang et al. 2024, Table 1: 8 experts, top-2, width 3.5x the hidden size, 4 query heads per
kv head is 2 here) at 1024 wide and 8 layers."""
JOBS = {"gpt2-medium": {"model": MODEL, "block": 1024, "vocab": 50304, "batch": 16, "steps": 30, "name": "cuda",
                        "config": CONFIG, "title": "meshtrain on one GPU (355M GPT)",
                        "what": "GPT, 24 x 1024, 16 heads, 1024 tokens, vocabulary 50304"},
        "main-job": {"model": {}, "block": 64, "vocab": 65, "batch": 24, "steps": 200, "name": "cuda_main", "config": CONFIG,
                     "title": "meshtrain on one GPU (the main job's GPT)",
                     "what": "GPT, the main job's: 4 x 128, 4 heads, 64 tokens, vocabulary 65"},
        "mixtral": {"model": MIXTRAL, "block": 1024, "vocab": 32000, "batch": 8, "steps": 40, "name": "cuda_moe",
                    "config": LLAMA, "versus": "vs transformers (bf16)", "title": "Mixture of experts on one GPU (a Mixtral of 0.8B parameters)",
                    "what": "Mixtral, 8 x 1024, 16 heads (8 kv), 8 experts of width 3584, top-2, 1024 tokens, vocabulary 32000"}}
"""``--job``: the 355M GPT, the main job's own model at its own global batch, or a Mixtral-shaped MoE."""
JOB = JOBS["gpt2-medium"]
COLUMNS = ["contender", "device", "tokens/s (median)", "per round", "vs plain fp32 loop", "ms/step", "MFU (vs measured matmul peak)",
           "peak GPU memory (GiB)", "val loss @ steps", "wall s"]


def contenders(steps: int, batch: int) -> list[dict]:
    py = sys.executable
    sets = [a for k, v in JOB["model"].items() for a in ("--set", f"{k}={v}")]
    hand = [py, str(CONTENDERS), "plain", "{out}", "--device", "cuda", "--steps", str(steps), "--batch", str(batch),
            "--config", str(JOB["config"]), *sets]
    mesh = [*meshtrain_command(), "train", str(JOB["config"]), "--nproc", "1", "--steps", str(steps), "--out", "{out}",
            "--batch.micro_batch_size", str(batch), "--train.log_interval", "1", "--train.eval_interval", "0",
            "--train.eval_steps", "1", "--checkpoint.interval", "0", "--checkpoint.keep", "1",
            *[a for k, v in JOB["model"].items() for a in (f"--{k}", v)]]
    if JOB["model"].get("model.type") == "mixtral":
        return [{"name": "transformers MixtralForCausalLM, bf16 autocast + fused AdamW", "dtype": "bfloat16", "kind": "hand",
                 "argv": [*hand, "--hf", "--dtype", "bfloat16", "--fused"]},
                {"name": "meshtrain, bf16, compile off, one GEMM per expert", "dtype": "bfloat16", "kind": "meshtrain",
                 "argv": [*mesh, "--train.dtype", "bfloat16", "--train.compile", "off", "--model.moe_compute", "loop"]},
                {"name": "meshtrain, bf16, compile off", "dtype": "bfloat16", "kind": "meshtrain",
                 "argv": [*mesh, "--train.dtype", "bfloat16", "--train.compile", "off"]},
                {"name": "meshtrain, default settings", "dtype": "bfloat16", "kind": "meshtrain", "argv": mesh}]
    return [{"name": "plain PyTorch loop, fp32", "dtype": "float32", "kind": "hand", "argv": [*hand, "--dtype", "float32"]},
            {"name": "plain PyTorch loop, bf16 autocast + fused AdamW", "dtype": "bfloat16", "kind": "hand",
             "argv": [*hand, "--dtype", "bfloat16", "--fused"]},
            {"name": "plain PyTorch loop, bf16 + fused AdamW + torch.compile", "dtype": "bfloat16", "kind": "hand",
             "argv": [*hand, "--dtype", "bfloat16", "--fused", "--compile"]},
            {"name": "meshtrain, bf16, compile off", "dtype": "bfloat16", "kind": "meshtrain",
             "argv": [*mesh, "--train.dtype", "bfloat16", "--train.compile", "off"]},
            {"name": "meshtrain, default settings", "dtype": "bfloat16", "kind": "meshtrain", "argv": mesh}]


def matmul_peak(dtype: str, n: int = 8192) -> float:
    """Dense GEMM FLOP/s of this GPU for ``dtype`` (fp32: full precision, TF32 off)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
    b = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2.0 * n ** 3 * 10 / (start.elapsed_time(end) / 1000)


def run_one(c: dict, work: Path, index: int) -> dict:
    """One run of contender ``c``: step times (s), peak GPU memory (bytes), val loss, wall time (s)."""
    out = work / f"{index}-{c['kind']}-{c['dtype']}"
    target = out if c["kind"] == "meshtrain" else out.with_suffix(".json")
    t0 = time.perf_counter()
    proc = subprocess.run([a.replace("{out}", str(target)) for a in c["argv"]], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:  # recorded, the others still run
        print(f"{c['name']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", file=sys.stderr)
        return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:200], "wall_s": wall}
    if c["kind"] == "hand":
        result = json.loads(target.read_text())
    else:
        result = meshtrain_result(out)
        shutil.rmtree(out, ignore_errors=True)  # its checkpoint (~10 GiB for the Mixtral) leaves the disk to the next
    result["wall_s"] = wall
    return result


def meshtrain_result(out: Path) -> dict:
    """Step times from metrics.jsonl, peak GPU memory from summary.json, val loss of the final checkpoint
    on the hand-written loops' val windows (evaluated on the GPU)."""
    from contenders import val_loss

    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import load_corpus
    from meshtrain.cli.export import load_checkpoint_model

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    model = load_checkpoint_model(out)[0].cuda()
    cfg = load_config(JOB["config"], JOB["model"])
    corpus = load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)
    return {"step_times_s": [r["step_time_s"] for r in records if "step_time_s" in r],
            "peak_cuda_bytes": summary["peak_memory_bytes"], "val_loss": val_loss(model, corpus, JOB["block"], chunk=8)}


def step_flops(batch: int) -> tuple[float, int, int]:
    """(model FLOPs of one step at ``batch`` sequences, parameter count, parameters one token runs through)."""
    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.planner.cost import model_flops
    from meshtrain.planner.model_specs import from_config

    cfg = load_config(JOB["config"], JOB["model"])
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg.model, JOB["vocab"]).parameters())
    spec = from_config(cfg, JOB["vocab"])
    return model_flops(spec, batch), params, spec.active_params()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=list(JOBS), default="gpt2-medium")
    parser.add_argument("--steps", type=int, default=None, help="default 30 (main-job: 200)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="global batch, sequences (default 16; main-job: 24)")
    parser.add_argument("--only", default="", help="run only contenders whose name contains this")
    args = parser.parse_args()
    JOB.update(JOBS[args.job])
    args.steps, args.batch = args.steps or JOB["steps"], args.batch or JOB["batch"]
    import torch

    if not torch.cuda.is_available():
        kept = RESULTS_DIR / f"{JOB['name']}.json"
        if kept.exists() and json.loads(kept.read_text()).get("device"):  # a GPU's numbers are not overwritten
            print(f"no CUDA device here: kept {kept.relative_to(REPO)} ({json.loads(kept.read_text())['device']})")
            update_benchmarks_doc(JOB["name"])
            return
        rows = [["CUDA row: not run", "no GPU on this machine"] + ["-"] * (len(COLUMNS) - 2)]
        write_results(JOB["name"], JOB["title"], COLUMNS, rows,
                      ["No CUDA device here: run `python bench/bench_cuda.py` on a machine with one."], {})
        update_benchmarks_doc(JOB["name"])
        return
    device = torch.cuda.get_device_name()
    peaks = {d: matmul_peak(d) for d in ("bfloat16", "float32")}
    flops, params, active = step_flops(args.batch)
    field = [c for c in contenders(args.steps, args.batch) if args.only in c["name"]]
    with tempfile.TemporaryDirectory(prefix="meshtrain-cuda-") as tmp:
        for r in range(args.rounds):
            for i, c in enumerate(field):
                print(f"round {r + 1}/{args.rounds}: {c['name']}", file=sys.stderr, flush=True)
                c.setdefault("rounds", []).append(run_one(c, Path(tmp), r * len(field) + i))
                # each result kept as it comes: a run cut short by a time limit still leaves its table
                report([c for c in field if c.get("rounds")], args, device, peaks, flops, (params, active), r + 1)


def report(field: list[dict], args, device: str, peaks: dict, flops: float, params: tuple[int, int], rounds: int) -> None:
    """Write the table of the ``rounds`` rounds run so far; ``params``: (all parameters, those a token runs through)."""
    tokens = args.batch * JOB["block"]
    stats = {}
    for c in field:
        if any("failed" in run for run in c["rounds"]):
            continue
        per_round = [statistics.median(run["step_times_s"][SKIP_STEPS:]) for run in c["rounds"]]
        step = statistics.median(per_round)
        stats[c["name"]] = {"step_s": step, "tokens_per_s": tokens / step,
                            "tokens_per_s_rounds": [tokens / s for s in per_round],
                            "peak_gib": max(run.get("peak_cuda_bytes", 0) for run in c["rounds"]) / 2 ** 30,
                            "val_loss": statistics.median(run["val_loss"] for run in c["rounds"]),
                            "wall_s": statistics.median(run["wall_s"] for run in c["rounds"])}
    reference = stats.get(field[0]["name"])  # the first contender: the plain fp32 loop, or transformers' Mixtral
    rows = []
    for c in field:
        if c["name"] not in stats:
            failed = next(run["failed"] for run in c["rounds"] if "failed" in run)
            rows.append([c["name"], device, f"failed: {failed}"] + ["-"] * (len(COLUMNS) - 3))
            continue
        s = stats[c["name"]]
        ratio = f"{s['tokens_per_s'] / reference['tokens_per_s']:.2f}x" if reference else "-"
        rows.append([c["name"], device, f"{s['tokens_per_s']:,.0f}",
                     " / ".join(f"{t:,.0f}" for t in s["tokens_per_s_rounds"]), ratio, f"{1000 * s['step_s']:.1f}",
                     f"{flops / s['step_s'] / peaks[c['dtype']]:.1%} of {c['dtype']}", f"{s['peak_gib']:.1f}",
                     f"{s['val_loss']:.4f} @ {args.steps}", f"{s['wall_s']:.0f}"])
    total, active = params
    counted = f"{total / 1e6:.1f} M parameters" + (f", {active / 1e6:.1f} M active per token" if active != total else "")
    notes = [f"{counted} ({JOB['what']}), global "
             f"batch {args.batch} x {JOB['block']} tokens, {args.steps} steps, {rounds} interleaved rounds; medians over "
             f"steps {SKIP_STEPS + 1}..{args.steps} of a run, then over rounds.",
             "Dense matmul peak of this GPU measured in this run (8192^3): "
             + ", ".join(f"{d} {v / 1e12:.0f} TFLOP/s" for d, v in peaks.items())
             + f"; model FLOPs per step {flops / 1e9:,.1f} GFLOP (Korthikanti et al. 2022, Eq. 7).",
             "Wall time includes process start, compilation, model build and (meshtrain) the final checkpoint."]
    columns = [JOB.get("versus", col) if col == COLUMNS[4] else col for col in COLUMNS]
    write_results(JOB["name"], JOB["title"], columns, rows, notes,
                  {"device": device, "peaks_flops": peaks, "step_flops": flops, "params": total, "active_params": active,
                   "stats": stats,
                   "rounds": {c["name"]: c["rounds"] for c in field}})
    update_benchmarks_doc(JOB["name"])
    print("\n".join(["| " + " | ".join(map(str, r)) + " |" for r in rows]))


if __name__ == "__main__":
    main()
