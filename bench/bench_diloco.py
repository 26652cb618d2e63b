"""DiLoCo against DDP, the hierarchical all-reduce and local SGD across two hosts joined by a slow real link.

    sudo python bench/bench_diloco.py [--steps 600] [--seeds 1337 1 2] [--rate 100mbit --delay 10ms]

Two hosts on this machine (``tests/netns.py``: two network namespaces), joined by a veth pair shaped with ``tc netem``
on both ends (``--rate`` each way, ``--delay`` one way), or where the kernel has no netem by ``tests/linkem.py``'s
link emulated in user space with the same rate and delay; 2 ranks per host (4 in all, dp = 4),
``GLOO_SOCKET_IFNAME`` on the pair. The main job's GPT (``configs/shakespeare_char.toml``, micro-batch 12, the
same learning rate and schedule) in every mode:

- DDP: gradients all-reduced over the 4 ranks every step (a flat ring that crosses the link);
- hierarchical: reduce inside each host, all-reduce between the hosts, broadcast;
- local SGD H = 8: parameters averaged every 8 steps;
- DiLoCo H = 8 and H = 32: each host one worker (DDP inside it), outer Nesterov SGD (lr 0.7, momentum 0.9);
- Streaming DiLoCo H = 32: F = 4 fragments (one block each, the first with the embeddings), tau = 1, alpha = 0.5.

DDP and the hierarchical all-reduce train ``--steps`` steps; the others ``--low-comm-factor`` times as many (their
steps are cheap; more of them is how a low-communication method buys back quality). Val loss every
``--eval-every`` steps with its wall time (``elapsed_s``, evaluations included), the bytes that crossed the link
(the link devices' tx counters, both directions). Reports per mode over seeds: the wall time to reach DDP's final
val loss within 2% (that seed's DDP run), the val loss at the wall time of the fastest run's end, the final val
loss, and bytes per step. Writes ``bench/results/diloco.md``/``.json`` and ``docs/diloco.png``.

Needs root (network namespaces, ``tc``); ~40 min at the defaults on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import REPO, machine, write_results  # noqa: E402
from netns import EMULATED_MTU, IFNAME, Host, link_bytes, two_hosts  # noqa: E402

CONFIG = "configs/shakespeare_char.toml"
PORT = 29500
TARGET = 1.02
"""A mode reaches DDP's val loss when its own is at most 2% above that seed's DDP final val loss."""
DILOCO = {"parallel.sync_mode": "diloco", "diloco.outer_lr": "0.7", "diloco.outer_momentum": "0.9"}
MODES = {  # name: (overrides, low-communication: runs --low-comm-factor times the steps)
    "DDP": ({}, False),
    "hierarchical all-reduce": ({"parallel.hierarchical_allreduce": "true"}, False),
    "local SGD H=8": ({"parallel.sync_mode": "local-sgd", "local_sgd.steps": "8"}, True),
    "DiLoCo H=8": ({**DILOCO, "diloco.inner_steps": "8"}, True),
    "DiLoCo H=32": ({**DILOCO, "diloco.inner_steps": "32"}, True),
    "Streaming DiLoCo H=32 F=4 tau=1": ({**DILOCO, "diloco.inner_steps": "32", "diloco.fragments": "4",
                                         "diloco.delay": "1", "diloco.alpha": "0.5"}, True),
}


def netem(pair: list[Host], rate: str, delay: str) -> str:
    """Shape the veth pair's end in each namespace with ``tc netem rate RATE delay DELAY`` (each way; the delay one
    way). Returns "" when it did, else tc's error (a kernel without ``sch_netem``)."""
    errors = [subprocess.run(["ip", "netns", "exec", host.ns, "tc", "qdisc", "replace", "dev", IFNAME, "root", "netem",
                              "rate", rate, "delay", delay, "limit", "100000"], capture_output=True, text=True
                             ).stderr.strip() for host in pair]
    return next((e for e in errors if e), "")


@contextlib.contextmanager
def shaped_hosts(tag: str, rate: str, delay: str):
    """Two hosts joined by a link of ``rate`` each way and ``delay`` one way: a veth pair under ``tc netem``, or where
    the kernel has no netem, ``tests/linkem.py``'s user-space link (the same rate and delay, MTU 9,000). Yields the
    hosts and a sentence saying which, for the notes."""
    with contextlib.ExitStack() as stack:
        pair = stack.enter_context(two_hosts(tag))
        error = netem(pair, rate, delay)
        if not error:
            yield pair, f"a veth pair under tc netem rate {rate} delay {delay}"
            return
        stack.close()
        pair = stack.enter_context(two_hosts(tag, emulate=(rate, delay)))
        yield pair, (f"a link emulated in user space (tests/linkem.py: two TUN devices, rate {rate} each way, "
                     f"delay {delay} one way, MTU {EMULATED_MTU}; tc netem failed here: {error})")


