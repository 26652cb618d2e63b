"""Every cheap example command in the README, docs/ and ``meshtrain plan --help`` runs (issue 25, Sec. 4).

The examples are extracted, not listed: every line of a fenced code block (or of the plan command's epilog)
that starts with ``meshtrain plan`` or ``meshtrain batch`` (a leading ``$`` prompt and a trailing ``# comment``
dropped), run in this process through the CLI's ``main``. Lines that are synopses rather than commands (with
``[``, ``...`` or an upper-case placeholder) and those that write files or take minutes (``--calibrate``,
``--plot``) are left out; what is left out is counted, so a doc that turns every example into a synopsis fails.
Also: every relative link in the README and docs/ points to a file of the repository.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from meshtrain.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = ("--calibrate", "--plot")
"""Examples that write a file or measure the machine for a minute: not run here."""


def _commands(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ").strip()
        if re.match(r"meshtrain (plan|batch)\b", line):
            out.append(re.split(r"\s{2,}[#(]|\s+# ", line)[0].strip())
    return out


def _fenced(path: Path) -> str:
    return "\n".join(re.findall(r"```[^\n]*\n(.*?)```", path.read_text(), flags=re.S))


def examples() -> list[tuple[str, str]]:
    """(where, command) of every example, docs first, then the plan command's epilog."""
    from meshtrain.cli.plan import EPILOG

    found = [(p.relative_to(ROOT).as_posix(), c) for p in DOCS for c in _commands(_fenced(p))]
    found += [("meshtrain plan --help", c) for c in _commands(EPILOG)]
    return found


def runnable(command: str) -> bool:
    synopsis = "[" in command or "..." in command or re.search(r"\b[A-Z]{2,}\b", command.replace("H100", ""))
    return not synopsis and not any(flag in command for flag in SKIP)


def test_most_examples_are_runnable():
    found = examples()
    ran = [c for _, c in found if runnable(c)]
    assert len(found) >= 15 and len(ran) >= 0.6 * len(found), [c for _, c in found if not runnable(c)]


def heavy(command: str) -> bool:
    """Examples that take more than a few seconds here: the validation of every published run, and searches
    over thousands of devices (`make test-slow` runs them)."""
    gpus = re.search(r"--num-gpus (\d+)", command)
    return "--validate" in command or (gpus is not None and int(gpus.group(1)) > 1024)


@pytest.mark.parametrize("where, command", [
    pytest.param(w, c, marks=[pytest.mark.slow] if heavy(c) else [], id=f"{w}: {c[:70]}")
    for w, c in examples() if runnable(c)])
def test_example_runs(where, command, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples' paths are the repository's
    argv = shlex.split(command)[1:]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, f"{where}: `{command}` exited {code}: {out.err.strip()[-500:]}"
    assert out.out.strip(), f"{where}: `{command}` printed nothing"


def test_relative_links_point_into_the_repository():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists() or ROOT not in resolved.parents:
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken
