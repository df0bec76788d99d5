"""The import graph of axonserve/, read from the source with `ast` (nothing is imported).

Each module maps to the axonserve modules it imports, in two kinds: module-level imports (run
when the module is imported, `if`/`try` blocks and class bodies included) and function-level
ones (run when the function is called: the lazy imports that keep torch out of the frontend).
Imports under `if TYPE_CHECKING:` never run and are left out. An edge names the most specific
module imported (`from axonserve.protocol import Codec` -> axonserve.protocol, `from axonserve
import cli` -> axonserve.cli); the implicit import of parent packages is not an edge (Python
initialises a parent before its children, so it cannot close a cycle that matters).

Checked: no cycles among module-level imports, and the wire types (`axonserve.protocol`) depend
on nothing but the config. `python tests/test_import_graph.py` prints the cycles of both kinds.
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "axonserve")

# axonserve.protocol (the wire) may import these; config defines RequestLimits, sent in EngineInfo
PROTOCOL_MAY_IMPORT = {"axonserve.config"}
# ... and, lazily, the grammar check that `SamplingParams.validate()` runs for structured outputs
# (one place for every request rule: HTTP, offline, the vLLM plugin and the scheduler call it)
PROTOCOL_MAY_IMPORT_LAZILY = PROTOCOL_MAY_IMPORT | {"axonserve.structured_output.grammar"}


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py under axonserve/."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        for f in sorted(filenames):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(dirpath, f)
    return found


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, module: str, is_package: bool, modules: dict[str, str]):
    """Yield (imported axonserve module, "module" | "function") for each import in the tree."""
    package = module if is_package else module.rpartition(".")[0]

    def targets(node):
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        names = [f"{base}.{a.name}" for a in node.names]
        return [n if n in modules else base for n in names]

    def walk(node, kind):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), kind)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in targets(child):
                    while name and name not in modules and "." in name:  # `import a.b.c` -> a.b.c's module
                        name = name.rpartition(".")[0]
                    if name in modules:
                        yield name, kind
            inner = "function" if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else kind
            yield from walk(child, inner)

    yield from walk(tree, "module")


def import_graph() -> dict[str, dict[str, set[str]]]:
    """module -> {"module": imported at import time, "function": imported inside functions}."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges: dict[str, set[str]] = {"module": set(), "function": set()}
        for target, kind in _imports(tree, name, path.endswith("__init__.py"), modules):
            if target != name:
                edges[kind].add(target)
        edges["function"] -= edges["module"]
        graph[name] = edges
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_cycles_among_module_level_imports():
    graph = import_graph()
    found = cycles({m: e["module"] for m, e in graph.items()})
    assert not found, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_protocol_depends_only_on_config():
    graph = import_graph()
    bad = []
    for m, e in graph.items():
        if m == "axonserve.protocol" or m.startswith("axonserve.protocol."):
            inside = lambda t: t == "axonserve.protocol" or t.startswith("axonserve.protocol.")  # noqa: E731
            bad += [
                f"{m} -> {t} (module level)"
                for t in sorted(e["module"])
                if not inside(t) and t not in PROTOCOL_MAY_IMPORT
            ]
            bad += [
                f"{m} -> {t} (in a function)"
                for t in sorted(e["function"])
                if not inside(t) and t not in PROTOCOL_MAY_IMPORT_LAZILY
            ]
    assert not bad, "axonserve.protocol imports beyond the config:\n" + "\n".join(bad)


if __name__ == "__main__":
    g = import_graph()
    for kind, edges in (
        ("module-level", {m: e["module"] for m, e in g.items()}),
        ("module- and function-level", {m: e["module"] | e["function"] for m, e in g.items()}),
    ):
        found = cycles(edges)
        print(f"{kind} import cycles: {len(found)}")
        for c in found:
            print("  " + " <-> ".join(c))
