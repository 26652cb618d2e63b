"""The main job against nanoGPT itself: the same baby GPT trained by karpathy/nanoGPT's ``train.py`` and by meshtrain.

nanoGPT's README trains a "baby GPT" on Tiny Shakespeare's characters on a CPU (4 layers, 4 heads, 128 wide, block
64, batch 12, 2000 steps, lr 1e-3 -> 1e-4 after 100 warmup steps, beta2 0.99, no dropout); meshtrain's main job
(``configs/shakespeare_char.toml``) is that configuration. This bench runs nanoGPT itself -- a checkout of
https://github.com/karpathy/nanoGPT at commit 3adf61e, given with ``--nanogpt DIR``; nothing of it is copied into
meshtrain -- beside meshtrain, in fp32 on one process each:

1. **Same start, same batches** (in this process, ``--steps-equal`` steps): nanoGPT's ``GPT`` built at a seed, its
   weights copied into meshtrain's GPT (nanoGPT's fused ``c_attn`` split into meshtrain's q, k, v), both fed the
   batches of nanoGPT's ``get_batch`` (uniform random offsets with replacement), each trained by its own code's
   optimizer (nanoGPT's ``configure_optimizers``; meshtrain's ``build_optimizer`` and schedule) with clipping at 1.0
   and nanoGPT's learning rate schedule: the per-step losses, which fp32 rounding alone separates if the model, the
   loss, clipping and AdamW are the same.
2. **Over seeds** (``--seeds``, 2000 steps each): nanoGPT's ``train.py`` with the README's baby-GPT flags
   (``--device=cpu --compile=False --eval_iters=20`` ...), its seed set by shifting the ``torch.manual_seed`` its
   script calls (1337 + offset) to the seed wanted; meshtrain's ``meshtrain train configs/shakespeare_char.toml
   --seed S --train.dtype float32`` (``bench/bench_seeds.py``'s run). Every final model is evaluated by one
   evaluator on the whole val split (every non-overlapping 64-token window of meshtrain's last 10%: no sampling
   noise), next to each side's own logged estimate (240 random windows: nanoGPT's ``estimate_loss``).
   Differences: Welch's t and 95% interval.

    git clone https://github.com/karpathy/nanoGPT && git -C nanoGPT checkout 3adf61e
    python bench/bench_nanogpt.py --nanogpt nanoGPT [--seeds 1337,1,2,3,4] [--steps 2000] [--jobs 2] [--work DIR]

Runs complete in ``--work`` are reused. Writes ``bench/results/nanogpt.{md,json}`` and docs/benchmarks.md's section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_seeds  # noqa: E402
from bench_moe import cpu_flags  # noqa: E402
from common import REPO, update_benchmarks_doc, write_results  # noqa: E402
from contenders import val_loss  # noqa: E402

BABY_GPT = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=100", "--block_size=64",
            "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--lr_decay_iters={steps}",
            "--max_iters={steps}", "--dropout=0.0", "--eval_interval=250", "--always_save_checkpoint=True"]
"""nanoGPT README's "baby GPT" on a CPU (its ``config/train_shakespeare_char.py`` plus these), checkpointing at every
evaluation so the model after the last step is kept."""
RUNNER = ("import runpy, sys, torch; seed = int(sys.argv[1]); manual_seed = torch.manual_seed; "
          "torch.manual_seed = lambda s: manual_seed(s - 1337 + seed); script = sys.argv[2]; "
          "sys.argv = sys.argv[2:]; sys.path.insert(0, str(__import__('pathlib').Path(script).parent)); "
          "runpy.run_path(script, run_name='__main__')")
"""``python -c RUNNER SEED train.py ARGS``: nanoGPT's train.py unchanged, its ``torch.manual_seed(1337 + offset)``
(weights, then batches) drawing from ``SEED + offset`` instead."""


def nanogpt_data(nanogpt: Path, work: Path) -> Path:
    """nanoGPT's ``data/shakespeare_char`` (train.bin, val.bin, meta.pkl) made by its own ``prepare.py`` from the
    bundled Tiny Shakespeare (the script downloads the same file when no input.txt is there)."""
    from meshtrain.config.load import load_config

    folder = work / "nanogpt-data" / "shakespeare_char"
    if (folder / "meta.pkl").exists():
        return folder.parent
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(nanogpt / "data" / "shakespeare_char" / "prepare.py", folder / "prepare.py")
    shutil.copy(load_config(bench_seeds.CONFIG).data.resolved_path(), folder / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True, capture_output=True)
    return folder.parent


def run_default(work: Path, seed: int, steps: int, threads: int) -> Path:
    """``meshtrain train`` at its default settings (bf16 where the CPU has bf16 matmul) at ``seed`` into
    ``work/meshtrain-default-sSEED`` unless complete; checkpoints as :func:`bench_seeds.run`'s."""
    out = work / f"meshtrain-default-s{seed}"
    if (out / "summary.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    cmd = bench_seeds.commands("meshtrain", seed, steps, out)  # its fp32 run, less the dtype
    cmd = [a for i, a in enumerate(cmd) if a != "--train.dtype" and (i == 0 or cmd[i - 1] != "--train.dtype")]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    return out


def nanogpt_out(work: Path, seed: int) -> Path:
    return work / f"nanogpt-s{seed}"


def run_nanogpt(nanogpt: Path, work: Path, seed: int, steps: int, threads: int) -> None:
    """nanoGPT's train.py at ``seed`` into ``work/nanogpt-sSEED`` (its log in ``log.txt``) unless complete."""
    out = nanogpt_out(work, seed)
    if (out / "done").exists():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "data").symlink_to(nanogpt_data(nanogpt, work).resolve(), target_is_directory=True)
    (out / "configurator.py").symlink_to((nanogpt / "configurator.py").resolve())  # train.py execs it from the cwd
    args = [a.format(steps=steps) for a in BABY_GPT]
    cmd = [sys.executable, "-c", RUNNER, str(seed), str(nanogpt / "train.py"),
           str(nanogpt / "config" / "train_shakespeare_char.py"), *args, f"--out_dir={out / 'ckpt'}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT seed {seed} failed (exit {proc.returncode}): see {out / 'log.txt'}")
    (out / "done").touch()


