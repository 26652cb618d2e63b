"""The architecture's import rules (docs/architecture.md, "Layers"), read from the source with
``ast`` so that they stay true: no import cycle between files; the run never reaches up to the launcher,
the CLI or the planner; the planner never imports the trainer; no parallel strategy imports another; and
the modules a rank or the launcher imports before torch import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

RUN = ("meshtrain.train", "meshtrain.checkpoint", "meshtrain.parallel", "meshtrain.models", "meshtrain.data",
       "meshtrain.runtime", "meshtrain.optim", "meshtrain.metrics", "meshtrain.mesh", "meshtrain.preflight",
       "meshtrain.profiling", "meshtrain.runlock", "meshtrain.checkpoint.schema", "meshtrain.checkpoint.writer",
       "meshtrain.resolved")
"""The modules a rank runs: none may import the launcher, the CLI or the planner."""
UPPER = ("meshtrain.launch", "meshtrain.cli", "meshtrain.planner")
COMPOSERS = ("meshtrain.parallel", "meshtrain.parallel.compose")
"""The package (its names load lazily from compose) and the one module that may import every strategy."""
SHARED_PARALLEL = ("reduce", "rng", "model")
"""Modules of ``meshtrain.parallel`` every strategy may use: per-axis reductions, dropout streams, and the
trainer-facing model (which itself imports no strategy)."""


def module_files() -> dict[str, Path]:
    """``{"meshtrain.parallel.tensor": path, "meshtrain.parallel": path/__init__.py, ...}``."""
    files = {}
    for path in (SRC / "meshtrain").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Edges module -> meshtrain module it imports (anywhere in the file, function-level imports included)."""
    files = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            targets |= {t for n in names if n.startswith("meshtrain") and (t := resolve(n)) and t != module}
        graph[module] = targets
    return graph


def is_in(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), ignoring a package's ``__init__``
    importing its own submodules (pkg -> pkg.sub is no cycle between files)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if is_in(w, v):  # a package importing its own submodule
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def broken_rules(graph: dict[str, set[str]]) -> list[str]:
    broken = []
    for m, targets in graph.items():
        for t in targets:
            if is_in(m, *RUN) and is_in(t, *UPPER):
                broken.append(f"{m} -> {t}: the run reaches up to the launcher, CLI or planner")
            if is_in(t, "meshtrain.cli") and not is_in(m, "meshtrain.cli"):
                broken.append(f"{m} -> {t}: only the CLI imports the CLI (its modules are the commands, the top layer)")
            if is_in(m, "meshtrain.planner") and is_in(t, "meshtrain.train"):
                broken.append(f"{m} -> {t}: the planner imports the trainer")
            if is_in(m, "meshtrain.parallel") and is_in(t, "meshtrain.parallel") and m not in COMPOSERS:
                own, other = m.split(".")[2], t.split(".")[2] if t.count(".") >= 2 else ""
                if other and own != other and other not in SHARED_PARALLEL:
                    broken.append(f"{m} -> {t}: a strategy imports another (only meshtrain.parallel.compose composes them)")
    return broken


def test_no_import_cycle_between_files():
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == []


def test_architecture_rules_hold():
    assert broken_rules(import_graph()) == []


@pytest.mark.parametrize("edge, rule", [
    (("meshtrain.train.loop", "meshtrain.cli.train"), "reaches up"),
    (("meshtrain.parallel.tensor", "meshtrain.parallel.pipeline"), "a strategy imports another"),
    (("meshtrain.planner.cost", "meshtrain.train.loop"), "the planner imports the trainer"),
    (("meshtrain.launch.checks", "meshtrain.cli.plan"), "only the CLI imports the CLI"),
])
def test_the_rules_catch_a_violation(edge, rule):
    """Each rule fails on an edge that breaks it (so the tests above cannot pass vacuously)."""
    graph = import_graph()
    graph[edge[0]].add(edge[1])
    assert any(rule in line for line in broken_rules(graph))


def test_a_cycle_is_found():
    graph = import_graph()
    graph["meshtrain.config"].add("meshtrain.train.loop")  # the loop imports config
    assert cycles(graph)


@pytest.mark.parametrize("module", ["meshtrain.preflight", "meshtrain.train", "meshtrain.config",
                                    "meshtrain.rules.support", "meshtrain.cli.main", "meshtrain.runlock",
                                    "meshtrain.checkpoint", "meshtrain.checkpoint.schema", "meshtrain.models.registry", "meshtrain.axes",
                                    "meshtrain.rules.pipeline", "meshtrain.parallel.pipeline.balance",
                                    "meshtrain.resolved"])
def test_imported_before_torch_without_torch(module):
    """The launcher's checks and a rank's entry (``python -m meshtrain.train``, whose stop handler must be in
    place before torch takes seconds to import) load no torch."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
