"""The architecture's import rules (docs/architecture.md, "Layers"), read from the source with
``ast`` so that they stay true: no import cycle between files and no upward import between rooms; the run never
reaches up to the launcher, the CLI or the planner; the planner never imports the trainer; no parallel strategy
imports another; every import can be followed (no module-level ``__getattr__``); no function over 60 lines but the
pending ones; and the modules a rank or the launcher imports before torch, and ``meshtrain --help``, import no
torch. The measurements are ``scripts/structure.py``'s (the instrument of issue 53)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(ROOT / "scripts"))
import structure  # noqa: E402  (scripts/structure.py)

RUN = ("meshtrain.train", "meshtrain.checkpoint", "meshtrain.parallel", "meshtrain.models", "meshtrain.data",
       "meshtrain.runtime", "meshtrain.optim", "meshtrain.metrics", "meshtrain.mesh", "meshtrain.preflight",
       "meshtrain.profiling", "meshtrain.runlock", "meshtrain.checkpoint.schema", "meshtrain.checkpoint.writer",
       "meshtrain.resolved")
"""The modules a rank runs: none may import the launcher, the CLI or the planner."""
UPPER = ("meshtrain.launch", "meshtrain.cli", "meshtrain.planner")
COMPOSERS = ("meshtrain.parallel.compose",)
"""The one module that may import every strategy."""
SHARED_PARALLEL = ("reduce", "rng")
"""Modules of ``meshtrain.parallel`` every strategy may use: per-axis reductions and dropout streams. The sync modes'
hooks (DiLoCo subclasses them) live outside ``parallel/``, in ``meshtrain.sync_mode``."""


PENDING_LONG: set[str] = set()
"""Functions still over :data:`structure.LONG` lines (none: a new one is split, or named here with its issue)."""


def module_files() -> dict[str, Path]:
    """``{"meshtrain.parallel.tensor": path, "meshtrain.parallel": path/__init__.py, ...}``."""
    return structure.module_files(SRC)


def import_graph() -> dict[str, set[str]]:
    """Edges module -> meshtrain module it imports (anywhere in the file, function-level imports included): a fresh
    copy, which a test may add edges to, of the graph read once (:func:`_read_import_graph`)."""
    return {module: set(targets) for module, targets in _read_import_graph().items()}


@functools.cache
def _read_import_graph() -> dict[str, set[str]]:
    """:func:`import_graph`, read from the source: each read parses every file (seconds), six tests ask for it."""
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
    """Strongly connected components of more than one file, ignoring a package's ``__init__`` importing its own
    submodules (pkg -> pkg.sub is no cycle between files)."""
    return structure.components({v: {w for w in targets if not is_in(w, v)} for v, targets in graph.items()})


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
    graph["meshtrain.config.sections"].add("meshtrain.train.loop")  # the loop imports config.sections
    assert cycles(graph)


@pytest.mark.parametrize("module", ["meshtrain.preflight", "meshtrain.train", "meshtrain.config", "meshtrain.parallel",
                                    "meshtrain.parallel.pipeline", "meshtrain.models", "meshtrain.rules.layout",
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


@functools.cache
def parsed() -> tuple[dict[str, Path], dict[str, ast.Module]]:
    """The source files and their syntax trees, parsed once for the tests below (which only read them)."""
    files = module_files()
    return files, structure.parse(files)


def test_no_upward_import_between_rooms():
    """No room (``config/``, ``models/``, ``fileio.py``, ...) imports one that imports it back, deferred imports
    included: the rooms form the layers of docs/architecture.md."""
    files, trees = parsed()
    room_cycles, upward = structure.upward_imports(structure.import_edges(files, trees))
    assert structure.upward_pairs(upward) == [] and room_cycles == []


def test_an_upward_import_is_found():
    files, trees = parsed()
    edges = structure.import_edges(files, trees)
    edges.append(structure.Edge("meshtrain.errors", "meshtrain.config.load", "load_config", 1, True))
    assert structure.upward_pairs(structure.upward_imports(edges)[1]) == [
        "meshtrain.errors -> meshtrain.config.load (load_config, line 1 deferred)"]


def test_every_import_can_be_followed():
    """No module-level ``__getattr__`` (PEP 562 names that go-to-definition and import greps cannot follow) and no
    import by a computed name, but the planner's calibration loading the trainer's modules by name to measure them."""
    _, trees = parsed()
    assert structure.module_getattrs(trees) == []
    assert [where.split(":")[0] for where in structure.dynamic_imports(trees)] == ["meshtrain.planner.calibrate"]


def test_no_function_over_60_lines_but_the_pending_ones():
    _, trees = parsed()
    long = {name for name, lines in structure.functions(trees).items() if lines > structure.LONG}
    assert sorted(long - PENDING_LONG) == [], "split it into named steps (STYLE.md: functions of ~10-30 lines)"
    assert sorted(PENDING_LONG - long) == [], "no longer over the limit: remove it from PENDING_LONG"


def test_every_family_model_is_a_plain_import():
    """``models/build.py`` imports the class each family's spec names (``Family.model``) with a plain import."""
    from meshtrain.models.registry import FAMILIES

    tree = ast.parse((SRC / "meshtrain" / "models" / "build.py").read_text())
    imported = {f"{node.module}:{alias.name}" for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert sorted({f.model for f in FAMILIES.values()} - imported) == []


def test_help_loads_no_torch_and_no_subcommand():
    """``meshtrain --help`` lists the subcommands without importing them, and loads no torch."""
    loaded = structure.help_modules()
    assert loaded["torch"] is False
    assert [m for m in loaded["modules"] if m.startswith("meshtrain.cli.")] == ["meshtrain.cli.main"]
