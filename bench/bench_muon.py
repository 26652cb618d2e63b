"""Muon against AdamW (issue 55): steps and wall time to AdamW's val loss, and step time by layout.

    python bench/bench_muon.py [--quick] [--work DIR] [--rounds 3]    # ~50 min on 2 idle cores; --quick ~3 min

Two jobs, each trained in one process (``--nproc 1``, fp32, one thread per run):

- the main job, ``configs/shakespeare_char.toml`` (the char GPT), micro-batch 12 = global batch 12, 2000 steps, as
  ``bench_seeds.py`` trains it; val loss every 50 steps;
- the README's BPE Llama, ``configs/llama_tiny.toml`` on Tiny Shakespeare cut at blank lines and tokenized by a
  1,024-id byte-level BPE, both made here by ``meshtrain tokenizer train`` and ``meshtrain prepare`` as the README
  does; 500 steps at the README's global batch of 24 (its dp = 2 x 12, here micro-batch 24 in one process, the same
  loss by the correctness contract); val loss every 25 steps on 10 micro-batches.

1. Learning rates: on seed 1337, AdamW and Muon (``optim.muon_lr_adjust = "match_rms_adamw"``: one peak lr for the
   matrices and for what AdamW trains beside them) each over a grid of three peak lrs (``min_lr = lr / 10``, the
   configs' warmup and cosine decay); where the best is at an edge of its grid, one more lr beyond that edge.
2. Seeds 1 and 2 at each optimizer's best lr (seed 1337's run from the sweep). The target is AdamW's final val loss
   (mean over the seeds); per seed, Muon's first evaluation at or below it gives its steps and wall time
   (``elapsed_s`` of ``metrics.jsonl``, evaluations included; and from the runs' median step times, which other
   work on the machine moves less) as fractions of AdamW's whole run of the same seed. AdamW and Muon of the same
   seed run side by side (one core each) so that both see the same load.
3. Step time, one run at a time in interleaved rounds: AdamW, Muon with the owner exchange and the naive all-gather
   (``optim.muon_exchange``) at 1 process (fp32 and bf16 autocast), FSDP2 dp2 (``parallel.zero_stage 3``) and tp2,
   each job at its config's micro-batch of 12 per rank; median ``step_time_s`` past the first steps.

Writes ``bench/results/muon.md``/``.json`` (``--quick``: a plumbing check that prints its table, writes nothing).
Runs are kept in ``--work`` and complete ones reused, so a second call only reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_posttraining import cpu_line  # noqa: E402
from common import REPO, meshtrain_command, write_results  # noqa: E402

OPTIMS = ("adamw", "muon")
NAMES = {"adamw": "AdamW", "muon": "Muon"}
SEEDS = (1337, 1, 2)
CORPUS = REPO / "src" / "meshtrain" / "assets" / "tinyshakespeare.txt"


@dataclass
class Job:
    key: str
    title: str
    config: str
    steps: int
    eval_interval: int
    micro_batch: int
    eval_steps: int
    lrs: dict[str, tuple[float, ...]]
    extra: dict[str, str] = field(default_factory=dict)


def jobs(quick: bool) -> list[Job]:
    if quick:
        one = {"adamw": (1e-3,), "muon": (2e-3,)}
        return [Job("main", "main job (char GPT)", "configs/shakespeare_char.toml", 100, 25, 12, 20, one),
                Job("llama", "BPE Llama", "configs/llama_tiny.toml", 50, 25, 24, 10, one)]
    return [Job("main", "main job (char GPT)", "configs/shakespeare_char.toml", 2000, 50, 12, 20,
                {"adamw": (6e-4, 1e-3, 2e-3), "muon": (1e-3, 2e-3, 4e-3)}),
            Job("llama", "BPE Llama", "configs/llama_tiny.toml", 500, 25, 24, 10,
                {"adamw": (2e-3, 4e-3, 8e-3), "muon": (4e-3, 8e-3, 1.6e-2)})]


def run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def prepare_bpe(work: Path) -> Path:
    """The README's tokenizer and token shards (its first two commands), made once in ``work/data``."""
    data = work / "data"
    if not (data / "shakespeare_bpe" / "meta.json").exists():
        data.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(data / "shakespeare_bpe", ignore_errors=True)
        mt = meshtrain_command()
        run([*mt, "tokenizer", "train", "--input", str(CORPUS), "--vocab-size", "1024", "--out",
             str(data / "shakespeare_bpe.json")], data / "tokenizer.log")
        run([*mt, "prepare", "--tokenizer", str(data / "shakespeare_bpe.json"), "--input", str(CORPUS), "--doc-split",
             "blank-line", "--val-fraction", "0.1", "--out", str(data / "shakespeare_bpe")], data / "prepare.log")
    return data / "shakespeare_bpe"


