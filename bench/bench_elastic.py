"""Elastic DiLoCo workers: what one worker's failure costs the other, and the run.

    python bench/bench_elastic.py [--steps 400] [--kill-after 100] [--heartbeat-ms 5000] [--seeds 1337 1 2]

Two workers of the main job (``configs/shakespeare_char.toml``: its GPT, micro-batch 12, AdamW inside, H = 8, outer
Nesterov 0.7/0.9), each its own ``meshtrain train`` job of one rank under ``--max-restarts 1``, joined through
``torchft_lighthouse`` on 127.0.0.1 (``min_replicas`` 1, ``--heartbeat-ms`` the time after which a silent worker has
left; torchft's default is 5 s). Per seed, two runs: nobody fails; and worker 1's rank killed (SIGKILL) once it
has taken ``--kill-after`` steps, restarted by torchrun with no checkpoint to resume, so it must take over worker 0's state.
Worker 0 starts first and worker 1 joins it once worker 0 has taken a step (it takes over worker 0's state at the
next outer step), so both runs are alike up to the kill.

Reports per run: each worker's wall time, worker 0's longest step (the outer step that waited for the dead worker
to be declared gone) against its longest step in the run where nobody failed, the steps worker 0 took alone, the
seconds from the kill to worker 1's next logged step (restart + rejoin), the step it rejoined at, each worker's final
val loss, and whether the two workers' final weights are equal. Writes ``bench/results/elastic.md``/``.json``.

~5 min at the defaults on 2 CPU cores (the two jobs share them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import REPO, write_results  # noqa: E402
from elastic_jobs import Lighthouse, logged_steps, rank_pid, start_worker  # noqa: E402

CONFIG = REPO / "configs" / "shakespeare_char.toml"


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights_equal(a: Path, b: Path) -> bool:
    """Whether two runs' final checkpoints hold equal weights, bit for bit."""
    import torch

    from meshtrain.checkpoint import store as ckpt
    from meshtrain.models.registry import ModelConfig
    from meshtrain.models.build import build_model

    weights = []
    for out in (a, b):
        path = ckpt.resolve_checkpoint(out)
        meta = ckpt.read_meta(path)
        model = build_model(ModelConfig(**meta["config"]["model"]), meta["vocab_size"])
        ckpt.load(path, model, None)
        weights.append(model.state_dict())
    return all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def wait_for(ready, job, out: Path) -> None:
    """Poll ``ready()`` until it is true; exit with the job's console if the job ends first."""
    while not ready():
        if job.poll() is not None:
            raise SystemExit(f"{out} ended early: {Path(f'{out}.log').read_text()[-2000:]}")
        time.sleep(0.01)


def run(root: Path, args: argparse.Namespace, seed: int, kill: bool) -> dict:
    """One two-worker run; with ``kill``, worker 1's rank is killed once it has taken ``args.kill_after`` steps."""
    overrides = {"train.steps": str(args.steps), "train.seed": str(seed), "diloco.inner_steps": "8",
                 "train.log_interval": "1", "train.eval_interval": "0", "checkpoint.interval": "0",
                 "train.dtype": "float32"}
    outs = [root / f"w{w}" for w in (0, 1)]
    lighthouse = Lighthouse(min_replicas=1, heartbeat_ms=args.heartbeat_ms)
    start = time.monotonic()
    result: dict = {"seed": seed, "killed": kill}
    try:
        # worker 0 first; worker 1 joins it at its next outer step (whoever starts first would train alone until the
        # other is up, so the order is fixed to make the runs alike up to the kill)
        jobs = [start_worker(CONFIG, lighthouse, 0, 2, outs[0], overrides, "--max-restarts", "1")]
        wait_for(lambda: logged_steps(outs[0]), jobs[0], outs[0])
        jobs.append(start_worker(CONFIG, lighthouse, 1, 2, outs[1], overrides, "--max-restarts", "1"))
        wait_for(lambda: logged_steps(outs[1]), jobs[1], outs[1])
        result["worker1_joined_at"] = logged_steps(outs[1])[0] - 1
        if kill:
            while len(logged_steps(outs[1])) < args.kill_after:
                if jobs[1].poll() is not None:
                    raise SystemExit(f"worker 1 ended early: {Path(f'{outs[1]}.log').read_text()[-2000:]}")
                time.sleep(0.01)
            os.kill(rank_pid(jobs[1].pid), signal.SIGKILL)
            killed_at = time.monotonic()
            result["killed_after_step"] = logged_steps(outs[1])[-1]
            result["worker0_step_at_kill"] = (logged_steps(outs[0]) or [0])[-1]
            while not logged_steps(outs[1]) or logged_steps(outs[1])[-1] <= result["killed_after_step"]:
                time.sleep(0.01)
            result["kill_to_next_step_s"] = time.monotonic() - killed_at
        walls = []
        for job, out in zip(jobs, outs):
            if job.wait(timeout=1800) != 0:
                raise SystemExit(f"{out} failed: {Path(f'{out}.log').read_text()[-3000:]}")
            walls.append(time.monotonic() - start)
    finally:
        lighthouse.close()
    summaries = [json.loads((out / "summary.json").read_text()) for out in outs]
    step_times = [r["step_time_s"] for r in records(outs[0]) if "step_time_s" in r]
    result.update(wall_s=walls, worker0_longest_step_s=max(step_times), worker0_median_step_s=statistics.median(step_times),
                  val_loss=[s["val_loss"] for s in summaries], rejoined_at=summaries[1]["diloco"]["healed_at"],
                  weights_equal=final_weights_equal(outs[0], outs[1]),
                  worker0_steps=len(logged_steps(outs[0])))
    if kill and result["rejoined_at"] is not None:
        result["worker0_steps_alone"] = result["rejoined_at"] - result["worker0_step_at_kill"]
    return result


