"""Search time of ``meshtrain plan``: the whole command line, as a user runs it, for jobs up to Llama 3
405B on 16,384 GPUs.

    python bench/bench_planner.py [--repeats 3]      # ~20 s

Each job is one real command line ``meshtrain plan --model M --gpu H100-SXM-80GB --num-gpus N
--global-batch-size B --seq-len S --top 1 --json``, timed end to end (interpreter start-up included), and the
same search timed in-process (``meshtrain.planner.search.search``). Writes ``bench/results/planner.md``
and ``planner.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, meshtrain_command, write_results  # noqa: E402

JOBS = [  # (model, num_gpus, global_batch_size, seq_len)
    ("llama3-8b", 64, 512, 8192),
    ("llama3-70b", 512, 1024, 8192),
    ("llama3-405b", 16384, 2048, 8192),
]


def time_cli(model: str, gpus: int, gbs: int, seq: int) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds) of one ``meshtrain plan ... --json`` and its best layout. The CPU time (user +
    system of the child) does not grow when other processes share the cores; the wall time does."""
    cmd = [*meshtrain_command(), "plan", "--model", model, "--gpu", "H100-SXM-80GB", "--num-gpus", str(gpus),
           "--global-batch-size", str(gbs), "--seq-len", str(seq), "--top", "1", "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, json.loads(proc.stdout)[0]


def time_search(model: str, gpus: int, gbs: int, seq: int, top: int | None = 1) -> tuple[float, int, int]:
    """CPU seconds of the in-process search (``top`` as the command's ``--top 1``; None: every layout predicted in
    full), the number of layouts that fit, and the number it predicted in full."""
    from dataclasses import replace

    from meshtrain.planner.estimate import Job
    from meshtrain.planner.hardware import get_hardware
    from meshtrain.planner.layout import FRAMEWORKS
    from meshtrain.planner.memory import PRECISIONS
    from meshtrain.planner.model_specs import preset
    from meshtrain.planner.search import search

    m = replace(preset(model), seq_len=seq)
    t0 = time.process_time()
    ranked = search(m, get_hardware("H100-SXM-80GB"), PRECISIONS["bf16"], FRAMEWORKS["meshtrain"], Job(gpus, gbs),
                    top=top)
    return time.process_time() - t0, ranked.count, len(ranked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, data = [], []
    for model, gpus, gbs, seq in JOBS:
        cli = [time_cli(model, gpus, gbs, seq) for _ in range(args.repeats)]
        inproc = [time_search(model, gpus, gbs, seq) for _ in range(args.repeats)]
        whole = [time_search(model, gpus, gbs, seq, None) for _ in range(args.repeats)]
        best = cli[0][2]
        record = {"model": model, "num_gpus": gpus, "global_batch_size": gbs, "seq_len": seq,
                  "cli_s": [c[0] for c in cli], "cli_cpu_s": [c[1] for c in cli], "search_cpu_s": [s[0] for s in inproc],
                  "whole_search_cpu_s": [s[0] for s in whole], "layouts": inproc[0][1], "predicted": inproc[0][2],
                  "best": best}
        data.append(record)
        label = (f"dp{best['dp']} tp{best['tp']} pp{best['pp']} sp{best['sp']} z{best['zero_stage']} "
                 f"mbs{best['micro_batch_size']} ga{best['gradient_accumulation_steps']}")
        rows.append([model, f"{gpus:,}", gbs, seq, f"{record['layouts']:,}", f"{record['predicted']:,}",
                     f"{statistics.median(record['whole_search_cpu_s']):.2f}",
                     f"{statistics.median(record['search_cpu_s']):.2f}",
                     f"{statistics.median(record['cli_cpu_s']):.2f}",
                     f"{statistics.median(record['cli_s']):.2f} ({', '.join(f'{t:.2f}' for t in record['cli_s'])})",
                     label, f"{best['mfu']:.1%}"])
    path = write_results("planner", "meshtrain plan: search time", [
        "model", "GPUs", "global batch", "seq_len", "layouts that fit", "predicted in full (top 1)",
        "search CPU s, every layout in full (median)", "search CPU s, top 1 (median)",
        "whole CLI CPU s (median)", "whole CLI wall s (median; each run)", "best layout", "MFU"], rows,
        ["`whole CLI` is the command line including interpreter start-up and imports; `search` is the "
         "enumeration, memory check and ranking alone, in-process (``search.search``): with ``top=1`` as the command "
         "calls it (a layout is predicted in full only when its lower bound, the micro-batches' compute and "
         "communication plus the bubble, could reach the best step time), and with every layout predicted. CPU "
         "seconds (user + system) are what the machine spends whatever else runs on it; the wall time grows when "
         "other processes share the 2 cores.",
         "layouts that fit: every valid layout that fits, each with the cheapest recompute mode that fits, but the "
         "dominated ones the search skips (``search``'s docstring: ZeRO-3 where ZeRO-2 fits in the same mode, tp "
         "without sequence parallelism where it is possible); degrees whose model states alone do not fit are never "
         "generated."], {"jobs": data})
    print(path.read_text())


if __name__ == "__main__":
    main()
