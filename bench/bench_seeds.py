"""The main job's final val loss over several seeds: meshtrain against the plain PyTorch loop, with the spread.

One seed cannot tell a real gap from seed noise. For each seed S this runs, at the config's hyperparameters
(``configs/shakespeare_char.toml``: 1 process, global batch 12 x 64 tokens, 2000 steps, warmup 100 then cosine
to 1e-4, AdamW(0.9, 0.99), weight decay 0.1 on matrices, clip 1.0) in fp32:

- meshtrain: ``meshtrain train configs/shakespeare_char.toml --nproc 1 --seed S --train.dtype float32``, with a
  checkpoint every ``train.eval_interval`` steps (all kept), so its curve is evaluated like the loop's;
- the plain loop of ``bench/contenders.py``: ``plain --batch 12 --seed S --data-seed S --fused``. Both seed torch
  with S and build meshtrain's GPT, so at one seed they start from the same weights; the loops differ in the
  batches only: random windows with replacement (nanoGPT's ``get_batch``) against meshtrain's sampler (epochs
  of shuffled windows at a stride of block_size, a random offset per epoch);
- the same plain loop fed by meshtrain's sampler (``--windows meshtrain``): the same weights and batches as
  meshtrain at seed S, so it separates the loop (meshtrain against it: rounding only) from the data windows
  (it against the plain loop).

Every model is evaluated the same way: on the whole val split (every non-overlapping window: 111 k tokens, no
sampling noise) and on the contenders bench's 96 fixed windows. meshtrain's own logged val loss (240 windows
drawn from the seed, as nanoGPT's ``estimate_loss``) is reported next to it. Over seeds: mean, sample std,
min..max; meshtrain - plain as a difference of means with Welch's t and its 95% interval, and as same-seed
(paired) differences.

    python bench/bench_seeds.py [--seeds 1,2,3,1337] [--steps 2000] [--jobs 1] [--work DIR]

Runs already complete in ``--work`` are reused, so a second call only reports. Each run costs ~3 CPU-minutes (2000 steps of one thread).
Writes ``bench/results/seeds.{md,json}``, ``docs/seeds.png`` and docs/benchmarks.md's seeds section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, update_benchmarks_doc, write_results  # noqa: E402
from contenders import val_loss  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"
CONTENDERS = REPO / "bench" / "contenders.py"
EVAL_INTERVAL = 250
CONFIG_BATCH = 12
"""The config's global batch at 1 process (micro_batch_size 12, GA 1)."""
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}
"""Two-sided 95% quantiles of Student's t by degrees of freedom (a df between entries takes the smaller one:
a slightly wider interval)."""
NAMES = {"meshtrain": "meshtrain dp=1, fp32", "plain": "plain PyTorch loop, fp32",
         "sampler": "plain loop on meshtrain's sampler, fp32"}
KINDS = tuple(NAMES)


def t975(df: float) -> float:
    return T975[max(k for k in T975 if k <= max(1.0, df))]


def commands(kind: str, seed: int, steps: int, out: Path) -> list[str]:
    if kind == "meshtrain":
        return [*meshtrain_command(), "train", str(CONFIG), "--nproc", "1", "--seed", str(seed), "--steps", str(steps),
                "--out", str(out), "--train.dtype", "float32", "--train.eval_interval", str(EVAL_INTERVAL),
                "--checkpoint.interval", str(EVAL_INTERVAL), "--checkpoint.keep", "1000"]
    batch = str(CONFIG_BATCH)
    return [sys.executable, str(CONTENDERS), "plain", str(out), "--steps", str(steps), "--batch", batch,
            "--seed", str(seed), "--data-seed", str(seed), "--fused", "--eval-interval", str(EVAL_INTERVAL),
            "--windows", "meshtrain" if kind == "sampler" else "random"]


def out_path(work: Path, kind: str, seed: int) -> Path:
    return work / {"meshtrain": f"meshtrain-s{seed}", "plain": f"plain-s{seed}.json",
                   "sampler": f"plainsampler-s{seed}.json"}[kind]


def complete(out: Path) -> bool:
    return (out / "summary.json").exists() if out.suffix != ".json" else out.exists()


