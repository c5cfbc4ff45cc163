"""The package's import graph: the jitted programs, generation and serving import each other in one
direction only (the programs below, generation and serving above), so any of them can be imported
first; and every jit of the package is one of the programs."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dsr1"


def _unit(module: str) -> str:
    """The graph node of `dsr1.a.b...`: a top-level module or subpackage (`dsr1.a`)."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path, module: str) -> set[str]:
    """Modules `path` imports when it runs (not those under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[:len(base) - node.level + 1] if node.level else []
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(getattr(node, field, None), list):
                    visit(getattr(node, field))

    visit(tree.body)
    return {name for name in found if name.startswith("dsr1.")}


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Edges between top-level units of `dsr1` (the package's own `__init__` and `__main__` left out:
    they import everything by design)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module in ("dsr1", "dsr1.__main__"):
            continue
        unit = _unit(module)
        targets = {_unit(t) for t in _imports(path, module)} - {unit, "dsr1"}
        edges.setdefault(unit, set()).update(t for t in targets if (PACKAGE.parent / t.replace(".", "/")).exists()
                                             or (PACKAGE.parent / (t.replace(".", "/") + ".py")).exists())
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(edges.get(start, ()))
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False


@pytest.mark.parametrize("unit", ["dsr1.programs", "dsr1.generation", "dsr1.serving", "dsr1.api"])
def test_no_import_cycle_through(unit):
    edges = _graph()
    assert edges.get(unit), f"{unit} found no imports: the graph is not being read"
    cycle = [other for other in edges.get(unit, ()) if _reaches(edges, other, unit)]
    assert not cycle, f"{unit} imports {cycle}, which import {unit} back"


def test_programs_import_only_the_core():
    """The programs sit on the core and below everything that runs them."""
    edges = _graph()
    assert edges["dsr1.programs"] == {"dsr1.core"}
    for above in ("dsr1.api", "dsr1.generation", "dsr1.serving"):
        assert "dsr1.programs" in edges[above] and above not in edges["dsr1.programs"]


# Modules that may jit outside `dsr1.programs` (docs/design.md, "One layer of programs"): the backend's
# and the loader's one-off layout conversions, training, the benchmarks' microbenchmarks and the
# workbench's smoke check.
JIT_ELSEWHERE = ("dsr1/cpu/layouts.py", "dsr1/weights/loading.py", "dsr1/train/", "dsr1/bench/",
                 "dsr1/workbench/smoke.py")


def _jits(path: Path) -> list[int]:
    """The lines of `path` that name `jax.jit` (or a bare `jit` imported from jax)."""
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr == "jit" and ast.unparse(node.value) == "jax")
            or (isinstance(node, ast.ImportFrom) and node.module == "jax" and any(a.name == "jit" for a in node.names))]


def test_every_jit_is_a_program():
    outside = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
               if not str(path.relative_to(PACKAGE.parent)).startswith(("dsr1/programs/", *JIT_ELSEWHERE))
               for line in _jits(path)]
    assert not outside, f"jitted outside dsr1.programs: {outside}"


@pytest.mark.parametrize("module", ["dsr1.programs", "dsr1.generation.batch", "dsr1.programs.step"])
@pytest.mark.slow
def test_imports_fresh(module):
    """Each imports first in a fresh interpreter (a cycle would leave a partly initialized module)."""
    out = subprocess.run([sys.executable, "-c", f"import {module}; import dsr1.programs as p; "
                          "print(p.serve_step if hasattr(p, 'serve_step') else p.generate_chunk)"],
                         capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
