"""Where one training step of the main job spends its time: ``torch.profiler`` over meshtrain's own step.

The trainer of ``configs/shakespeare_char.toml`` runs in this process (one rank, all cores, the
default settings unless overridden), and its step is driven piece by piece so each piece is a
``record_function`` range: data, forward + backward, gradient clipping, loss all-reduce, optimizer.
Operator self-times are grouped into matmul, attention, elementwise/norm/loss, optimizer and
communication; what the ranges took beyond their operators is Python and dispatch overhead.

    python bench/bench_profile.py [--steps 20] [--name profile] [--section.key value ...]

Writes ``bench/results/NAME.{md,json}``; ``make bench`` also profiles the larger model of
``bench_contenders.py --large`` into ``profile_large``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, update_benchmarks_doc, write_results  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"
WARMUP = 10

GROUPS = [  # (group, substrings of aten op names), first match wins
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "softmax")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt", "_fused")),
    ("communication", ("all_reduce", "allreduce", "gloo", "c10d", "broadcast")),
    ("embedding", ("embedding",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "elementwise, norm, loss, copies"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="profiled steps (after a warm-up)")
    parser.add_argument("--name", default="profile", help="results/NAME.md (and the docs/benchmarks.md markers)")
    args, args.overrides = parser.parse_known_args()  # the rest: --section.key value, as meshtrain train takes them
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from meshtrain.config.load import load_config, parse_overrides
    from meshtrain.parallel.reduce import batch_mean
    from meshtrain.parallel.rng import seed_step
    from meshtrain.train.loop import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        overrides = {**parse_overrides(args.overrides), "train.out_dir": tmp}
        cfg = load_config(CONFIG, overrides)
        trainer = Trainer(cfg)

        def step(i: int) -> None:
            seed_step(trainer.model, cfg.train.seed, i, 0, 1)
            with record_function("data"):
                batches = trainer.sampler.next_step()
            with record_function("forward + backward"):
                loss = trainer.forward_backward(batches)
            with record_function("gradient clipping"):
                trainer.clip_gradients()
            with record_function("loss all-reduce"):
                batch_mean(loss, trainer.dims)
            with record_function("optimizer"):
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                trainer.scheduler.step()

        for i in range(WARMUP):
            step(i + 1)
        walls = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(args.steps):
                t0 = time.perf_counter()
                step(WARMUP + i + 1)
                walls.append(time.perf_counter() - t0)
        events = prof.key_averages()
        ranges = {e.key: e.cpu_time_total for e in events if e.key in
                  ("data", "forward + backward", "gradient clipping", "loss all-reduce", "optimizer")}
        groups: dict[str, float] = {}
        for e in events:
            if e.key.startswith("aten::") or "gloo" in e.key.lower() or "c10d" in e.key.lower():
                groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total
        total_us = sum(walls) * 1e6
        ops_us = sum(groups.values())
        groups["Python, dispatch, autograd engine (the rest)"] = max(0.0, total_us - ops_us)
        top = sorted(((e.key, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")),
                     key=lambda kv: -kv[1])[:12]
        torch.distributed.destroy_process_group()
    per_step = {k: v / args.steps / 1e3 for k, v in groups.items()}
    rows = [[k, f"{v:.2f}", f"{v / (total_us / args.steps / 1e3):.0%}"] for k, v in sorted(per_step.items(),
                                                                                           key=lambda kv: -kv[1])]
    rows.append(["**step (wall)**", f"{statistics.median(walls) * 1e3:.2f} (median)", "100%"])
    notes = [f"{args.steps} steps after {WARMUP} warm-up steps, one rank with {torch.get_num_threads()} threads, "
             f"{trainer.dtype}, micro_batch_size {cfg.batch.micro_batch_size} x block_size "
             f"{cfg.model.block_size}; overrides: {' '.join(args.overrides) or 'none'}.",
             "Ranges of the step (ms/step, inclusive): " + ", ".join(f"{k} {v / args.steps / 1e3:.2f}"
                                                                    for k, v in ranges.items()) + ".",
             "Top operators by self time (ms/step): " + ", ".join(f"{k} {v / args.steps / 1e3:.2f}" for k, v in top)
             + ".",
             "The rest = wall time minus every operator's self time: Python in the loop and the model, "
             "dispatcher and autograd overhead, allocator."]
    write_results(args.name, "One training step of the main job, by where the time goes",
                  ["where", "ms/step", "share"], rows, notes,
                  {"per_step_ms": per_step, "ranges_ms": {k: v / args.steps / 1e3 for k, v in ranges.items()},
                   "top_ops_ms": {k: v / args.steps / 1e3 for k, v in top}, "walls_s": walls})
    update_benchmarks_doc(args.name)
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))


if __name__ == "__main__":
    main()