def run(kind: str, seed: int, steps: int, work: Path, threads: int) -> None:
    """Train one (kind, seed) into ``work`` unless it is there already; its output goes to ``work/logs``."""
    out = out_path(work, kind, seed)
    if complete(out):
        return
    if out.is_dir():
        shutil.rmtree(out)  # an interrupted run: start it again
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with open(work / "logs" / f"{kind}-s{seed}.log", "w") as log:
        proc = subprocess.run(commands(kind, seed, steps, out), stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} seed {seed} failed (exit {proc.returncode}): see {work}/logs/{kind}-s{seed}.log")


def eval_noise(model, corpus, block: int, windows: int = 240) -> float:
    """The standard error of a val loss averaged over ``windows`` random windows (meshtrain's eval, nanoGPT's
    ``estimate_loss`` at eval_iters 20 x batch 12): the std of the per-window loss over every non-overlapping
    window of the val split, / sqrt(windows)."""
    import torch
    import torch.nn.functional as F

    data = corpus.val
    starts = torch.arange(0, len(data) - block - 1, block)  # (W,)
    x = data[starts[:, None] + torch.arange(block)]  # (W, T)
    y = data[starts[:, None] + 1 + torch.arange(block)]  # (W, T)
    model.eval()
    with torch.no_grad():
        per_window = torch.cat([F.cross_entropy(model(xc).transpose(1, 2), yc, reduction="none").mean(1)
                                for xc, yc in zip(x.split(96), y.split(96))])  # (W,)
    return float(per_window.std()) / windows ** 0.5


