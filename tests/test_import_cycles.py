"""No import cycle among the repository's own modules.

Every .py file of the repository (outside .venv, out/ and hidden folders) is a module:
packages by their dotted path from the root (beam_trtllm.engine.model), and the scripts of
bench/ and tests/ also by their bare names (bench/ and tests/plugins/ put themselves on
sys.path and import each other that way). Each `import` / `from ... import` statement, at any
depth (a function-level import closes a cycle just as well at run time), that names one of
these modules is an edge; a strongly connected component of more than one module, or a module
importing itself, is a cycle. A package's __init__ importing its own submodules, and those
importing names from the package, is how Python packages work, so edges from a module to a
package that contains it are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".venv", "out", "build", "dist", "__pycache__"}
# Folders whose files import each other by bare name (they are put on sys.path).
SCRIPT_DIRS = ("bench", "tests", "tests/plugins", "tests/helpers", "tests/serving")


def _files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py")
            if not any(part in SKIP or part.startswith(".") for part in p.relative_to(ROOT).parts)]


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_names() -> dict[str, Path]:
    """Name -> file, dotted names for every file and bare names for SCRIPT_DIRS' files."""
    names = {_dotted(p): p for p in _files()}
    for p in _files():
        if str(p.parent.relative_to(ROOT)) in SCRIPT_DIRS and p.stem != "__init__":
            names.setdefault(p.stem, p)
    return names


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement of `tree` may load (with its parents)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {p for name in out for p in _with_parents(name)}


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph() -> dict[Path, set[Path]]:
    names = module_names()
    graph: dict[Path, set[Path]] = {}
    for path in _files():
        module = _dotted(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for name in _imported(tree, module, path.name == "__init__.py"):
            target = names.get(name)
            if target is None or target == path:
                continue
            if target.name == "__init__.py" and path.is_relative_to(target.parent):
                continue  # a submodule importing from its own package
            edges.add(target)
        graph[path] = edges
    return graph


def cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_checker_finds_a_cycle_it_is_given():
    a, b, c = Path("a.py"), Path("b.py"), Path("c.py")
    assert cycles({a: {b}, b: {c}, c: {a}}) == [[a, b, c]]
    assert cycles({a: {b}, b: {c}, c: set()}) == []


def test_the_graph_sees_the_repository_imports():
    graph = import_graph()
    engine = ROOT / "bench" / "engine_bench.py"
    assert ROOT / "bench" / "_engine_layers.py" in graph[engine]
    assert any(p.is_relative_to(ROOT / "beam_trtllm") for p in graph[engine])


def test_no_import_cycle_in_the_repository():
    found = sorted(tuple(str(p.relative_to(ROOT)) for p in c) for c in cycles(import_graph()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)
