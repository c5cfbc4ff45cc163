"""Decode profiling (blocks from the trace, bandwidth) and the generation widget, on the tiny model."""

from __future__ import annotations

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


def test_profile_decode(tiny, tmp_path):
    p = profiling.profile_decode(tiny, batch=2, batches=(1, 2), context=16, steps=4, copy_bytes=32 * 2**20,
                                 logdir=tmp_path)
    print("\n" + p.summary())
    assert len(p.step_ms) == 4 and (p.step_ms > 0).all()
    assert set(p.tokens_per_second) == {1, 2} and min(p.tokens_per_second.values()) > 0
    assert {"attention", "routed experts", "lm head"} <= set(p.block_ms)
    assert p.block_ms["lm head"] > 0 and p.block_ms["attention"] > 0
    assert 0 < p.achieved_gbs and 0 < p.peak_gbs
    # lm_head alone (128 x 129280 bf16) is read every step
    assert p.bytes_per_step > tiny.params["lm_head"].nbytes
    fig = profiling.plot_profile(p)
    assert len(fig.axes) == 4


def test_generation_widget_streams_into_its_output(tiny):
    from dsr1.generation.tokenizer import load_tokenizer
    from dsr1.workbench.widgets import GenerationWidget

    w = GenerationWidget(tiny, load_tokenizer(), max_new_tokens=8)
    w.prompt.value, w.chat.value, w.temperature.value = "Bonjour", False, 0.0
    w.button.click()
    assert w.result is not None and w.output.value == w.result.completions[0].text
    assert w.status.value.startswith(("length", "stop")) and "tok/s" in w.status.value
    np.testing.assert_equal(len(w.result.completions[0].tokens) <= 8, True)
