"""How the code of ``src/meshtrain`` hangs together, measured with ``ast`` (stdlib only): the instrument of issue 53.

    python scripts/structure.py             # a short markdown table, then the lists behind it
    python scripts/structure.py --json      # the same as JSON
    python scripts/structure.py --no-help   # without the ``meshtrain --help`` subprocess (no import of meshtrain)

What it counts:

- modules: the ``.py`` files under ``src/meshtrain`` (a package's ``__init__.py`` is the package).
- imports: file -> file edges between meshtrain modules, each (importer, imported file) pair once, counted apart
  when the import statement is at module level (``if``/``try`` blocks and class bodies included) and when it is
  deferred (inside a function). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else
  to ``pkg``'s ``__init__``.
- deferred import statements: ``import``/``from ... import`` statements of meshtrain modules inside functions.
- upward imports: a room is a top-level entry of ``src/meshtrain`` (``config/``, ``models/``, ``fileio.py``, ...).
  Two rooms that import each other, directly or through others, are a cycle of the room graph, so one of the
  imports is a lower layer reaching up. Upward imports are the fewest file -> file imports (module-level and
  deferred alike) whose removal leaves the room graph without a cycle: within each strongly connected component
  the rooms are ordered bottom to top so that as few imports as possible point up, and those that do are listed,
  counted once per importing file and imported file.
- long functions: functions and methods of more than 60 lines, ``end_lineno - lineno + 1`` (the ``def`` line to
  the last line of the body, decorators not counted).
- module ``__getattr__`` (PEP 562 lazy names), ``importlib.import_module`` / ``__import__`` calls: imports no
  reader or tool can follow.
- ``ParallelConfig``'s fields, the lengths of ``Trainer.__init__`` and ``Trainer.run``.
- ``meshtrain --help``: a fresh interpreter imports ``meshtrain.cli.main`` and runs ``main(["--help"])``; the
  ``sys.modules`` entries then (meshtrain's and all), and whether torch was loaded.

On 1075298, the tree issue 53 measured, this gives its numbers: ``Trainer.run`` 91 lines, 4 upward imports, 131
deferred import statements, 68 meshtrain modules at ``--help`` (the issue: 69).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LONG = 60
"""A function of more lines than this is long (STYLE.md: functions of ~10-30 lines)."""


@dataclass(frozen=True)
class Edge:
    """One import of a meshtrain module by another: ``source`` imports ``name`` from file ``target``."""

    source: str
    target: str
    name: str
    line: int
    deferred: bool


def module_files(src: Path = SRC) -> dict[str, Path]:
    """``{"meshtrain.parallel.tensor": path, "meshtrain.parallel": path/__init__.py, ...}``."""
    files = {}
    for path in sorted((src / "meshtrain").rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        files[name.removesuffix(".__init__")] = path
    return files


def parse(files: dict[str, Path]) -> dict[str, ast.Module]:
    return {module: ast.parse(path.read_text(), str(path)) for module, path in files.items()}


def _walk(node: ast.AST, in_function: bool = False):
    """``(node, in_function)`` for every node under ``node``."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function
        yield from _walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _imported(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str]]:
    """``(dotted name, the name as written)`` of each name ``node`` imports, relative imports made absolute."""
    if isinstance(node, ast.Import):
        return [(alias.name, alias.name) for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [(f"{base}.{alias.name}", alias.name) for alias in node.names]


def import_edges(files: dict[str, Path], trees: dict[str, ast.Module]) -> list[Edge]:
    """Every import of a meshtrain module by another (:class:`Edge`), in file order."""

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for module, tree in trees.items():
        is_package = files[module].name == "__init__.py"
        for node, deferred in _walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dotted, written in _imported(module, is_package, node):
                target = resolve(dotted) if dotted.startswith("meshtrain") else None
                if target and target != module:
                    edges.append(Edge(module, target, written, node.lineno, deferred))
    return edges


def room(module: str) -> str:
    """``meshtrain.config.checks`` -> ``config``; ``meshtrain.fileio`` -> ``fileio``; the package -> ``meshtrain``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _bottom_up(rooms: list[str], weight: dict[tuple[str, str], int]) -> list[str]:
    """``rooms`` ordered bottom to top so that the fewest imports point up (an exact minimum feedback arc set over
    the orders, by dynamic programming over subsets; a component of more than 16 rooms is ordered greedily)."""
    n = len(rooms)
    if n > 16:
        return sorted(rooms, key=lambda r: -sum(w for (a, b), w in weight.items() if b == r))
    cost = {0: (0, ())}
    for mask in range(1 << n):
        if mask not in cost:
            continue
        so_far, order = cost[mask]
        for i in range(n):
            if mask & (1 << i):
                continue
            up = sum(weight.get((rooms[j], rooms[i]), 0) for j in range(n) if mask & (1 << j))
            new = (so_far + up, order + (i,))
            if mask | (1 << i) not in cost or new[0] < cost[mask | (1 << i)][0]:
                cost[mask | (1 << i)] = new
    return [rooms[i] for i in cost[(1 << n) - 1][1]]


def upward_imports(edges: list[Edge]) -> tuple[list[list[str]], list[Edge]]:
    """The room graph's cycles (each a list of rooms, bottom to top) and the imports that point up in them."""
    weight: dict[tuple[str, str], int] = {}
    for e in edges:
        a, b = room(e.source), room(e.target)
        if a != b:
            weight[a, b] = weight.get((a, b), 0) + 1
    graph: dict[str, set[str]] = {}
    for a, b in weight:
        graph.setdefault(a, set()).add(b)
    cycles, upward = [], []
    for rooms in components(graph):
        order = _bottom_up(rooms, weight)
        height = {r: i for i, r in enumerate(order)}
        cycles.append(order)
        upward += [e for e in edges if room(e.source) in height and room(e.target) in height
                   and height[room(e.source)] < height[room(e.target)]]
    return cycles, upward


def upward_pairs(upward: list[Edge]) -> list[str]:
    """One line per importing and imported file: ``"meshtrain.fileio -> meshtrain.config (ConfigError, line 14)"``."""
    names: dict[tuple[str, str], list[str]] = {}
    for e in upward:
        names.setdefault((e.source, e.target), []).append(f"{e.name}, line {e.line}{' deferred' if e.deferred else ''}")
    return [f"{a} -> {b} ({'; '.join(n)})" for (a, b), n in names.items()]


def deferred_statements(trees: dict[str, ast.Module]) -> int:
    """Import statements inside functions that import a meshtrain module (relative ones included)."""
    count = 0
    for tree in trees.values():
        for node, deferred in _walk(tree):
            if deferred and isinstance(node, ast.ImportFrom):
                count += bool(node.level) or (node.module or "").startswith("meshtrain")
            elif deferred and isinstance(node, ast.Import):
                count += any(alias.name.startswith("meshtrain") for alias in node.names)
    return count


def functions(trees: dict[str, ast.Module]) -> dict[str, int]:
    """``{"meshtrain.train.loop:Trainer.run": lines, ...}`` for every function and method."""
    out = {}

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{module}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")
            else:
                visit(child, module, prefix)

    for module, tree in trees.items():
        visit(tree, module, "")
    return out


def module_getattrs(trees: dict[str, ast.Module]) -> list[str]:
    """Modules that define ``__getattr__`` at module level (PEP 562 names no reader can follow)."""
    return [m for m, tree in trees.items()
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)]


