"""Measure the shape of the code from its imports: levels, module-to-module imports, cycles,
imports that point up a layer, the longest functions and classes (in statements) and the
functions with the most parameters.

    python tools/import_graph.py [--json]

The import graph comes from grimp (the library behind import-linter; a development
dependency), without the imports under ``if TYPE_CHECKING:`` (they never run). Cycles are the
strongly connected components of that graph (scipy); a level is a module's longest import chain
down to a module that imports nothing of ours, counted on the graph of components. The layers are
the ones `pyproject.toml` declares to import-linter, lowest first.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("autosearch", "cost_models", "search_spaces")
# Lowest first; a module belongs to the first layer whose prefix it matches (longest prefix wins).
LAYERS = (
    # (the floor's modules before they moved into autosearch/core/ are listed too, so that the
    # same script measures the code before the restructure)
    (
        "floor",
        (
            "autosearch.core",
            "autosearch._lazy",
            "autosearch.errors",
            "autosearch._io",
            "autosearch.model_spec",
            "autosearch.strategy",
            "cost_models.hardware",
            "cost_models.report",
            "cost_models.runtime",
        ),
    ),
    ("model", ("cost_models", "search_spaces")),
    # the torch side, as pyproject.toml layers it: the parallel building blocks, the models
    # declared with them, the Engine that trains them
    ("distributed", ("autosearch.distributed",)),
    ("models", ("autosearch.models", "autosearch.transformer")),
    ("engine", ("autosearch.engine",)),
    ("search", ("autosearch.tuning", "autosearch.tuner", "autosearch.export")),
    # calibration's torch side: microbenchmark workers and calibrate, on cost_models' fitting
    ("calibrate", ("autosearch.calibration",)),
    # validation's torch-free side (launch runs, record them); its torch side (the worker)
    # runs the Engine in processes started by module name
    ("launch", ("autosearch.validation",)),
    (
        "run",
        (
            "autosearch.validation.worker",
            "autosearch.validation.measure",
            "autosearch.validation.memtrack",
        ),
    ),
    # Engine.tune: the search, validation and the Engine composed from above
    ("autotune", ("autosearch.autotune",)),
    ("interface", ("autosearch.commands", "autosearch.cli", "autosearch.__main__")),
)


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def import_graph() -> tuple[list[str], list[tuple[str, str]]]:
    import grimp

    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    edges = sorted(
        (importer, imported)
        for importer in modules
        for imported in graph.find_modules_directly_imported_by(importer)
        if imported in graph.modules and imported != importer
    )
    # A package's __init__ re-exporting its own modules is not a dependency between layers.
    return modules, edges


def cycles_and_levels(modules: list[str], edges: list[tuple[str, str]]):
    import numpy as np
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import connected_components

    index = {m: i for i, m in enumerate(modules)}
    rows = [index[a] for a, _ in edges]
    cols = [index[b] for _, b in edges]
    matrix = csr_matrix((np.ones(len(edges)), (rows, cols)), shape=(len(modules),) * 2)
    n, labels = connected_components(matrix, directed=True, connection="strong")
    members: dict[int, list[str]] = {}
    for m, label in zip(modules, labels):
        members.setdefault(int(label), []).append(m)
    cycles = [sorted(ms) for ms in members.values() if len(ms) > 1]
    # Longest path on the condensation (a DAG): level 0 imports nothing of ours.
    succ: dict[int, set[int]] = {c: set() for c in range(n)}
    for a, b in edges:
        ca, cb = int(labels[index[a]]), int(labels[index[b]])
        if ca != cb:
            succ[ca].add(cb)
    level: dict[int, int] = {}

    def depth(c: int) -> int:
        if c not in level:
            level[c] = 1 + max((depth(s) for s in succ[c]), default=-1)
        return level[c]

    sys.setrecursionlimit(10_000)
    n_levels = 1 + max(depth(c) for c in range(n))
    return cycles, n_levels


def upward_imports(edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out = []
    for a, b in edges:
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            out.append((a, b))
    return out


def longest_functions(top: int = 5) -> list[tuple[int, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    # statements, not lines: independent of how the code is formatted
                    length = sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1
                    kind = "class" if isinstance(node, ast.ClassDef) else "def"
                    where = f"{path.relative_to(ROOT)}:{node.lineno} {kind} {node.name}"
                    found.append((length, where))
    functions = sorted((f for f in found if " def " in f[1]), reverse=True)[:top]
    classes = sorted((f for f in found if " class " in f[1]), reverse=True)[:top]
    return functions + classes


def widest_signatures(top: int = 5) -> list[tuple[int, int, str]]:
    """(parameters, statements, where) of the functions that take the most parameters (self and
    cls not counted)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                    n -= bool(names) and names[0] in ("self", "cls")
                    length = sum(isinstance(s, ast.stmt) for s in ast.walk(node)) - 1
                    where = f"{path.relative_to(ROOT)}:{node.lineno} def {node.name}"
                    found.append((n, length, where))
    return sorted(found, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    modules, edges = import_graph()
    cycles, n_levels = cycles_and_levels(modules, edges)
    up = upward_imports(edges)
    longest = longest_functions()
    figures = {
        "modules": len(modules),
        "module_imports": len(edges),
        "levels": n_levels,
        "cycles": cycles,
        "upward_imports": [f"{a} -> {b}" for a, b in up],
        "longest": [f"{n} statements  {where}" for n, where in longest],
        "widest": [f"{n} parameters, {s} statements  {w}" for n, s, w in widest_signatures()],
    }
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(
        f"modules {figures['modules']}, module-to-module imports {figures['module_imports']}, "
        f"levels {n_levels}, cycles {len(cycles)}, upward imports {len(up)}"
    )
    for cycle in cycles:
        print("  cycle:", " <-> ".join(cycle))
    for line in figures["upward_imports"]:
        print("  up:", line)
    for line in figures["longest"]:
        print("  ", line)
    for line in figures["widest"]:
        print("  ", line)


if __name__ == "__main__":
    main()
