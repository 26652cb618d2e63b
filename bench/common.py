"""What every benchmark shares: the machine header and writing ``bench/results/<name>.md`` + ``.json``.

Results are tables of numbers measured side by side in one run, with the machine they came from;
ratios between rows are meaningful, absolute numbers only on that machine.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"


def meshtrain_command() -> list[str]:
    """The installed console script next to this interpreter, or ``python -m meshtrain.cli``."""
    script = Path(sys.executable).with_name("meshtrain")
    return [str(script)] if script.exists() else [sys.executable, "-m", "meshtrain.cli"]


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+uncommitted" if dirty else "")


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken."""
    import torch

    return {"date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(), "git": _git_revision()}


def write_results(name: str, title: str, columns: list[str], rows: list[list[Any]], notes: list[str],
                  data: dict[str, Any]) -> Path:
    """Write ``results/<name>.md`` (header, table, notes) and ``results/<name>.json``; return the .md path."""
    m = machine()
    lines = [f"# {title}", "",
             f"{m['date']} · {m['cpu_count']} CPUs ({m['cpu']}, {m['os']}) · torch {m['torch']} · "
             f"CUDA {'yes' if m['cuda'] else 'no'} · python {m['python']} · git {m['git']}", "",
             "| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    lines += [""] + [f"- {note}" for note in notes]
    RESULTS_DIR.mkdir(exist_ok=True)
    md = RESULTS_DIR / f"{name}.md"
    _atomic_write(md, "\n".join(lines) + "\n")
    _atomic_write(RESULTS_DIR / f"{name}.json", json.dumps({"machine": m, **data}, indent=2) + "\n")
    return md


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


BENCHMARKS_DOC = REPO / "docs" / "benchmarks.md"


def update_benchmarks_doc(name: str) -> None:
    """Copy ``results/<name>.md`` (without its title) into docs/benchmarks.md between the markers
    ``<!-- results:<name> -->`` and ``<!-- /results:<name> -->``; the prose around them is hand-written."""
    start, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    doc = BENCHMARKS_DOC.read_text()
    if start not in doc or end not in doc:
        return
    table = (RESULTS_DIR / f"{name}.md").read_text().split("\n", 2)[2].strip()
    head, rest = doc.split(start, 1)
    _atomic_write(BENCHMARKS_DOC, f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")
