"""Decode profiling (blocks from the trace, bandwidth) and the generation widget, on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

import dsr1
from dsr1.workbench import profiling


@pytest.fixture(scope="module")
def tiny():
    return dsr1.init_random(dsr1.Config.preset("tiny"))


def test_scopes_of_hlo_ops():
    hlo = ('%fusion.3 = bf16[2] fusion(%a), kind=kLoop, metadata={op_name="jit(decode)/moe_layers/moe/'
           'routed_experts/dot_general" source_file="x"}\n'
           '%dot.1 = f32[2] dot(%b), metadata={op_name="jit(decode)/dense_layers/mla_decode/einsum"}\n'
           '%copy.2 = f32[2] copy(%c), metadata={op_name="jit(decode)/concatenate"}')
    assert profiling._scope_of_ops(hlo) == {"fusion.3": "routed experts", "dot.1": "attention", "copy.2": "other"}


def test_block_times_are_per_device_and_per_step():
    """Two devices' ops over 4 steps: each block's time is their sum / 4 steps / 2 devices; an op no
    scope names is "other"; events that are not ops (no `hlo_op`, not complete) count nowhere."""
    events = [{"ph": "X", "dur": 800.0, "args": {"hlo_op": "fusion.3"}, "pid": 1},
              {"ph": "X", "dur": 400.0, "args": {"hlo_op": "wrapped_fusion.3"}, "pid": 2},
              {"ph": "X", "dur": 160.0, "args": {"hlo_op": "copy.9"}, "pid": 2},
              {"ph": "X", "dur": 999.0, "args": {}, "pid": 1},
              {"ph": "i", "dur": 999.0, "args": {"hlo_op": "fusion.3"}, "pid": 1}]
    blocks = {"fusion.3": "routed experts"}
    got = profiling.per_device_block_ms(events, blocks, steps=4, devices=2)
    assert got == pytest.approx({"routed experts": 0.15, "other": 0.02}, rel=1e-12)


@pytest.mark.slow
def test_profile_decode(tmp_path):
    """`profile_decode` and its plot, in a process of their own (see tests/profiling_worker.py). Given
    no folder for the trace, it leaves none behind."""
    from .harness import subprocess_env

    env = subprocess_env(1) | {"TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "tests.profiling_worker"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(tmp_path.glob("dsr1-trace-*"))
    *summary, figures = done.stdout.strip().splitlines()
    print("\n" + "\n".join(summary))
    p = json.loads(figures)
    assert len(p["step_ms"]) == 4 and min(p["step_ms"]) > 0
    assert set(p["tokens_per_second"]) == {"1", "2"} and min(p["tokens_per_second"].values()) > 0
    assert {"attention", "routed experts", "lm head"} <= set(p["block_ms"])
    assert p["block_ms"]["lm head"] > 0 and p["block_ms"]["attention"] > 0
    # one device's ops run one after another within the traced steps' wall time
    assert sum(p["block_ms"].values()) <= 1.25 * p["traced_step_ms"]
    assert 0 < p["achieved_gbs"] and 0 < p["peak_gbs"]
    # lm_head alone (128 x 129280 bf16) is read every step
    assert p["bytes_per_step"] > p["lm_head_bytes"]
    assert p["axes"] == 4


@pytest.mark.slow
def test_generation_widget_streams_into_its_output(tiny):
    from dsr1.generation.tokenizer import load_tokenizer
    from dsr1.workbench.widgets import GenerationWidget

    w = GenerationWidget(tiny, load_tokenizer(), max_new_tokens=8)
    w.prompt.value, w.chat.value, w.temperature.value = "Bonjour", False, 0.0
    w.button.click()
    assert w.result is not None and w.output.value == w.result.completions[0].text
    assert w.status.value.startswith(("length", "stop")) and "tok/s" in w.status.value
    np.testing.assert_equal(len(w.result.completions[0].tokens) <= 8, True)


@pytest.mark.slow
def test_widget_reports_prefill_without_compilation(tiny):
    """A first call compiles: its prefill figure leaves the compilation out and shows it apart."""
    from dsr1.generation.tokenizer import load_tokenizer
    from dsr1.workbench.widgets import GenerationWidget

    w = GenerationWidget(tiny, load_tokenizer(), max_new_tokens=4)
    w.prompt.value = "A prompt of another length, so that prefill compiles again here"
    jax.clear_caches()  # earlier tests may have compiled this prompt's bucket already
    w.button.click()
    assert "compilation" in w.status.value and "(not counted)" in w.status.value, w.status.value
    prefill = float(w.status.value.split("prefill ")[1].split(" tok/s")[0].replace(",", ""))
    assert prefill > w.result.prefill_tokens_per_second  # the compile time is out of the prefill figure


def test_status_line_and_compile_times():
    from types import SimpleNamespace

    from dsr1.workbench.widgets import CompileTimes, status_line

    r = SimpleNamespace(completions=[SimpleNamespace(finish_reason="length")], prefill_seconds=2.0,
                        prefill_tokens=100, decode_tokens=10, decode_tokens_per_second=10.0, draft_acceptance=None)
    line = status_line(r, prefill_compile_seconds=1.5, compile_seconds=1.8)
    assert "prefill 200 tok/s" in line and "decode 10.0 tok/s" in line and "compilation 1.8 s" in line
    assert "drafts" not in line
    r.draft_acceptance = 0.75
    assert "75% of MTP drafts accepted" in status_line(r, 0.0, 0.0)
    r.draft_acceptance = None
    assert "compilation" not in status_line(r, 0.0, 0.0) and "prefill 50 tok/s" in status_line(r, 0.0, 0.0)
    import jax
    import jax.numpy as jnp

    with CompileTimes() as compiles:
        jax.jit(lambda x: jnp.sin(x) * 3.25)(jnp.arange(7.0)).block_until_ready()
    assert compiles.total > 0 and compiles.within(0, float("inf")) == compiles.total