def mean_sd(values: list[float], digits: int) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-after", type=int, default=100)
    parser.add_argument("--heartbeat-ms", type=int, default=5000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        for seed in args.seeds:
            for kill in (False, True):
                root = Path(tmp) / f"{seed}-{'kill' if kill else 'clean'}"
                root.mkdir()
                results.append(run(root, args, seed, kill))
                print(json.dumps(results[-1]), flush=True)
    rows = []
    for kill in (False, True):
        rs = [r for r in results if r["killed"] == kill]
        alone = [r["worker0_steps_alone"] for r in rs if "worker0_steps_alone" in r]
        rows.append([
            f"worker 1 killed after {args.kill_after} of its steps" if kill else "nobody fails",
            ", ".join(str(r["worker1_joined_at"]) for r in rs),
            mean_sd([r["wall_s"][0] for r in rs], 1), mean_sd([r["wall_s"][1] for r in rs], 1),
            mean_sd([r["worker0_longest_step_s"] for r in rs], 2), mean_sd([r["worker0_median_step_s"] for r in rs], 3),
            mean_sd(alone, 0) if alone else "-",
            mean_sd([r["kill_to_next_step_s"] for r in rs], 1) if kill else "-",
            ", ".join(str(r["rejoined_at"]) for r in rs) if kill else "-",
            mean_sd([r["val_loss"][0] for r in rs], 4), mean_sd([r["val_loss"][1] for r in rs], 4),
            f"{sum(r['weights_equal'] for r in rs)}/{len(rs)}"])
    columns = ["run", "worker 1 joined at step", "worker 0 wall s", "worker 1 wall s", "worker 0 longest step s", "worker 0 median step s",
               "steps worker 0 took alone after the kill", "kill to worker 1's next step s", "worker 1 rejoined at step",
               "worker 0 final val loss", "worker 1 final val loss", "final weights equal"]
    notes = [f"Two elastic DiLoCo workers (diloco.lighthouse) of {CONFIG.relative_to(REPO)}, one rank each, "
             f"H = 8, {args.steps} steps, fp32, seeds {', '.join(map(str, args.seeds))}; mean ± sd over seeds.",
             f"torchft_lighthouse on 127.0.0.1, min_replicas 1, heartbeat timeout {args.heartbeat_ms} ms; each job "
             f"under --max-restarts 1, no checkpoints (the killed worker can only come back by taking over the "
             f"other's state).",
             "Both jobs share the machine's 2 cores, so the kill also frees a core for worker 0 until worker 1 "
             "is back."]
    md = write_results("elastic", "Elastic DiLoCo workers: the cost of one worker's failure", columns, rows, notes,
                       {"args": vars(args), "runs": results})
    print(md.read_text())


if __name__ == "__main__":
    main()
