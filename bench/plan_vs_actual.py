"""Planner vs trainer on this machine: predicted and measured time per step and peak memory per rank
for layouts of ``configs/shakespeare_char.toml`` (dp 1/2, zero_stage 0/2/3, micro batch and
accumulation splits, widths, fp32 (``train.dtype`` pinned: its default ``auto`` is bf16 on a CPU with
bf16 matmul) and bf16, tp 2 with and without sequence parallelism, sp 2 Ulysses and ring,
pp 2 with every pipeline schedule, each ``train.recompute`` mode at T = 512) and of ``configs/llama_tiny.toml`` (rows named ``llama ...``: dp 1/2,
FSDP2 zero 3, tp 2, sp 2 Ulysses, pp 2 1F1B; grouped-query attention, SwiGLU, an untied head).

    python bench/plan_vs_actual.py [--steps 40] [--repeats 1] [--calibrate] [--match pp2]   # ~12 min per round

Each run waits until the machine is idle (under 10% of the cores busy over 2 s) so that other work
does not slow the measurement, and is repeated (up to 3 tries, the least disturbed kept) when other
processes took more than 10% of the cores while it ran; so is each calibration.

Each layout is one real ``meshtrain train`` command line; after the ranks finish, the launcher compares
the trainer's ``OUT/summary.json`` with the planner and writes ``OUT/plan_vs_actual.json`` (prediction
from the profile of ``meshtrain plan --calibrate``, measured median step time excluding the first
steps, peak RSS of the busiest rank). ``--calibrate``
(re)measures the machine into the default profile at the start of every round, so that each round's
predictions come from a calibration taken minutes before its runs; the table gives, per layout, the
median prediction and the median measurement over the rounds. Writes ``bench/results/plan_vs_actual.md``
and ``.json``. With ``--match``, the rows of the other layouts are kept from the previous results file;
the ``run`` column and the notes say when (and how) each row was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS_DIR, machine, meshtrain_command, write_results  # noqa: E402

from meshtrain.planner.calibrate import busy_fraction  # noqa: E402
from meshtrain.planner.hardware import DEFAULT_PROFILE  # noqa: E402

GPT = "configs/shakespeare_char.toml"
LLAMA = "configs/llama_tiny.toml"
LAYOUTS = [  # (name, nproc, overrides) of the GPT config
    ("dp1 z0 mbs12", 1, {}),
    ("dp2 z0 mbs12", 2, {}),
    ("dp2 z2 mbs12", 2, {"parallel.zero_stage": 2}),
    ("dp2 z3 mbs12", 2, {"parallel.zero_stage": 3}),
    ("dp2 z0 mbs6 ga2", 2, {"batch.micro_batch_size": 6, "batch.gradient_accumulation_steps": 2}),
    ("dp2 z3 mbs4 ga3", 2, {"parallel.zero_stage": 3, "batch.micro_batch_size": 4,
                            "batch.gradient_accumulation_steps": 3}),
    ("dp2 z0 C256", 2, {"model.n_embd": 256}),
    ("dp1 C256 mbs8 ga2", 1, {"model.n_embd": 256, "batch.micro_batch_size": 8, "batch.gradient_accumulation_steps": 2}),
    ("dp2 z2 C384 T128 mbs8", 2, {"parallel.zero_stage": 2, "model.n_embd": 384, "model.n_head": 6,
                                  "model.block_size": 128, "batch.micro_batch_size": 8}),
    ("dp1 bf16", 1, {"train.dtype": "bfloat16"}),
    ("dp2 z0 bf16", 2, {"train.dtype": "bfloat16"}),
    ("tp2 mbs12", 2, {"parallel.tp": 2}),
    ("tp2+SP mbs12", 2, {"parallel.tp": 2, "parallel.tp_sequence_parallel": "true"}),
    ("tp2 C256", 2, {"parallel.tp": 2, "model.n_embd": 256}),
    ("sp2 ulysses mbs12", 2, {"parallel.sp": 2}),
    ("sp2 ring mbs12", 2, {"parallel.sp": 2, "parallel.sp_mode": "ring"}),
    ("sp2 ulysses T256 mbs4", 2, {"parallel.sp": 2, "model.block_size": 256, "batch.micro_batch_size": 4}),
    ("sp2 ring T256 mbs4", 2, {"parallel.sp": 2, "parallel.sp_mode": "ring", "model.block_size": 256,
                               "batch.micro_batch_size": 4}),
    *[(f"pp2 {name} mbs6 ga4", 2, {"parallel.pp": 2, "parallel.pp_schedule": sched, "parallel.virtual_stages": v,
                                   "batch.micro_batch_size": 6, "batch.gradient_accumulation_steps": 4})
      for name, sched, v in (("naive", "naive", 1), ("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
                             ("interleaved v2", "interleaved-1f1b", 2), ("zero-bubble v2", "zero-bubble", 2),
                             ("zbv", "zbv", 2))],
    ("pp2 1f1b mbs3 ga8", 2, {"parallel.pp": 2, "batch.micro_batch_size": 3, "batch.gradient_accumulation_steps": 8}),
    ("pp2 1f1b C256 mbs6 ga4", 2, {"parallel.pp": 2, "model.n_embd": 256, "batch.micro_batch_size": 6,
                                   "batch.gradient_accumulation_steps": 4}),
    # train.recompute: long sequences and a large micro-batch so that activations dominate the peak
    *[(f"dp1 recompute={rc} T512 mbs16", 1, {"train.recompute": rc, "model.block_size": 512,
                                             "batch.micro_batch_size": 16}) for rc in ("none", "selective", "full")],
]
LLAMA_LAYOUTS = [  # (name, nproc, overrides) of the Llama config: 4 query heads, 2 kv heads, F = 352, untied head
    ("llama dp1 mbs12", 1, {}),
    ("llama dp2 z0 mbs12", 2, {}),
    ("llama dp2 z3 mbs12", 2, {"parallel.zero_stage": 3}),
    ("llama tp2 mbs12", 2, {"parallel.tp": 2}),
    ("llama sp2 ulysses mbs12", 2, {"parallel.sp": 2}),
    ("llama pp2 1f1b mbs6 ga4", 2, {"parallel.pp": 2, "batch.micro_batch_size": 6,
                                    "batch.gradient_accumulation_steps": 4}),
]
RECOMPUTE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
"""The recompute rows' peak memory comes from a second run with glibc's mmap threshold fixed at 64 KiB (their step
time from the first, with the default allocator: mapping and faulting in every activation anew made those steps
1.5x slower, here 0.55 s against 0.37 s at recompute none): every activation tensor is then its own
mapping, returned to the system when freed, so the peak RSS is the peak of live tensors. With the default
dynamic threshold, glibc keeps freed activations in its heap, and the peak RSS of the three modes differs far
less than the tensors they hold (measured 708 / 700 / 615 MiB for none / selective / full, while the tensors
held after the forward pass are 269 / 189 / 28 MiB)."""
ALL = [(name, GPT, n, o) for name, n, o in LAYOUTS] + [(name, LLAMA, n, o) for name, n, o in LLAMA_LAYOUTS]
"""(name, config, nproc, overrides) of every row, in table order."""


def wait_for_idle(limit_s: float = 900.0) -> float:
    """Wait (up to ``limit_s``) until under 10% of the cores are busy: other work on the machine would
    slow the measured run and not the prediction. Returns the busy fraction when starting."""
    start = time.monotonic()
    busy = busy_fraction()
    while busy > 0.10 and time.monotonic() - start < limit_s:
        time.sleep(5)
        busy = busy_fraction()
    return busy


TRIES = 3
"""Runs of a layout (and calibrations) at most, while other work disturbs them."""


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, from ``/proc/stat``; CPU seconds of this process's
    finished children and their waited-for descendants, the ranks included)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        fields = [0] * 5
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def run_alone(make_cmd: Callable[[int], list[str]], env: dict | None = None) -> tuple[int, float, float]:
    """Run the command ``make_cmd(try)`` once the machine is idle, again (up to :data:`TRIES` times) while other
    processes take more than 10% of the cores during it. Returns (the least disturbed try, the busy fraction
    at its start, the fraction of the cores other processes took while it ran)."""
    best = None
    for i in range(TRIES):
        cmd = make_cmd(i)
        busy = wait_for_idle()
        (machine0, ours0), start = _cpu_seconds(), time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
        (machine1, ours1), wall = _cpu_seconds(), time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        others = max(0.0, (machine1 - machine0) - (ours1 - ours0)) / (wall * (os.cpu_count() or 1))
        if best is None or others < best[2]:
            best = (i, busy, others)
        if others <= 0.10:
            break
    return best


def calibrate() -> None:
    """``meshtrain plan --calibrate`` alone (:func:`run_alone`), its least disturbed profile saved as the default."""
    with tempfile.TemporaryDirectory(prefix="meshtrain-pva-") as tmp:
        i, _, _ = run_alone(lambda i: [*meshtrain_command(), "plan", "--calibrate", "--profile", f"{tmp}/profile{i}.toml"])
        DEFAULT_PROFILE.expanduser().parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f"{tmp}/profile{i}.toml", DEFAULT_PROFILE.expanduser())


RUN_ARGS = {"optim.warmup_steps": 5, "train.eval_steps": 2, "train.dtype": "float32"}
"""What every row runs with before its own overrides (fp32 pinned: ``auto`` is bf16 on a CPU with bf16 matmul)."""


def run_layout(config: str, nproc: int, overrides: dict, steps: int) -> dict:
    """Train one layout alone (:func:`run_alone`); return its ``plan_vs_actual.json`` with the busy fraction
    of the cores at the start under ``"busy_at_start"`` and the other processes' share during it under
    ``"others_busy"``. A recompute row is trained twice: its step time from a run with the default allocator, its
    peak memory from one under :data:`RECOMPUTE_ENV`."""
    args = {**RUN_ARGS, **overrides}
    with tempfile.TemporaryDirectory(prefix="meshtrain-pva-") as tmp:
        def train(out: str) -> list[str]:
            return [*meshtrain_command(), "train", config, "--nproc", str(nproc), "--steps", str(steps),
                    "--out", out, *[tok for key, value in args.items() for tok in (f"--{key}", str(value))]]

        i, busy, others = run_alone(lambda i: train(f"{tmp}/run{i}"))
        record = {**json.loads(Path(f"{tmp}/run{i}/plan_vs_actual.json").read_text()), "busy_at_start": busy,
                  "others_busy": others}
        if "train.recompute" not in overrides:
            return record
        j, _, _ = run_alone(lambda j: train(f"{tmp}/memory{j}"), RECOMPUTE_ENV)
        memory = json.loads(Path(f"{tmp}/memory{j}/plan_vs_actual.json").read_text())
        for part in ("measured", "relative_error", "inside_range"):
            record[part]["peak_memory_bytes"] = memory[part]["peak_memory_bytes"]
        return record


def previous_records() -> dict[str, dict]:
    """The rows of the last results file by layout name, each with ``taken`` (when and how it was measured;
    a file written before rows carried it gives its header's date and git revision)."""
    path = RESULTS_DIR / "plan_vs_actual.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    header = {"date": old["machine"]["date"], "git": old["machine"]["git"]}
    return {r["name"]: {"config": GPT, **r, "taken": r.get("taken", header)} for r in old["layouts"]}


def describe_run(taken: dict, names: list[str]) -> str:
    """One note line: which rows one run measured (all of a config's, or which), when, and how."""
    parts = []
    for config in (GPT, LLAMA):
        rows = [name for name, c, _, _ in ALL if c == config and name in names]
        every = len(rows) == sum(c == config for _, c, _, _ in ALL)
        if rows:
            parts.append(f"{'all ' if every else ''}{len(rows)} layout{'s' * (len(rows) > 1)} of {config}"
                         + ("" if every else f" ({', '.join(rows)})"))
    how = (f", {taken['steps']} steps each, {taken['rounds']} round(s)"
           f"{', each after a fresh calibration' if taken['calibrated'] else ''}" if "steps" in taken else "")
    return f"run {taken['date']} (git {taken['git']}): {' and '.join(parts)}{how}"


def measure(layouts: list[tuple], args: argparse.Namespace) -> list[dict]:
    """Run ``layouts`` for ``args.repeats`` interleaved rounds; one record per layout with every round's run."""
    rounds = []
    for _ in range(args.repeats):
        if args.calibrate:
            calibrate()
        rounds.append([run_layout(c, n, o, args.steps) for _, c, n, o in layouts])
    m = machine()
    taken = {"date": m["date"], "git": m["git"], "steps": args.steps, "rounds": args.repeats,
             "calibrated": args.calibrate}
    return [{"name": name, "config": config, "nproc": nproc, "overrides": overrides, "taken": taken,
             "runs": [r[i] for r in rounds]} for i, (name, config, nproc, overrides) in enumerate(layouts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; medians are reported")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the machine into the default profile at the start of every round")
    parser.add_argument("--match", default="",
                        help="only the layouts whose name contains this, e.g. pp2 or llama; the other rows are kept "
                             "from the previous results")
    args = parser.parse_args()
    chosen = [layout for layout in ALL if args.match in layout[0]]
    fresh = {r["name"]: r for r in measure(chosen, args)}
    kept = previous_records() if args.match else {}
    records = [fresh.get(name) or kept[name] for name, *_ in ALL if name in fresh or name in kept]
    write_table(records)


def write_table(records: list[dict]) -> None:
    """The results table of ``records`` (medians over each row's rounds) with its notes."""
    rows, time_errors, memory_errors, spreads, predicted_spreads = [], {}, {}, [], []
    for record in records:
        runs = record["runs"]
        guesses = [r["predicted"]["step_time_s"] for r in runs]
        predicted_step = statistics.median(guesses)
        predicted_peak = statistics.median(r["predicted"]["peak_memory_bytes"] for r in runs)
        predicted_spreads.append(max(guesses) / min(guesses))
        step = statistics.median(r["measured"]["step_time_s"] for r in runs)
        spreads.append([r["measured"]["step_time_s"] for r in runs])
        peak = statistics.median(r["measured"]["peak_memory_bytes"] for r in runs)
        t_err = (predicted_step - step) / step
        m_err = (predicted_peak - peak) / peak
        time_errors.setdefault(record["config"], []).append(t_err)
        memory_errors.setdefault(record["config"], []).append(m_err)
        rows.append([record["name"], record["taken"]["date"][:16], runs[0]["predicted"].get("threads_per_rank", "?"),
                     f"{predicted_step * 1e3:.1f}", f"{step * 1e3:.1f}", f"{t_err:+.1%}",
                     f"{predicted_peak / 2**20:.0f}", f"{peak / 2**20:.0f}", f"{m_err:+.1%}"])
    summary = {kind: {config: {"median_abs_error": statistics.median(abs(e) for e in errs),
                               "max_abs_error": max(abs(e) for e in errs)} for config, errs in by_config.items()}
               for kind, by_config in (("step_time_s", time_errors), ("peak_memory_bytes", memory_errors))}
    taken_by_run: dict[str, tuple[dict, list[str]]] = {}
    for record in records:
        taken_by_run.setdefault(json.dumps(record["taken"], sort_keys=True), (record["taken"], []))[1].append(
            record["name"])
    busy = [r["busy_at_start"] for record in records for r in record["runs"]]
    others = [r["others_busy"] for record in records for r in record["runs"] if "others_busy" in r]
    notes = [describe_run(taken, names) for taken, names in taken_by_run.values()]
    notes += ["predicted and measured = medians over a row's rounds; measured step time = median seconds per "
              "optimizer step without the first 3 steps; peak = max over ranks of ru_maxrss."]
    notes += [f"{kind}, {config}: median |error| {s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}"
              for kind, by_config in (("step time", summary["step_time_s"]), ("peak memory", summary["peak_memory_bytes"]))
              for config, s in by_config.items()]
    profiles = sorted({r["predicted"]["profile"] for record in records for r in record["runs"]})
    notes += [f"profile: {', '.join(profiles)}; cores busy at the runs' start: "
              f"{min(busy):.0%} to {max(busy):.0%}"
              + (f"; other processes' share of the cores during a run: {min(others):.0%} to {max(others):.0%} "
                 f"({len(others)} of {len(busy)} runs measured it)" if others else ""),
              "spread between rounds (max/min measured step time of a layout; - for one round): "
              + ", ".join(f"{max(t) / min(t):.2f}" if len(t) > 1 else "-" for t in spreads),
              "spread between calibrations (max/min predicted step time of a layout; - for one round): "
              + ", ".join(f"{s:.2f}" if len(t) > 1 else "-" for s, t in zip(predicted_spreads, spreads))]
    path = write_results("plan_vs_actual", "meshtrain plan vs meshtrain train on this machine",
                         ["layout", "run", "threads/rank", "predicted ms/step", "measured ms/step", "error",
                          "predicted MiB/rank", "measured MiB/rank", "error"], rows, notes,
                         {"layouts": records, "summary": summary})
    print(path.read_text())


if __name__ == "__main__":
    main()