def run_dir(job: Job, optim: str, lr: float, seed: int, work: Path) -> Path:
    return work / f"{job.key}-{optim}-lr{lr:g}-s{seed}"


def train(job: Job, optim: str, lr: float, seed: int, work: Path) -> Path:
    """One training run of ``job`` into ``work`` unless it is complete there; returns its run folder."""
    out = run_dir(job, optim, lr, seed, work)
    if (out / "summary.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)  # an interrupted run: start it again
    args = {**job.extra, "optim.name": optim, "optim.lr": lr, "optim.min_lr": lr / 10, "train.seed": seed,
            "train.steps": job.steps, "train.eval_interval": job.eval_interval, "train.eval_steps": job.eval_steps,
            "train.dtype": "float32",
            "batch.micro_batch_size": job.micro_batch, "checkpoint.interval": 0, "checkpoint.keep": 1}
    cmd = [*meshtrain_command(), "train", job.config, "--nproc", "1", "--out", str(out)]
    run(cmd + [t for k, v in args.items() for t in (f"--{k}", str(v))], work / f"{out.name}.log")
    return out


def side_by_side(runs: list[tuple], work: Path) -> None:
    """Train those of ``runs`` (``train``'s arguments) not complete in ``work`` two at a time, in order: AdamW and
    Muon of a pair start together."""
    runs = [r for r in runs if not (run_dir(*r, work) / "summary.json").exists()]
    for i in range(0, len(runs), 2):
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: train(*r, work), runs[i:i + 2]))


def evals(out: Path) -> list[dict]:
    """The run's evaluations, one per step: step, val_loss, elapsed_s."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return list({r["step"]: r for r in records if "val_loss" in r}.values())


def sweep(job: Job, work: Path) -> dict[str, dict[float, float]]:
    """Final val loss on seed 1337 per optimizer and lr: the grid, then one lr beyond an edge holding the best."""
    lrs = {o: list(job.lrs[o]) for o in OPTIMS}
    for extend in (True, False):
        pairs = [(job, o, lrs[o][i], SEEDS[0]) for i in range(max(map(len, lrs.values())))
                 for o in OPTIMS if i < len(lrs[o])]
        side_by_side(pairs, work)
        finals = {o: {lr: evals(train(job, o, lr, SEEDS[0], work))[-1]["val_loss"] for lr in lrs[o]} for o in OPTIMS}
        beyond = {o: edge(finals[o]) for o in OPTIMS} if extend and len(job.lrs["adamw"]) > 1 else {}
        if not any(beyond.values()):
            break
        for o, lr in beyond.items():
            lrs[o] += [lr] if lr else []
    return finals


def edge(finals: dict[float, float]) -> float | None:
    """The next lr beyond the grid where its best lr is the largest (x2) or the smallest (/2), else None."""
    best = min(finals, key=finals.get)
    return best * 2 if best == max(finals) else best / 2 if best == min(finals) else None


def spread(values: list[float], fmt: str = "{:.4f}") -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(std)}"


def median_step_s(out: Path) -> float:
    """The run's median ``step_time_s`` over its logged intervals: its step time with bursts of other load left out."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records if "step_time_s" in r)