class NanoLogits(torch.nn.Module):
    """nanoGPT's ``GPT`` called as meshtrain's models are: ids (B, T) -> logits (B, T, V) (nanoGPT returns every
    position's logits only when it is given targets)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, torch.zeros_like(x))[0]


def nanogpt_model(nanogpt: Path, ckpt: Path):
    """nanoGPT's GPT with the weights of its checkpoint ``ckpt.pt``."""
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig

    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    model = GPT(GPTConfig(**saved["model_args"]))
    model.load_state_dict(saved["model"])
    return model, saved["iter_num"]


def corpus():
    from meshtrain.config.load import load_config
    from meshtrain.data.corpus import load_corpus

    cfg = load_config(bench_seeds.CONFIG)
    return load_corpus(cfg.data.resolved_path(), cfg.data.val_fraction, cfg.model.block_size)


def nanogpt_result(nanogpt: Path, work: Path, seed: int, steps: int, data) -> dict:
    """nanoGPT's own last estimate (its log's ``step STEPS: ... val loss``) and its final model on the whole val split."""
    out = nanogpt_out(work, seed)
    logged = re.findall(rf"step {steps}: train loss ([0-9.]+), val loss ([0-9.]+)", (out / "log.txt").read_text())
    model, step = nanogpt_model(nanogpt, out / "ckpt" / "ckpt.pt")
    assert step == steps, f"nanoGPT seed {seed}: checkpoint at step {step}, not {steps}"
    return {"final": val_loss(NanoLogits(model), data, 64, windows=0), "logged": float(logged[-1][1])}


