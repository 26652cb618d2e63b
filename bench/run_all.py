"""Run every ``bench/bench_*.py`` one after another; each writes ``bench/results/<name>.md`` and ``.json``.

    python bench/run_all.py            # all benchmarks
    python bench/run_all.py train      # only those whose name contains "train"

Benchmarks run one at a time so they never compete for the cores. Exit status 1 if any failed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
LARGE = ["--model.n_layer", "6", "--model.n_head", "6", "--model.n_embd", "384", "--model.block_size", "256"]
RUNS = {"bench_contenders.py": [[], ["--large"]], "bench_cuda.py": [[], ["--job", "main-job"], ["--job", "mixtral"]],
        "bench_profile.py": [[], ["--name", "profile_large", "--steps", "5", *LARGE]]}
"""Scripts run more than once, with these arguments each time (the others once, with none)."""


def main(argv: list[str]) -> int:
    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if argv:
        scripts = [s for s in scripts if any(pattern in s.stem for pattern in argv)]
    if not scripts:
        print(f"no bench/bench_*.py matches {argv}", file=sys.stderr)
        return 1
    failed = []
    for script in scripts:
        for extra in RUNS.get(script.name, [[]]):
            label = " ".join([script.name, *extra])
            print(f"== {label}", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, str(script), *extra], cwd=BENCH_DIR.parent).returncode
            print(f"== {label}: {'ok' if rc == 0 else f'failed (exit {rc})'} in {time.perf_counter() - t0:.0f} s",
                  flush=True)
            if rc:
                failed.append(label)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
