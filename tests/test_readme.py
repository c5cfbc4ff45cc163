"""The README's test command is exactly what CI runs."""

from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = next(line for line in readme if line.startswith("python3 -m venv") and "pytest" in line)
    assert test_command in ci