def copy_weights(theirs, ours) -> None:
    """nanoGPT's GPT weights into meshtrain's GPT (its fused ``c_attn`` rows q | k | v split; the head tied)."""

    src = theirs.state_dict()
    names = {"transformer.wte.weight": "tok_emb.weight", "transformer.wpe.weight": "pos_emb.weight",
             "transformer.ln_f.weight": "norm.weight"}
    dst = {}
    for name, t in src.items():
        if name in names:
            dst[names[name]] = t
        elif m := re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name):
            i, rest = m.groups()
            if rest == "attn.c_attn.weight":
                for part, w in zip("qkv", t.chunk(3, dim=0)):
                    dst[f"blocks.{i}.attn.{part}.weight"] = w
            else:
                rest = rest.replace("attn.c_proj", "attn.proj").replace("mlp.c_fc", "mlp.fc").replace("mlp.c_proj",
                                                                                                      "mlp.proj")
                dst[f"blocks.{i}.{rest}"] = t
    dst["lm_head.weight"] = src["lm_head.weight"]
    with torch.no_grad():
        missing = ours.load_state_dict(dst, strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys


def same_start(nanogpt: Path, steps: int, seed: int = 1337) -> list[list[float]]:
    """[step, nanoGPT's loss, meshtrain's loss] for ``steps`` steps from the same weights on the same batches."""
    import math

    import numpy as np

    from meshtrain.config.load import load_config
    from meshtrain.models.build import build_model
    from meshtrain.optim.build import build_optimizer

    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig

    cfg = load_config(bench_seeds.CONFIG, {"train.steps": "2000"})
    o = cfg.optim
    torch.manual_seed(seed)
    theirs = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, bias=False, dropout=0.0))
    ours = build_model(cfg.model, 65)
    copy_weights(theirs, ours)
    their_opt = theirs.configure_optimizers(o.weight_decay, o.lr, (o.beta1, o.beta2), "cpu")
    our_opt, schedule = build_optimizer(ours.named_parameters(), cfg, 12)
    data = np.frombuffer(corpus().train.to(torch.uint16).numpy().tobytes(), dtype=np.uint16)
    gen = torch.Generator().manual_seed(seed)

    def get_lr(it: int) -> float:  # nanoGPT train.py's, for its optimizer
        if it < o.warmup_steps:
            return o.lr * (it + 1) / (o.warmup_steps + 1)
        ratio = (it - o.warmup_steps) / (2000 - o.warmup_steps)
        return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)

    rows = []
    for it in range(steps):
        ix = torch.randint(len(data) - 64, (12,), generator=gen)  # nanoGPT's get_batch
        x = torch.stack([torch.from_numpy(data[i:i + 64].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 65].astype(np.int64)) for i in ix])
        for group in their_opt.param_groups:
            group["lr"] = get_lr(it)
        _, loss_theirs = theirs(x, y)
        loss_theirs.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), o.grad_clip)
        their_opt.step()
        their_opt.zero_grad(set_to_none=True)
        logits = ours(x)
        loss_ours = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss_ours.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), o.grad_clip)
        our_opt.step()
        our_opt.zero_grad(set_to_none=True)
        schedule.step()
        rows.append([it + 1, loss_theirs.item(), loss_ours.item()])
    return rows