def train(pair: list[Host], overrides: dict[str, str], out: Path, log: Path) -> None:
    """``meshtrain train`` on both hosts, 2 ranks each, node 0 hosting the rendezvous."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": IFNAME}
    nodes = []
    for rank, host in enumerate(pair):
        argv = host.run(sys.executable, "-m", "meshtrain.cli", "train", CONFIG, "--nproc", "2", "--nnodes", "2",
                        "--node-rank", str(rank), "--rdzv-endpoint", f"{pair[0].addr}:{PORT}", "--out", str(out),
                        *[t for k, v in overrides.items() for t in (f"--{k}", v)])
        with open(f"{log}.node{rank}", "w") as sink:
            nodes.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT))
    for rank, node in enumerate(nodes):
        if node.wait(timeout=7200):
            raise SystemExit(f"node {rank} failed:\n{Path(f'{log}.node{rank}').read_text()[-4000:]}")


def run_mode(pair: list[Host], name: str, overrides: dict[str, str], steps: int, seed: int, eval_every: int,
             tmp: Path) -> dict:
    args = {**overrides, "train.steps": str(steps), "train.seed": str(seed), "batch.micro_batch_size": "12",
            "train.eval_interval": str(eval_every), "train.log_interval": "10", "train.dtype": "float32",
            "checkpoint.interval": "0", "checkpoint.keep": "1", "train.check_memory": "false"}
    out = tmp / f"{name.replace(' ', '_')}-{seed}"
    before = link_bytes(pair)
    start = time.perf_counter()
    train(pair, args, out, tmp / f"log-{out.name}")
    wall = time.perf_counter() - start
    sent = link_bytes(pair) - before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [{"step": r["step"], "val_loss": r["val_loss"], "elapsed_s": r["elapsed_s"]} for r in records
             if "val_loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {"name": name, "seed": seed, "steps": steps, "evals": evals, "wall_s": wall, "link_bytes": sent,
            "link_bytes_per_step": sent / steps, "step_time_s": summary.get("step_time_s"),
            "diloco": summary.get("diloco")}


def time_to(evals: list[dict], target: float) -> float | None:
    """The wall time of the first evaluation at or below ``target``, or None."""
    return next((e["elapsed_s"] for e in evals if e["val_loss"] <= target), None)


def loss_at(evals: list[dict], t: float) -> float:
    """Val loss at wall time ``t``: the last evaluation at or before it (the start's loss is not logged: the first)."""
    seen = [e for e in evals if e["elapsed_s"] <= t]
    return (seen[-1] if seen else evals[0])["val_loss"]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = dict(zip(MODES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for r in results:
        for ax, key in zip(axes, ("step", "elapsed_s")):
            ax.plot([e[key] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], color=colours[r["name"]],
                    marker="o", markersize=2, alpha=0.8, label=r["name"] if r["seed"] == results[0]["seed"] else None)
    axes[0].set_xlabel("step (inner steps for local SGD and DiLoCo)")
    axes[1].set_xlabel("wall time (s, evaluations included)")
    axes[0].set_ylabel("val loss (nats/char)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Two hosts over a shaped link: DDP, hierarchical all-reduce, local SGD and DiLoCo (every seed)")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def summarize(results: list[dict], seeds: list[int]) -> list[list]:
    ddp = {r["seed"]: r for r in results if r["name"] == "DDP"}
    horizon = min(r["evals"][-1]["elapsed_s"] for r in results)
    rows = []
    for name in MODES:
        runs = [r for r in results if r["name"] == name]
        if not runs:
            continue
        targets = [TARGET * ddp[r["seed"]]["evals"][-1]["val_loss"] for r in runs]
        times = [time_to(r["evals"], target) for r, target in zip(runs, targets)]
        ddp_times = [ddp[r["seed"]]["evals"][-1]["elapsed_s"] for r in runs]
        ddp_band = [time_to(ddp[r["seed"]]["evals"], target) for r, target in zip(runs, targets)]
        reached = [t for t in times if t is not None]
        speedup = [d / t for t, d in zip(times, ddp_times) if t is not None]
        band = [d / t for t, d in zip(times, ddp_band) if t is not None]
        mean_sd = lambda xs, f: (f"{f(statistics.mean(xs))} ± {f(statistics.stdev(xs))}" if len(xs) > 1  # noqa: E731
                                 else f(xs[0]) if xs else "-")
        rows.append([name, runs[0]["steps"], f"{len(reached)}/{len(runs)}",
                     mean_sd(reached, lambda x: f"{x:.0f}"), mean_sd(speedup, lambda x: f"{x:.1f}x"),
                     mean_sd(band, lambda x: f"{x:.1f}x"),
                     mean_sd([loss_at(r["evals"], horizon) for r in runs], lambda x: f"{x:.4f}"),
                     mean_sd([r["evals"][-1]["val_loss"] for r in runs], lambda x: f"{x:.4f}"),
                     mean_sd([r["evals"][-1]["elapsed_s"] for r in runs], lambda x: f"{x:.0f}"),
                     mean_sd([r["link_bytes_per_step"] / 1e6 for r in runs], lambda x: f"{x:.2f}")])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="DDP's and the hierarchical all-reduce's steps")
    parser.add_argument("--low-comm-factor", type=float, default=1.5, help="local SGD's and DiLoCo's steps / --steps")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--delay", default="10ms")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--table-only", action="store_true",
                        help="rewrite the table and plot from bench/results/diloco.json, running nothing")
    args = parser.parse_args()
    if args.table_only:
        saved = json.loads((REPO / "bench" / "results" / "diloco.json").read_text())
        report(saved["runs"], argparse.Namespace(**saved["args"]), saved["shaping"], saved["measured"])
        return
    results = []
    with shaped_hosts(f"dl{os.getpid() % 10000}", args.rate, args.delay) as (pair, shaping), \
            tempfile.TemporaryDirectory(prefix="meshtrain-diloco-") as tmp:
        for seed in args.seeds:
            for name in args.modes:
                overrides, low_comm = MODES[name]
                steps = int(args.steps * args.low_comm_factor) if low_comm else args.steps
                results.append(run_mode(pair, name, overrides, steps, seed, args.eval_every, Path(tmp)))
                r = results[-1]
                print(f"{name} seed {seed}: val {r['evals'][-1]['val_loss']:.4f} at {r['evals'][-1]['elapsed_s']:.0f} s, "
                      f"{r['link_bytes_per_step'] / 1e6:.2f} MB/step", flush=True)
    report(results, args, shaping)


def report(results: list[dict], args: argparse.Namespace, shaping: str, measured: str = "") -> None:
    """The table (``bench/results/diloco.md``/``.json``) and the plot (``docs/diloco.png``) of ``results``;
    ``measured``: when and at which revision the runs were taken (default: now, this one)."""
    if not measured:
        m = machine()
        measured = f"Runs measured at git {m['git']}, {m['date']}."
    plot(results, REPO / "docs" / "diloco.png")
    rows = summarize(results, args.seeds)
    notes = [f"Two network-namespace hosts on this machine, 2 ranks each (4 processes on its cores), joined by "
             f"{shaping}. The main job's GPT, fp32, "
             f"micro-batch 12 per rank, global batch 48 per (inner) step, lr 1e-3 with its warmup and cosine decay.",
             f"Seeds {', '.join(map(str, args.seeds))}; mean ± standard deviation over seeds. 'reached': runs whose val "
             f"loss came within 2% of that seed's DDP final val loss; 'time to DDP's loss' and 'speed-up' (DDP's "
             f"total wall time, when it reached that loss, / that time) over those runs; 'vs DDP at the same band': "
             f"DDP's own time to come within the same 2% / that time.",
             "'val loss at equal wall time': each run's last evaluation before the fastest run's end. Wall times "
             "include evaluations (every run evaluates at the same steps).",
             "link MB / step: bytes the link carried (both directions, every protocol) / steps.",
             "Plot: docs/diloco.png.", measured,
             f"Command: python bench/bench_diloco.py --steps {args.steps} --low-comm-factor {args.low_comm_factor} "
             f"--seeds {' '.join(map(str, args.seeds))} --rate {args.rate} --delay {args.delay}"]
    path = write_results("diloco", "DiLoCo across a slow link: time to DDP's val loss",
                         ["mode", "steps", "reached", "time to DDP's loss (s)", "speed-up vs DDP",
                          "vs DDP at the same band",
                          "val loss at equal wall time", "final val loss", "wall s", "link MB / step"],
                         rows, notes, {"runs": results, "args": vars(args), "shaping": shaping, "measured": measured})
    print(path.read_text())


if __name__ == "__main__":
    main()