def to_target(job: Job, work: Path, seeds: tuple[int, ...]) -> dict:
    """Train the seeds at the swept lrs; AdamW's final val loss (mean over seeds) and when Muon reaches it, per
    seed: steps / AdamW's steps, elapsed_s / AdamW's elapsed_s (same seed), and the same from median step times."""
    finals = sweep(job, work)
    best = {o: min(finals[o], key=finals[o].get) for o in OPTIMS}
    side_by_side([(job, o, best[o], s) for s in seeds for o in OPTIMS], work)
    outs = {o: [train(job, o, best[o], s, work) for s in seeds] for o in OPTIMS}
    curves = {o: [evals(out) for out in outs[o]] for o in OPTIMS}
    medians = {o: [median_step_s(out) for out in outs[o]] for o in OPTIMS}
    target = statistics.mean(c[-1]["val_loss"] for c in curves["adamw"])
    hits = [next((e for e in c if e["val_loss"] <= target), None) for c in curves["muon"]]
    ratios = {"steps": [], "wall": [], "wall_median": []}
    for h, a, ma, mm in zip(hits, curves["adamw"], medians["adamw"], medians["muon"]):
        if h:
            ratios["steps"].append(h["step"] / job.steps)
            ratios["wall"].append(h["elapsed_s"] / a[-1]["elapsed_s"])
            ratios["wall_median"].append(h["step"] * mm / (job.steps * ma))
    return {"job": job.key, "steps": job.steps, "finals_sweep": finals, "best_lr": best, "target": target,
            "final": {o: [c[-1]["val_loss"] for c in curves[o]] for o in OPTIMS},
            "wall": {o: [c[-1]["elapsed_s"] for c in curves[o]] for o in OPTIMS}, "median_step_s": medians,
            "muon_hit": [h and {"step": h["step"], "elapsed_s": h["elapsed_s"]} for h in hits],
            "ratios": ratios, "curves": curves}


def target_rows(job: Job, r: dict) -> list[list]:
    rows = []
    for o in OPTIMS:
        sweep_cell = ", ".join(f"{lr:g}: {v:.4f}" for lr, v in sorted(r["finals_sweep"][o].items()))
        ms = spread([1e3 * t for t in r["median_step_s"][o]], "{:.1f}")
        if o == "adamw":
            reach = [f"{job.steps} (its end)", "1.00x", spread(r["wall"]["adamw"], "{:.0f}"), "1.00x"]
        elif all(r["muon_hit"]):
            q = r["ratios"]
            reach = [" / ".join(str(h["step"]) for h in r["muon_hit"]), spread(q["steps"], "{:.2f}") + "x",
                     spread([h["elapsed_s"] for h in r["muon_hit"]], "{:.0f}"),
                     f"{spread(q['wall'], '{:.2f}')}x (by median step time: {spread(q['wall_median'], '{:.2f}')}x)"]
        else:
            reach = [" / ".join(str(h["step"]) if h else "not reached" for h in r["muon_hit"]), "-", "-", "-"]
        rows.append([f"{job.title}, {NAMES[o]}", sweep_cell, f"{r['best_lr'][o]:g}",
                     f"{spread(r['final'][o])} (wall {spread(r['wall'][o], '{:.0f}')} s; {ms} ms/step)", *reach])
    return rows


LAYOUTS = [("1 process, fp32", 1, {}), ("1 process, bf16 autocast", 1, {"train.dtype": "bfloat16"}),
           ("FSDP2 dp2 (zero_stage 3), fp32", 2, {"parallel.zero_stage": 3}), ("tp2, fp32", 2, {"parallel.tp": 2})]
VARIANTS = [("AdamW", {"optim.name": "adamw"}), ("Muon owner", {"optim.name": "muon", "optim.muon_exchange": "owner"}),
            ("Muon gather", {"optim.name": "muon", "optim.muon_exchange": "gather"})]