def speed(nanogpt: Path, work: Path, steps: int = 300, rounds: int = 2) -> dict[str, list[float]]:
    """Median ms per step of nanoGPT's train.py (fp32: its CPU path has no autocast) and of ``meshtrain train`` in fp32
    and at its defaults (bf16 where the CPU has bf16 matmul), ``steps`` steps each, one process of one thread at a
    time, ``rounds`` interleaved rounds (the seed runs above ran two at a time: no timing is taken from them).
    nanoGPT's logged iteration times past its first 20 iterations; meshtrain's ``step_time_s`` of metrics.jsonl."""
    out = work / "speed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    times: dict[str, list[float]] = {"nanoGPT, fp32": [], "meshtrain, fp32": [], "meshtrain, default settings": []}
    for r in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "data").symlink_to(nanogpt_data(nanogpt, work).resolve(), target_is_directory=True)
        (out / "configurator.py").symlink_to((nanogpt / "configurator.py").resolve())
        args = [a.format(steps=steps) for a in BABY_GPT if not a.startswith(("--log_interval", "--eval_interval"))]
        log = subprocess.run([sys.executable, str(nanogpt / "train.py"), str(nanogpt / "config" / "train_shakespeare_char.py"),
                              *args, "--log_interval=1", f"--eval_interval={10 * steps}", f"--out_dir={out / 'ckpt'}"],
                             cwd=out, env=env, capture_output=True, text=True, check=True).stdout
        ms = [float(t) for it, t in re.findall(r"iter (\d+): loss [0-9.]+, time ([0-9.]+)ms", log) if int(it) > 20]
        times["nanoGPT, fp32"].append(statistics.median(ms))
        for name, extra in (("meshtrain, fp32", ["--train.dtype", "float32"]), ("meshtrain, default settings", [])):
            run = out / name.replace(" ", "").replace(",", "-")
            subprocess.run([*bench_seeds.meshtrain_command(), "train", str(bench_seeds.CONFIG), "--nproc", "1", "--steps",
                            str(steps), "--out", str(run), "--train.eval_interval", "0", "--train.log_interval", "1", *extra],
                           cwd=REPO, env=env, capture_output=True, check=True)
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            times[name].append(1000 * statistics.median(x["step_time_s"] for x in records
                                                        if "step_time_s" in x and x["step"] > 20))
    shutil.rmtree(out, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT_DIR"),
                        help="a checkout of karpathy/nanoGPT at commit 3adf61e (default: $NANOGPT_DIR)")
    parser.add_argument("--seeds", default="1337,1,2,3,4")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-equal", type=int, default=50, help="steps of part 1 (same start, same batches)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_nanogpt")
    args = parser.parse_args()
    if args.nanogpt is None:  # make bench: nothing to compare against here; the last table stays
        print("bench_nanogpt: no nanoGPT checkout (--nanogpt DIR or NANOGPT_DIR): kept bench/results/nanogpt.md")
        update_benchmarks_doc("nanogpt")
        return
    if not (args.nanogpt / "train.py").is_file():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no train.py there; clone https://github.com/karpathy/nanoGPT")
    seeds = [int(s) for s in args.seeds.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(1)
    equal = same_start(args.nanogpt, args.steps_equal)
    speeds = speed(args.nanogpt, args.work)
    nanogpt_data(args.nanogpt, args.work)
    jobs = [(kind, s) for kind in ("nanogpt", "meshtrain", "default") for s in seeds]
    runners = {"nanogpt": lambda s: run_nanogpt(args.nanogpt, args.work, s, args.steps, 1),
               "meshtrain": lambda s: bench_seeds.run("meshtrain", s, args.steps, args.work, 1),
               "default": lambda s: run_default(args.work, s, args.steps, 1)}
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: runners[job[0]](job[1]), jobs))
    data = corpus()
    found = {"nanogpt": {s: nanogpt_result(args.nanogpt, args.work, s, args.steps, data) for s in seeds},
             "meshtrain": {}}
    found["default"] = {}
    for s in seeds:
        curve, logged, _ = bench_seeds.meshtrain_curve(bench_seeds.out_path(args.work, "meshtrain", s))
        found["meshtrain"][s] = {"final": curve[-1][1], "logged": logged.get(curve[-1][0])}
        curve, logged, _ = bench_seeds.meshtrain_curve(run_default(args.work, s, args.steps, 1))
        found["default"][s] = {"final": curve[-1][1], "logged": logged.get(curve[-1][0])}
    report(found, seeds, equal, speeds, args)


