"""Peak memory of meshtrain's full fine-tuning, LoRA and QLoRA on one model, side by side, against the planner.

One Llama built by ``transformers`` (random weights, saved to a temporary folder, never downloaded; 8 layers x 512,
8 query / 4 kv heads, SwiGLU 1408, vocabulary 65, untied head: 23.6 M parameters in the blocks' linear maps, so
that weights and optimizer states stand out of the libraries' resident memory) is trained by meshtrain
(``configs/hf_finetune.toml``, fp32, one process) three ways: every parameter (``adapter.lora_rank = 0``), LoRA
(rank 8 on all-linear) and QLoRA (the same adapters on an NF4 base, ``adapter.quantize_base = "nf4"``), with the
same batches and steps.

Each run is its own process, started with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every freed
tensor of 64 KiB or more to the system at once: the resident set size (RSS) then follows the live tensors instead
of the heap's high-water mark. The worker imports everything first (torch, meshtrain, transformers,
bitsandbytes: the same libraries in every run) and reads its RSS (the floor), builds the trainer (reading
the base; QLoRA quantizes it then), reads its RSS again (before step 1), trains one step, resets the kernel's
high-water mark (``/proc/self/clear_refs`` 5) and trains ``--steps`` more, reading ``VmHWM``: the peak of the
training steps, start-up excluded. The planner's prediction for the same config is ``meshtrain plan CONFIG
--json`` at the run's own layout (its weights, gradients, optimizer states and activations, no runtime overhead).

    python bench/bench_lora_memory.py [--steps 3] [--batch 4] [--block 128] [--rounds 2]   # ~12 min a round, loaded
    python bench/bench_lora_memory.py --rounds 2 --append   # two more rounds after those already written

Writes ``bench/results/lora_memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttraining import cpu_line  # noqa: E402
from common import REPO, RESULTS_DIR, machine, meshtrain_command, write_results  # noqa: E402

VOCAB, SEED, RANK, ALPHA = 65, 1337, 8, 16.0
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             max_position_embeddings=1024)
RUNS = {"full fine-tuning": {"adapter.lora_rank": 0},
        "LoRA": {"adapter.lora_rank": RANK, "adapter.lora_alpha": ALPHA, "adapter.lora_targets": ["all-linear"]},
        "QLoRA (NF4 base)": {"adapter.lora_rank": RANK, "adapter.lora_alpha": ALPHA,
                             "adapter.lora_targets": ["all-linear"], "adapter.quantize_base": "nf4"}}
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "HF_HUB_OFFLINE": "1"}
MIB = 2**20


def overrides(model: Path, out: Path, run: str, batch: int, block: int, steps: int) -> dict:
    return {"model.init_from": str(model), "model.block_size": block, "batch.micro_batch_size": batch,
            "batch.gradient_accumulation_steps": 1, "optim.weight_decay": 0.0, "optim.warmup_steps": 0,
            "train.dtype": "float32", "train.seed": SEED, "train.steps": steps + 1, "train.out_dir": str(out),
            **RUNS[run]}


def status(key: str) -> int:
    """``key`` (VmRSS, VmHWM) of /proc/self/status, bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def worker(model: Path, out: Path, run: str, batch: int, block: int, steps: int, result: Path) -> None:
    """One run in this process (module docstring): its RSS floor, RSS before step 1, peak over steps 2.., losses."""
    import bitsandbytes  # noqa: F401  (every run holds the same libraries)
    import torch
    import transformers  # noqa: F401

    from meshtrain.config.load import load_config
    from meshtrain.parallel.rng import seed_step
    from meshtrain.train.loop import Trainer

    floor = status("VmRSS")
    tr = Trainer(load_config(REPO / "configs" / "hf_finetune.toml", overrides(model, out, run, batch, block, steps)))
    before = status("VmRSS")
    losses = []
    t0 = 0.0
    for step in range(1, steps + 2):
        if step == 2:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
            t0 = time.perf_counter()
        seed_step(tr.model, tr.cfg.train.seed, step, 0, 1)
        loss = tr.forward_backward(tr.sampler.next_step())
        tr.clip_gradients()
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        tr.scheduler.step()
        losses.append(float(loss))
    seconds = (time.perf_counter() - t0) / steps
    peak = status("VmHWM")
    trained = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
    stored = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    torch.distributed.destroy_process_group()
    result.write_text(json.dumps({"floor": floor, "before_step_1": before, "peak": peak, "losses": losses,
                                  "step_s": seconds, "trained_params": trained, "parameter_bytes": stored,
                                  "tokens_per_step": batch * block}))


def planned(model: Path, out: Path, run: str, batch: int, block: int, steps: int) -> list | dict:
    """``meshtrain plan CONFIG --json`` of the run's config: its rows (layouts), or ``{"error": its last line}``."""
    args = [a for k, v in overrides(model, out, run, batch, block, steps).items()
            for a in (f"--{k}", ",".join(v) if isinstance(v, list) else str(v))]
    proc = subprocess.run([*meshtrain_command(), "plan", str(REPO / "configs" / "hf_finetune.toml"), *args,
                           "--json"], capture_output=True, text=True, env=ENV, cwd=REPO)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one more, untimed)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--append", action="store_true",
                        help="keep the rounds of the results already written (same --steps, --batch, --block) first")
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.out, args.worker, args.batch, args.block, args.steps, args.result)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    results = earlier_rounds(args) if args.append else {run: [] for run in RUNS}
    plans = {}
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-lora-memory-") as tmp:
        work = Path(tmp)
        torch.manual_seed(SEED)
        LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **MODEL)).save_pretrained(work / "model")
        here = machine()
        measured = f"{here['date']}, git {here['git']}"
        for r in range(args.rounds):
            for i, run in enumerate(RUNS):
                out, result = work / f"run{r}-{i}", work / f"result{r}-{i}.json"
                print(f"round {r + 1}/{args.rounds}: {run}", file=sys.stderr, flush=True)
                proc = subprocess.run([sys.executable, __file__, "--worker", run, "--model", work / "model",
                                       "--out", out, "--result", result, "--steps", str(args.steps),
                                       "--batch", str(args.batch), "--block", str(args.block)],
                                      capture_output=True, text=True, env=ENV, cwd=REPO)
                if proc.returncode != 0:
                    raise RuntimeError(f"{run} failed:\n{proc.stderr[-3000:]}")
                results[run].append({**json.loads(result.read_text()), "measured": measured})
        for i, run in enumerate(RUNS):
            plans[run] = planned(work / "model", work / f"plan{i}", run, args.batch, args.block, args.steps)
    report(args, results, plans)


