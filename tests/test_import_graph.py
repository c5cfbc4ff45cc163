"""The package's imports point one way (docs/design.md): no circle among its modules or its packages,
and the model core imports nothing of dsr1 outside itself, nor any library but JAX and NumPy.

The graph is read from the source (every `import`, at module level or inside a function, but not
those for annotations only, under `if TYPE_CHECKING:`), so an import hidden in a function to break a
circle counts as the circle it is.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsr1"
CORE_MAY_IMPORT = {"jax", "jaxlib", "numpy"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


Sources = dict[str, tuple[bool, str]]  # module name -> (whether it is a package's __init__, its text)


def package_sources() -> Sources:
    return {_module_name(p): (p.name == "__init__.py", p.read_text()) for p in PACKAGE.rglob("*.py")}


def _imports(name: str, is_package: bool, text: str) -> set[str]:
    """The absolute names of everything module `name` imports, relative imports resolved; a
    `from X import Y` names `X.Y` (Y may be a module of package X)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(text, name)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                todo.extend(child.orelse)
            else:
                todo.append(child)


def module_graph(sources: Sources) -> dict[str, set[str]]:
    """Each dsr1 module -> the dsr1 modules it imports (importing `a.b.c` also runs `a` and `a.b`)."""
    graph = {}
    for name, (is_package, text) in sources.items():
        targets = set()
        for imported in _imports(name, is_package, text):
            parts = imported.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in targets if t in sources and t != name and not name.startswith(t + ".")}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between dsr1's subpackages (`dsr1.core`, `dsr1.cpu`, ...; top-level modules as themselves)."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    edges.pop("dsr1", None)  # `import dsr1` re-exports the everyday API: it sits above everything
    return {k: v - {"dsr1"} for k, v in edges.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def core_violations(sources: Sources) -> list[str]:
    """Every import of a `dsr1.core` module that is neither the core nor JAX, NumPy or the standard library."""
    bad = []
    for name, (is_package, text) in sorted(sources.items()):
        if name != "dsr1.core" and not name.startswith("dsr1.core."):
            continue
        for imported in sorted(_imports(name, is_package, text)):
            top = imported.split(".")[0]
            allowed = (imported == "dsr1.core" or imported.startswith("dsr1.core.") or top in CORE_MAY_IMPORT
                       or top in sys.stdlib_module_names or top == "__future__")
            if not allowed:
                bad.append(f"{name} imports {imported}")
    return bad


def test_no_module_imports_itself_back():
    graph = module_graph(package_sources())
    assert len(graph) > 100 and graph["dsr1.core.model"], "the graph is not being read"
    assert circles(graph) == []


def test_no_package_imports_itself_back():
    packages = package_graph(module_graph(package_sources()))
    assert {"dsr1.core", "dsr1.cpu", "dsr1.weights", "dsr1.serving"} <= set(packages)
    assert circles(packages) == []


def test_the_core_imports_only_itself_jax_and_numpy():
    sources = package_sources()
    assert core_violations(sources) == []
    assert package_graph(module_graph(sources))["dsr1.core"] == set()


@pytest.mark.parametrize("line", ["from .. import cpu", "from ..cpu.layouts import Bf16Bits",
                                  "import dsr1.serving", "from dsr1.weights import release", "import torch"])
def test_a_core_import_of_anything_else_is_found(line):
    """The checks fail on a core module that imports the CPU backend (or another dsr1 package, or
    another library): the layering check always, the circle check where the import closes one (the
    backend imports the core)."""
    sources = package_sources()
    is_package, text = sources["dsr1.core.products"]
    sources["dsr1.core.products"] = (is_package, f"{line}\n{text}")
    found = core_violations(sources)
    assert found and all(v.startswith("dsr1.core.products imports ") for v in found)
    assert any(line.split()[1].lstrip(".") in v or "dsr1" in v for v in found)
    if "cpu" in line:
        assert ["dsr1.core", "dsr1.cpu"] in [[p for p in c if p in ("dsr1.core", "dsr1.cpu")]
                                            for c in circles(package_graph(module_graph(sources)))]