def step_time(job: Job, nproc: int, overrides: dict, steps: int, skip: int) -> float:
    """Median ``step_time_s`` of one short run past its first ``skip`` steps (ms)."""
    args = {**job.extra, "train.dtype": "float32", **overrides, "train.steps": steps, "train.log_interval": 1,
            "train.eval_interval": 0, "train.eval_steps": 1, "optim.warmup_steps": 1, "checkpoint.interval": 0,
            "checkpoint.keep": 1}
    with tempfile.TemporaryDirectory(prefix="meshtrain-muon-") as tmp:
        cmd = [*meshtrain_command(), "train", job.config, "--nproc", str(nproc), "--out", f"{tmp}/run"]
        run(cmd + [t for k, v in args.items() for t in (f"--{k}", str(v))], Path(tmp, "log"))
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    return 1e3 * statistics.median(r["step_time_s"] for r in records if "step_time_s" in r and r["step"] > skip)


def step_times(todo: list[Job], rounds: int, steps: int, skip: int) -> dict[str, list[float]]:
    """ms per (job, layout, variant), one value per round; every run alone, rounds interleaved."""
    times: dict[str, list[float]] = {}
    for i in range(rounds):
        for job in todo:
            for layout, nproc, over in LAYOUTS:
                for variant, opt in VARIANTS[:2] if nproc == 1 else VARIANTS:
                    key = f"{job.key}|{layout}|{variant}"
                    times.setdefault(key, []).append(step_time(job, nproc, {**over, **opt}, steps, skip))
                    print(f"round {i + 1}: {key}: {times[key][-1]:.1f} ms", flush=True)
    return times


def step_rows(job: Job, times: dict[str, list[float]]) -> list[list]:
    rows = []
    for layout, nproc, _ in LAYOUTS:
        med = {v: statistics.median(times[f"{job.key}|{layout}|{v}"]) for v, _ in VARIANTS
               if f"{job.key}|{layout}|{v}" in times}
        for v, ms in med.items():
            name = "Muon" if nproc == 1 and v != "AdamW" else v
            gather = f"{med['Muon gather'] / med['Muon owner']:.2f}x" if v == "Muon gather" else ""
            rows.append([f"{job.title}, {layout}, {name}", f"{ms:.1f}",
                         " / ".join(f"{t:.1f}" for t in times[f"{job.key}|{layout}|{v}"]),
                         f"{ms / med['AdamW']:.2f}x", gather, "", "", ""])
    return rows


def ns_share(job: Job) -> float:
    """Newton-Schulz FLOPs per step (5 iterations, every Muon matrix once) / the model's forward + backward FLOPs
    per step at the config's micro-batch of 12 (:func:`meshtrain.planner.cost.model_flops`)."""
    import torch

    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.optim.table import newton_schulz_flops, takes_muon
    from meshtrain.planner.cost import model_flops
    from meshtrain.planner.model_specs import from_config, trained_vocab_size

    cfg = load_config(REPO / job.config, dict(job.extra))
    vocab = trained_vocab_size(cfg)
    with torch.device("meta"):
        model = build_model(cfg.model, vocab)
    ns = sum(newton_schulz_flops(tuple(p.shape), cfg.optim.muon_ns_steps) for n, p in model.named_parameters()
             if takes_muon(n, tuple(p.shape)))
    return ns / model_flops(from_config(cfg, vocab), cfg.batch.micro_batch_size)


def sample_load(samples: list[float], stop: threading.Event, every_s: float = 15.0) -> None:
    """Append the machine's 1-minute load average to ``samples`` every ``every_s`` until ``stop``: how much other
    work shared the cores with the runs (these runs add 2 while training, 1 or 2 while timing)."""
    while not stop.wait(every_s):
        samples.append(os.getloadavg()[0])