def meshtrain_curve(out: Path) -> tuple[list[list[float]], dict[int, float], float]:
    """([step, whole-val loss, 96-window loss] for every checkpoint of the run, {step: its own logged val loss},
    the final model's :func:`eval_noise`); kept in ``out/val_curve.json`` once computed."""
    from meshtrain.checkpoint import store as ckpt
    from meshtrain.cli.export import load_checkpoint_model
    from meshtrain.config.sections import DataConfig
    from meshtrain.data.corpus import load_corpus

    kept = out / "val_curve.json"
    if kept.exists():
        found = json.loads(kept.read_text())
        return found["curve"], {int(k): v for k, v in found["logged"].items()}, found["eval_noise_240"]
    curve, corpus = [], None
    for folder in ckpt.list_checkpoints(out):
        model, meta, _ = load_checkpoint_model(folder)
        block = meta["config"]["model"]["block_size"]
        if corpus is None:
            data = DataConfig(**meta["config"]["data"])
            corpus = load_corpus(data.resolved_path(), data.val_fraction, block)
        curve.append([meta["step"], val_loss(model, corpus, block, windows=0), val_loss(model, corpus, block)])
    logged = {r["step"]: r["val_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "val_loss" in r}
    noise = eval_noise(model, corpus, block)
    kept.write_text(json.dumps({"curve": curve, "logged": logged, "eval_noise_240": noise}))
    return curve, logged, noise


def collect(work: Path, seeds: list[int], kinds: list[str]) -> dict:
    """{kind: {seed: {"curve": [[step, whole, 96]], "final": whole, "final96": 96, "logged": meshtrain's own}}}."""
    found: dict = {kind: {} for kind in kinds}
    for seed in seeds:
        curve, logged, noise = meshtrain_curve(out_path(work, "meshtrain", seed))
        found["meshtrain"][seed] = {"curve": curve, "final": curve[-1][1], "final96": curve[-1][2],
                                    "logged": logged.get(curve[-1][0]), "eval_noise_240": noise}
        for kind in set(kinds) - {"meshtrain"}:
            curve = json.loads(out_path(work, kind, seed).read_text())["val_curve"]
            found[kind][seed] = {"curve": curve, "final": curve[-1][1], "final96": curve[-1][2], "logged": None}
    return found


def spread(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def compare(a: list[float], b: list[float]) -> dict:
    """a - b: Welch's difference of means (95% interval), and the paired (same-index) differences."""
    sa, sb = spread(a), spread(b)
    va, vb = sa["std"] ** 2 / len(a), sb["std"] ** 2 / len(b)
    se = math.sqrt(va + vb)
    df = se ** 4 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se else float(len(a) + len(b) - 2)
    diff = sa["mean"] - sb["mean"]
    d = spread([x - y for x, y in zip(a, b)])
    se_d = d["std"] / math.sqrt(d["n"])
    return {"diff": diff, "welch_se": se, "welch_df": df, "welch_t": diff / se if se else 0.0,
            "welch_ci95": [diff - t975(df) * se, diff + t975(df) * se],
            "paired": d, "paired_t": d["mean"] / se_d if se_d else 0.0,
            "paired_ci95": [d["mean"] - t975(d["n"] - 1) * se_d, d["mean"] + t975(d["n"] - 1) * se_d]}


def plot(found: dict, path: Path) -> None:
    """Whole-val loss against step: every seed thin, the mean over seeds thick, meshtrain blue, the loop grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, color, style in (("meshtrain", "#4c72b0", "-"), ("plain", "#777777", "-"), ("sampler", "#dd8452", "--")):
        if kind not in found:
            continue
        curves = list(found[kind].values())
        for c in curves:
            for a in (ax, zoom):
                a.plot([p[0] for p in c["curve"]], [p[1] for p in c["curve"]], color=color, alpha=0.35, lw=0.8)
        steps = [p[0] for p in curves[0]["curve"]]
        mean = [statistics.fmean(c["curve"][i][1] for c in curves) for i in range(len(steps))]
        for a in (ax, zoom):
            a.plot(steps, mean, color=color, lw=3 if style == "-" else 1.5, ls=style,
                   label=f"{NAMES[kind]} (mean of {len(curves)} seeds)")
    zoom.set_xlim(950, max(steps) + 50)
    zoom.set_ylim(1.85, 2.15)
    for a in (ax, zoom):
        a.set_xlabel("step")
        a.set_ylabel("val loss (whole val split)")
        a.grid(alpha=0.3)
    zoom.legend(fontsize=8)
    ax.set_title("configs/shakespeare_char.toml, 1 process, fp32")
    zoom.set_title("the last 1000 steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,1337", help="comma-separated seeds (train.seed)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time (losses do not depend on timing; each run gets CPUs / jobs threads)")
    parser.add_argument("--work", default=str(REPO / "runs" / "bench_seeds"),
                        help="where the runs are kept; complete ones are reused")
    parser.add_argument("--name", default="seeds", help="results name: bench/results/NAME.*, docs/NAME.png")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"what to train and report, of {', '.join(KINDS)} (meshtrain and plain are needed)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    work = Path(args.work)
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        for f in [pool.submit(run, kind, s, args.steps, work, threads) for s in seeds for kind in kinds]:
            f.result()
    report(collect(work, seeds, kinds), seeds, args.steps, args.name)


def compare_note(label: str, c: dict) -> str:
    verdict = ("worse beyond the spread" if c["welch_ci95"][0] > 0 and c["paired_ci95"][0] > 0
               else "better beyond the spread" if c["welch_ci95"][1] < 0 and c["paired_ci95"][1] < 0
               else "no difference beyond the spread")
    return (f"{label}: difference of means {c['diff']:+.4f}, Welch t = {c['welch_t']:.2f} (df {c['welch_df']:.1f}), "
            f"95% interval [{c['welch_ci95'][0]:+.4f}, {c['welch_ci95'][1]:+.4f}]; same-seed differences "
            f"{c['paired']['mean']:+.4f} ± {c['paired']['std']:.4f}, 95% interval "
            f"[{c['paired_ci95'][0]:+.4f}, {c['paired_ci95'][1]:+.4f}]: {verdict}")


def report(found: dict, seeds: list[int], steps: int, name: str) -> None:
    """Write the table (per seed, then mean ± std (min..max)), the comparisons, the plot and the docs section."""
    finals = {kind: [found[kind][s]["final"] for s in seeds] for kind in found}
    finals96 = {kind: [found[kind][s]["final96"] for s in seeds] for kind in found}
    stats = {kind: {"whole_val": spread(finals[kind]), "val_96": spread(finals96[kind])} for kind in found}
    stats["meshtrain"]["logged"] = spread([found["meshtrain"][s]["logged"] for s in seeds])
    pairs = {"meshtrain - plain": ("meshtrain", "plain"), "meshtrain - plain on meshtrain's sampler": ("meshtrain", "sampler"),
             "plain on meshtrain's sampler - plain (the data windows alone)": ("sampler", "plain")}
    compared = {label: compare(finals[a], finals[b]) for label, (a, b) in pairs.items() if a in found and b in found}
    compared96 = compare(finals96["meshtrain"], finals96["plain"])
    columns = ["seed", f"meshtrain: whole val @ {steps}", "meshtrain: 96 windows", "meshtrain: its own log (240 windows)",
               "plain loop: whole val", "plain loop: 96 windows",
               *(["plain loop on meshtrain's sampler: whole val"] if "sampler" in found else []), "meshtrain - plain (whole val)"]
    rows = [[s, *(f"{found['meshtrain'][s][k]:.4f}" for k in ("final", "final96", "logged")),
             *(f"{found['plain'][s][k]:.4f}" for k in ("final", "final96")),
             *([f"{found['sampler'][s]['final']:.4f}"] if "sampler" in found else []),
             f"{found['meshtrain'][s]['final'] - found['plain'][s]['final']:+.4f}"] for s in seeds]

    def summary(kind: str, key: str) -> str:
        st = stats[kind][key]
        return f"{st['mean']:.4f} ± {st['std']:.4f} ({st['min']:.3f}..{st['max']:.3f})"

    main_cmp = compared["meshtrain - plain"]
    rows.append(["mean ± std (min..max)", summary("meshtrain", "whole_val"), summary("meshtrain", "val_96"),
                 summary("meshtrain", "logged"), summary("plain", "whole_val"), summary("plain", "val_96"),
                 *([summary("sampler", "whole_val")] if "sampler" in found else []), f"{main_cmp['paired']['mean']:+.4f} ± {main_cmp['paired']['std']:.4f}"])
    notes = [f"{len(seeds)} seeds, {steps} steps, global batch {CONFIG_BATCH} x 64 tokens, 1 process, fp32 (meshtrain: "
             "`meshtrain train configs/shakespeare_char.toml --nproc 1 --seed S --train.dtype float32`; the loop: "
             "`bench/contenders.py plain --batch 12 --seed S --data-seed S --fused [--windows meshtrain]`); "
             "the same initial weights per seed. Whole val split unless said otherwise.",
             *[compare_note(label, c) + "." for label, c in compared.items()],
             *([f"meshtrain against the plain loop on the same batches, every curve point of every seed: at most "
                f"{max(abs(a[1] - b[1]) for s in seeds for a, b in zip(found['meshtrain'][s]['curve'], found['sampler'][s]['curve'])):.1e} "
                "apart (float rounding): meshtrain's loop computes what the hand-written loop computes."]
               if "sampler" in found else []),
             f"meshtrain - plain on the 96 windows: difference of means {compared96['diff']:+.4f}, 95% interval "
             f"[{compared96['welch_ci95'][0]:+.4f}, {compared96['welch_ci95'][1]:+.4f}].",
             "Whole val = every non-overlapping 64-token window of the val split (111 k tokens); 96 windows = the contenders "
             "bench's fixed windows; meshtrain's own log = the 240 windows its eval draws from the seed (nanoGPT's "
             "`estimate_loss` protocol at eval_iters 20), which differ per seed and add their own noise: a mean over 240 "
             "random windows has a standard error of "
             f"{statistics.fmean(found['meshtrain'][s]['eval_noise_240'] for s in seeds):.4f} (the per-window std of "
             "meshtrain's final models / sqrt(240)).",
             f"Curves: docs/{name}.png (whole val every {EVAL_INTERVAL} steps; meshtrain's from its checkpoints)."]
    write_results(name, "Final val loss over seeds: meshtrain against the plain PyTorch loop (configs/shakespeare_char.toml)",
                  columns, rows, notes, {"seeds": seeds, "steps": steps, "stats": stats, "compared_whole_val": compared,
                                         "compared_96_windows": compared96,
                                         "runs": {k: {str(s): v for s, v in d.items()} for k, d in found.items()}})
    plot(found, REPO / "docs" / f"{name}.png")
    update_benchmarks_doc(name)
    print("\n".join(["| " + " | ".join(map(str, r)) + " |" for r in rows] + notes[1:5]))


if __name__ == "__main__":
    main()
