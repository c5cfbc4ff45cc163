"""Rules the source keeps (CONTRIBUTING.md, "How the code is written"): no function of the package or
of its tests is over 60 lines, but the few test scenarios named here, each with the reason it reads
better whole."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
# Tests that walk one scenario end to end, in order, each step checked where it happens (split, their
# steps would be read out of order), and one fixture whose draws must stay in their order.
LONG_ON_PURPOSE = {
    "tests/test_serving_processes.py::test_host_channel_sends_steps_and_table_deltas_to_every_follower":
        "one leader and its followers through a sequence of steps, every follower checked after each",
    "tests/reference.py::release_tensors": "one random checkpoint's tensors drawn in one sequence: the "
                                           "fixtures' seeds (some picked for their routing margins) name it",
    "tests/test_smoke.py::test_engines_and_a_notebook_at_jupyters_root_import_the_installed_dsr1":
        "one cluster's engines and one notebook kernel, started, checked and stopped in order",
    "tests/test_browser.py::test_main_notebook_runs_in_jupyterlab_and_the_widget_streams":
        "one browser session through the notebook, cell by cell",
    "tests/test_plan.py::test_scaled_down_serving_step_compiled_by_xla_tpu_for_v5e":
        "one compiled step, its memory, collectives and kernel each checked on the same compile",
}


def long_functions() -> dict[str, int]:
    """Every function of `dsr1/` and `tests/` over `MAX_LINES` lines (docstring included), by
    `path::name`."""
    found = {}
    for path in sorted([*ROOT.glob("dsr1/**/*.py"), *ROOT.glob("tests/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found[f"{path.relative_to(ROOT)}::{node.name}"] = lines
    return found


def test_no_function_is_over_60_lines():
    long = long_functions()
    assert {k: v for k, v in long.items() if k not in LONG_ON_PURPOSE} == {}
    assert set(LONG_ON_PURPOSE) <= set(long), "a test named long on purpose is not any more: drop it from the list"