@contextlib.contextmanager
def load_sampled(samples: list[float]):
    stop = threading.Event()
    threading.Thread(target=sample_load, args=(samples, stop), daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def measure(todo: list[Job], work: Path, seeds: tuple[int, ...], timing: tuple[int, int, int]) -> tuple:
    """Train (complete runs reused) and time the layouts (``timing`` = rounds, steps, skipped steps; reused from
    ``work/measured.json`` when taken with the same ``timing``). Returns the targets, the step times and the load
    samples of both phases, and keeps the last two in ``work/measured.json``."""
    path = work / "measured.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    load = saved.get("load", {"training": [], "step time": []})
    with load_sampled(load["training"]):
        results = {job.key: to_target(job, work, seeds) for job in todo}
    times = saved.get("step_times") if saved.get("timing") == list(timing) else None
    if times is None:
        load["step time"] = []
        with load_sampled(load["step time"]):
            times = step_times(todo[:1] if len(seeds) == 1 else todo, *timing)
    path.write_text(json.dumps({"timing": list(timing), "step_times": times, "load": load}, indent=1) + "\n")
    return results, times, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, one lr, one seed, one round: plumbing only")
    parser.add_argument("--work", type=Path, help="where runs are kept (default runs/bench_muon; --quick: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the step-time runs")
    parser.add_argument("--timing-steps", type=int, default=30, help="steps of each step-time run (first 5 left out)")
    args = parser.parse_args()
    work = args.work or (Path(tempfile.mkdtemp(prefix="bench_muon_")) if args.quick else REPO / "runs" / "bench_muon")
    work.mkdir(parents=True, exist_ok=True)
    seeds, timing = (SEEDS[:1], (1, 10, 3)) if args.quick else (SEEDS, (args.rounds, args.timing_steps, 5))
    todo = jobs(args.quick)
    todo[1].extra["data.path"] = str(prepare_bpe(work))
    results, times, load = measure(todo, work, seeds, timing)
    shares = {job.key: ns_share(job) for job in todo}
    rows = [["**to AdamW's final val loss**", "lr sweep, seed 1337 (lr: final val loss)", "lr",
             "final val loss at equal steps, mean ± std (wall s; median ms/step)", "Muon's steps to it, per seed",
             "steps / AdamW's", "wall s to it", "wall / AdamW's (same seed)"]]
    rows += [row for job in todo for row in target_rows(job, results[job.key])]
    rows += [["**step time**", "ms, median of rounds", "per round", "vs AdamW, same layout", "gather / owner", "", "",
              ""]]
    rows += [row for job in todo for row in step_rows(job, times)]
    notes = notes_for(todo, results, times, shares, seeds, timing, args)
    notes.insert(1, "1-minute load average of the machine, sampled every 15 s (" + "; ".join(
        f"{k}: median {statistics.median(v):.1f}, max {max(v):.1f}" for k, v in load.items() if v)
        + f", on {os.cpu_count()} cores; these runs account for up to 2): other work shared the cores.")
    data = {"cpu": cpu_line(), "targets": results, "step_times_ms": times, "ns_share": shares, "seeds": seeds,
            "load_average": load, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.quick:
        print("\n".join(" | ".join(str(c) for c in row) for row in rows), "\n", "\n".join(notes), sep="")
        return
    path = write_results("muon", "Muon vs AdamW: steps and wall time to AdamW's val loss, step time by layout",
                         [""] * 8, rows, notes, data)
    print(path.read_text())


def met(ratio: float, goal: float) -> str:
    return f"{ratio:.2f}x ({'met' if ratio <= goal else 'not met'})"


def notes_for(todo: list[Job], results: dict, times: dict, shares: dict, seeds: tuple, timing: tuple,
              args: argparse.Namespace) -> list[str]:
    goal = []
    for job in todo:
        r = results[job.key]
        if not all(r["muon_hit"]):
            goal.append(f"{job.title}: Muon did not reach AdamW's final val loss {r['target']:.4f} on every seed")
            continue
        s, w, wm = (statistics.mean(r["ratios"][k]) for k in ("steps", "wall", "wall_median"))
        alone = [statistics.median(times.get(f"{job.key}|1 process, fp32|{v}", [float("nan")]))
                 for v in ("Muon owner", "AdamW")]
        goal.append(f"{job.title}: steps {met(s, 0.8)}; wall measured side by side {met(w, 0.9)}, by the runs' "
                    f"median step times {met(wm, 0.9)}, from the step-time rows below (1 process, fp32, runs alone: "
                    f"steps x {alone[0] / alone[1]:.2f}) {met(s * alone[0] / alone[1], 0.9)}")
    main_job, llama = todo
    return [
        f"CPU: {cpu_line()}; one thread per process (OMP_NUM_THREADS=1); fp32 unless the row says bf16.",
        "Goal (issue 55: Muon in <= 0.8x AdamW's steps and <= 0.9x its wall time): " + "; ".join(goal) + ".",
        f"Jobs: the main job (configs/shakespeare_char.toml, {main_job.steps} steps, global batch "
        f"{main_job.micro_batch}, val every {main_job.eval_interval} steps on {main_job.eval_steps} x 12 windows) and "
        "the README's BPE Llama "
        f"(configs/llama_tiny.toml on the README's 1,024-id BPE shards, {llama.steps} steps, global batch "
        f"{llama.micro_batch} in one process = the README's dp 2 x 12, val every {llama.eval_interval} steps on "
        f"{llama.eval_steps} x {llama.micro_batch} windows of its 41,849 val tokens); "
        f"each run in one process, warmup 100 steps and cosine decay to lr / 10 at the last step; seeds "
        f"{', '.join(map(str, seeds))}. Both jobs train their documented lengths, but in one process (the main job "
        "at its one-process batch of 12, as bench_seeds.py; its README command runs dp 2, batch 24); the "
        "distributed layouts are timed (step time), not trained to the end: the 2 shared cores fit one-process "
        "runs, two at a time.",
        "Learning rates: a grid of three peak lrs per optimizer on seed 1337, one more beyond an edge holding the "
        "best; Muon with muon_lr_adjust = match_rms_adamw (0.2 sqrt(max(A, B)) lr per matrix) and muon_adamw_lr = 0 "
        "(embeddings, head and norms by AdamW at the same lr); the other Muon keys at their defaults (momentum 0.95, "
        "Nesterov, 5 Newton-Schulz steps in bf16).",
        "Target: AdamW's final val loss, mean over seeds "
        + ", ".join(f"{j.title} {results[j.key]['target']:.4f}" for j in todo) + ". Muon's steps: its first "
        "evaluation at or below it; wall: elapsed_s there (evaluations included, both optimizers evaluate at the same "
        "steps) / AdamW's elapsed_s at its end, same seed, the two run side by side on the 2 cores; 'by median step "
        "time': Muon's steps there x its run's median step_time_s / (AdamW's steps x its median), evaluations left "
        "out, which bursts of other work on the machine move less than elapsed_s.",
        "Newton-Schulz FLOPs per step / the model's forward + backward FLOPs at micro-batch 12: "
        + ", ".join(f"{j.title} {shares[j.key]:.0%}" for j in todo) + f" (the Llama trains at micro-batch "
        f"{llama.micro_batch}: half that share). Muon's extra time per step is this work, done in bf16; it does not "
        "shrink with the batch, so it weighs most at the small batches these jobs use.",
        f"Step time: {timing[1]} steps per run, the first {timing[2]} left out, median step_time_s of a run; "
        f"{timing[0]} rounds, "
        "every run alone, rounds interleaved; micro-batch 12 per rank (FSDP2 dp2: global batch 24; tp2: 12). "
        "'owner': each sharded matrix orthogonalized on one rank (two all_to_all_single); 'gather': every rank "
        "all-gathers and orthogonalizes every matrix. At 1 process there is no exchange.",
        f"Runs kept in {args.work or 'runs/bench_muon'}. Command: python bench/bench_muon.py"
        + (f" --rounds {args.rounds}" if args.rounds != 3 else "")]


if __name__ == "__main__":
    main()