def dynamic_imports(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line`` of every ``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)`` call."""
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("import_module", "__import__"):
                    found.append(f"{module}:{node.lineno}")
    return found


def parallel_config_fields(trees: dict[str, ast.Module]) -> int:
    """``ParallelConfig``'s fields: its own annotated ones, plus one degree per row of ``AXIS_TABLE`` (its base
    ``ParallelDegrees`` is made from that table by ``axes.degrees_dataclass``)."""
    own = next(n for n in ast.walk(trees["meshtrain.config.sections"])
               if isinstance(n, ast.ClassDef) and n.name == "ParallelConfig")
    fields = sum(isinstance(s, ast.AnnAssign) and "ClassVar" not in ast.unparse(s.annotation) for s in own.body)
    table = next(n.value for n in trees["meshtrain.axes"].body
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "AXIS_TABLE")
    return fields + len(table.elts)


HELP = """
import contextlib, io, sys
from meshtrain.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(["--help"])
    except SystemExit:
        pass
ours = sorted(m for m in sys.modules if m == "meshtrain" or m.startswith("meshtrain."))
print(len(ours), len(sys.modules), "torch" in sys.modules, " ".join(ours))
"""


def help_modules() -> dict[str, object]:
    """What a fresh ``meshtrain --help`` loads."""
    out = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)}, cwd=ROOT)
    ours, total, torch, *names = out.stdout.split()
    return {"meshtrain": int(ours), "total": int(total), "torch": torch == "True", "modules": names}


def measure(src: Path = SRC, run_help: bool = True) -> dict[str, object]:
    """Every number of the table, and the lists behind it."""
    files = module_files(src)
    trees = parse(files)
    edges = import_edges(files, trees)
    pairs = {(e.source, e.target, e.deferred) for e in edges}
    cycles, upward = upward_imports(edges)
    lengths = functions(trees)
    long = sorted(((name, n) for name, n in lengths.items() if n > LONG), key=lambda item: -item[1])
    return {
        "modules": len(files),
        "imports_module_level": sum(not d for _, _, d in pairs),
        "imports_deferred": sum(d for _, _, d in pairs),
        "room_cycles": cycles,
        "deferred_import_statements": deferred_statements(trees),
        "upward_imports": upward_pairs(upward),
        "long_functions": [f"{name} {n}" for name, n in long],
        "module_getattr": module_getattrs(trees),
        "dynamic_imports": dynamic_imports(trees),
        "parallel_config_fields": parallel_config_fields(trees),
        "trainer_init_lines": lengths.get("meshtrain.train.loop:Trainer.__init__"),
        "trainer_run_lines": lengths.get("meshtrain.train.loop:Trainer.run"),
        "help": help_modules() if run_help else None,
    }


def markdown(m: dict[str, object]) -> str:
    rows = [
        ("modules", m["modules"]),
        ("imports file -> file, module level", m["imports_module_level"]),
        ("imports file -> file, deferred (inside functions)", m["imports_deferred"]),
        ("import statements inside functions (of meshtrain modules)", m["deferred_import_statements"]),
        ("upward imports (room level, importing file -> imported file)", len(m["upward_imports"])),
        (f"functions over {LONG} lines", len(m["long_functions"])),
        ("module-level `__getattr__`", len(m["module_getattr"])),
        ("`import_module` / `__import__` calls", len(m["dynamic_imports"])),
        ("`ParallelConfig` fields", m["parallel_config_fields"]),
        ("`Trainer.__init__` / `Trainer.run` lines", f"{m['trainer_init_lines']} / {m['trainer_run_lines']}"),
    ]
    if m["help"]:
        h = m["help"]
        rows.append(("modules loaded at `meshtrain --help` (meshtrain / all)", f"{h['meshtrain']} / {h['total']}"))
        rows.append(("torch loaded at `meshtrain --help`", "yes" if h["torch"] else "no"))
    lines = ["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    lists = [("room cycles (bottom to top)", [" -> ".join(c) for c in m["room_cycles"]]),
             ("upward imports", m["upward_imports"]), (f"functions over {LONG} lines", m["long_functions"]),
             ("module-level __getattr__", m["module_getattr"]), ("import_module / __import__", m["dynamic_imports"])]
    for title, items in lists:
        if items:
            lines += [f"{title}:", *(f"- {item}" for item in items), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the numbers and lists as JSON")
    parser.add_argument("--no-help", action="store_true", help="skip the `meshtrain --help` subprocess")
    args = parser.parse_args(argv)
    m = measure(run_help=not args.no_help)
    print(json.dumps(m, indent=1) if args.json else markdown(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
