"""The README: its test command is exactly what CI runs, and its Python examples run as written."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import subprocess_env

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    readme = README.splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_command = next(line for line in readme if line.startswith("python3 -m venv") and "pytest" in line)
    assert test_command in ci
    assert " tests notebooks" in test_command  # lint included: tests/test_scripts.py runs ruff and shellcheck


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=subprocess_env(1), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
@pytest.mark.slow
def test_readme_example_runs(index):
    """Each ```python block of the README runs in a fresh interpreter, using `dsr1.*` only."""
    code = EXAMPLES[index]
    imports = set(re.findall(r"^(?:from|import) (\S+)", code, flags=re.M))
    assert imports <= {"dsr1", "numpy"}, f"example {index} imports {imports}: the README should need dsr1 alone"
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_one_line_generate():
    """The one-liner from the API issue: the everyday API without any submodule import."""
    proc = _run("import dsr1; print(dsr1.generate(dsr1.init_random(dsr1.Config.preset('tiny')), ['hi'], "
                "max_new_tokens=4).completions[0].text)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "generate printed no text"


@pytest.mark.slow
def test_the_library_install_generates_english():
    """The install section's command line, as written: the embedded demo model continues the prompt
    in English words, with its own tokenizer, and reports its speed."""
    block = re.search(r"## Install as a library\n\n```bash\n(.*?)```", README, flags=re.S).group(1)
    line = next(row for row in block.splitlines() if row.startswith("python -m dsr1 generate"))
    args = shlex.split(line.split("#")[0])[1:] + ["--max-new-tokens", "16", "--no-warmup"]
    proc = subprocess.run([sys.executable, *args], env=subprocess_env(1), capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "demo_model" in proc.stderr and "decode:" in proc.stderr
    words = proc.stdout.split()
    assert len(words) >= 3 and proc.stdout.isascii(), proc.stdout
    assert sum(w.strip(",.;:!?'").isalpha() for w in words) >= len(words) - 1, proc.stdout