def earlier_rounds(args) -> dict[str, list[dict]]:
    """The rounds ``bench/results/lora_memory.json`` holds, each marked with the date and git revision it was measured
    at; refused (one line) if they were run with other ``--steps``, ``--batch`` or ``--block``."""
    old = json.loads((RESULTS_DIR / "lora_memory.json").read_text())
    for key in ("steps", "batch", "block"):
        if old["args"][key] != getattr(args, key):
            raise SystemExit(f"--append: the written rounds ran with --{key} {old['args'][key]}, not {getattr(args, key)}")
    return {run: [{**r, "measured": r.get("measured", f"{old['machine']['date']}, git {old['machine']['git']}")}
                  for r in old["results"][run]] for run in RUNS}


def plan_cells(plan) -> list[str]:
    """Weights, gradients, optimizer, activations and their sum, MiB, from ``meshtrain plan --json``'s row of the
    run's own layout (one rank, no ZeRO, no recomputation), or the planner's one-line refusal."""
    if isinstance(plan, dict):
        return [plan["error"]] + [""] * 4
    row = next(r for r in plan if r["zero_stage"] == 0 and r["recompute"] == "none" and r["world_size"] == 1)
    mem = row["memory_breakdown_bytes"]
    keys = ("weights", "gradients", "optimizer", "activations")
    return [f"{mem[k] / MIB:.1f}" for k in keys] + [f"{sum(mem[k] for k in keys) / MIB:.1f}"]


def report(args, results: dict, plans: dict) -> None:
    import statistics

    med = {run: {k: statistics.median(r[k] for r in rs) for k in ("floor", "before_step_1", "peak", "step_s")}
           for run, rs in results.items()}
    columns = ["run", "trained params", "parameter bytes MiB", "RSS after imports MiB", "RSS before step 1 MiB",
               f"peak RSS, steps 2..{args.steps + 1} MiB", "peak - imports MiB", "peak per round MiB",
               "tokens/s (1 thread)", f"loss step 1 / {args.steps + 1}",
               "planned: weights", "gradients", "optimizer", "activations", "sum MiB"]
    rounds = [r.get("measured", "?") for r in next(iter(results.values()))]
    rows = []
    for run, rs in results.items():
        m = med[run]
        rows.append([run, f"{rs[0]['trained_params']:,}", f"{rs[0]['parameter_bytes'] / MIB:.1f}",
                     f"{m['floor'] / MIB:.0f}", f"{m['before_step_1'] / MIB:.0f}", f"{m['peak'] / MIB:.0f}",
                     f"{(m['peak'] - m['floor']) / MIB:.0f}", " / ".join(f"{r['peak'] / MIB:.0f}" for r in rs),
                     f"{rs[0]['tokens_per_step'] / m['step_s']:,.0f}",
                     f"{rs[0]['losses'][0]:.4f} / {rs[0]['losses'][-1]:.4f}", *plan_cells(plans[run])])
    notes = [f"CPU: {cpu_line()} (shared with other people's jobs: memory is what this bench is about, the "
             "tokens/s are one thread's under that load).",
             f"Model: LlamaForCausalLM {MODEL['num_hidden_layers']} x {MODEL['hidden_size']}, SwiGLU "
             f"{MODEL['intermediate_size']}, {MODEL['num_attention_heads']} / {MODEL['num_key_value_heads']} heads, "
             f"vocab {VOCAB}; LoRA rank {RANK}, alpha {ALPHA:g}, all-linear; fp32; micro-batch {args.batch} x "
             f"{args.block} tokens; {len(rounds)} rounds, the three runs interleaved in each (measured: "
             + "; ".join(f"{', '.join(str(i + 1) for i, m in enumerate(rounds) if m == when)} at {when}"
                         for when in dict.fromkeys(rounds)) + ").",
             "Spread of the peak between rounds (max - min): " + ", ".join(
                 f"{run} {(max(r['peak'] for r in rs) - min(r['peak'] for r in rs)) / MIB:.0f} MiB"
                 for run, rs in results.items()) + ".",
             "RSS with MALLOC_MMAP_THRESHOLD_=65536 (freed tensors leave the RSS); the peak is VmHWM after a reset "
             "following step 1, so start-up (reading the base; QLoRA's fp32 copy before quantizing) is excluded.",
             "planned: meshtrain plan CONFIG --json at the run's own layout, MiB, no runtime overhead."]
    data = {"args": vars(args), "cpu": cpu_line(), "results": results, "plans": plans}
    data["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in data["args"].items()}
    path = write_results("lora_memory", "Peak memory: full fine-tuning, LoRA and QLoRA side by side, and planned",
                         columns, rows, notes, data)
    print(path.read_text())


if __name__ == "__main__":
    main()