def report(found: dict, seeds: list[int], equal: list[list[float]], speeds: dict[str, list[float]], args) -> None:
    fmt = "{:.4f}".format
    cols = ["seed", "nanoGPT: whole val", "nanoGPT: its own log (240 windows)", "meshtrain fp32: whole val",
            "meshtrain fp32: its own log (240 windows)", "meshtrain fp32 - nanoGPT (whole val)",
            "meshtrain default: whole val"]
    rows = [[s, fmt(found["nanogpt"][s]["final"]), fmt(found["nanogpt"][s]["logged"]), fmt(found["meshtrain"][s]["final"]),
             fmt(found["meshtrain"][s]["logged"]), f"{found['meshtrain'][s]['final'] - found['nanogpt'][s]['final']:+.4f}",
             fmt(found["default"][s]["final"])] for s in seeds]

    def column(side: str, key: str) -> list[float]:
        return [found[side][s][key] for s in seeds]

    def summary(values: list[float]) -> str:
        sp = bench_seeds.spread(values)
        return f"{sp['mean']:.4f} ± {sp['std']:.4f} ({sp['min']:.3f}..{sp['max']:.3f})"

    rows.append(["mean ± std (min..max)", summary(column("nanogpt", "final")), summary(column("nanogpt", "logged")),
                 summary(column("meshtrain", "final")), summary(column("meshtrain", "logged")), "",
                 summary(column("default", "final"))])
    default = bench_seeds.compare(column("default", "final"), column("nanogpt", "final"))
    whole = bench_seeds.compare(column("meshtrain", "final"), column("nanogpt", "final"))
    logged = bench_seeds.compare(column("meshtrain", "logged"), column("nanogpt", "logged"))
    worst = max(abs(a - b) / a for _, a, b in equal)
    notes = [f"{len(seeds)} seeds, {args.steps} steps, global batch 12 x 64 tokens, 1 process and 1 thread each, fp32; "
             f"nanoGPT: its train.py at the README's baby-GPT flags ({' '.join(a.format(steps=args.steps) for a in BABY_GPT)}); "
             "meshtrain: `meshtrain train configs/shakespeare_char.toml --nproc 1 --seed S --train.dtype float32`.",
             "Whole val = every non-overlapping 64-token window of the val split (the text's last 10%, 111 k tokens), "
             "every model through the same evaluator (nanoGPT's model given targets to return every position's logits); "
             "its own log = the 240 random val windows each side's estimate draws at the last step (nanoGPT's "
             "`estimate_loss`, eval_iters 20 x batch 12: a standard error of ~0.014 by itself).",
             "meshtrain - nanoGPT on the whole val split: " + welch(whole) + ".",
             "meshtrain - nanoGPT, each side's own log: " + welch(logged) + ".",
             "meshtrain at its default settings (`meshtrain train configs/shakespeare_char.toml --nproc 1 --seed S`: "
             f"bf16 on a CPU with bf16 matmul; this one has {cpu_flags()}) - nanoGPT (fp32), whole val: " + welch(default) + ".",
             f"Same start, same batches ({len(equal)} steps, nanoGPT's GPT at seed 1337 copied into meshtrain's, "
             f"nanoGPT's random windows): the per-step losses differ by at most {worst:.1e} relative "
             f"(step 1: {equal[0][1]:.6f} vs {equal[0][2]:.6f}; step {equal[-1][0]}: {equal[-1][1]:.6f} vs "
             f"{equal[-1][2]:.6f}).",
             "Speed, one run at a time, 1 thread, 300 steps, rounds interleaved (median ms per step; per round): "
             + "; ".join(f"{name} {statistics.median(v):.1f} ({' / '.join(f'{t:.1f}' for t in v)}), "
                         f"{statistics.median(speeds['nanoGPT, fp32']) / statistics.median(v):.2f}x nanoGPT's tokens/s"
                         for name, v in speeds.items()) + f". CPU flags: {cpu_flags()}."]
    md = write_results("nanogpt", "The main job against nanoGPT itself over seeds", cols, rows, notes,
                       {"seeds": seeds, "steps": args.steps, "found": {k: {str(s): v for s, v in d.items()}
                                                                       for k, d in found.items()},
                        "same_start": equal, "whole_val": whole, "logged": logged, "default_whole_val": default,
                        "speed_ms": speeds})
    update_benchmarks_doc("nanogpt")
    print(md.read_text())


def welch(c: dict) -> str:
    verdict = ("meshtrain worse beyond the spread" if c["welch_ci95"][0] > 0 else
               "meshtrain better beyond the spread" if c["welch_ci95"][1] < 0 else "no difference beyond the spread")
    return (f"difference of means {c['diff']:+.4f}, Welch t = {c['welch_t']:.2f} (df {c['welch_df']:.1f}), 95% interval "
            f"[{c['welch_ci95'][0]:+.4f}, {c['welch_ci95'][1]:+.4f}]: {verdict}")


if __name__ == "__main__":
    main()
