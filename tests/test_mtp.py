"""The MTP module's full-sequence forward (`dsr1.core.mtp.mtp_forward`) against a reference.

HF transformers has no MTP module, but the module's transformer block is an ordinary MoE decoder
layer stored as layer `num_hidden_layers`. So the reference loads the fixture into HF with one more
layer, replaces that layer's input by `eh_proj([enorm(embed(t+1)); hnorm(h)])` (by hand, in torch,
from the same release tensors) and applies `shared_head` to its output.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import dsr1
from dsr1.core.model import forward_hidden
from dsr1.core.mtp import mtp_forward

from .harness import TOLERANCE, build_fixture, relative_error


@pytest.fixture(scope="module")
def mtp_fixture(tmp_path_factory):
    return build_fixture(tmp_path_factory.mktemp("mtp"), "grouped_qlora", mtp=True)


@pytest.fixture(scope="module")
def mtp_model(mtp_fixture):
    return dsr1.load(mtp_fixture.folder, dtype="float32", mtp=True, progress=False)


def _release_tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _reference_mtp(folder, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF reference: the main model's pre-norm hidden `[B, T, D]` and MTP logits `[B, T-1, V]` for
    full-length `tokens [B, T]` (position t of the MTP sees hidden t and token t + 1)."""
    import torch
    import transformers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = json.loads((folder / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    hf_cfg = DeepseekV3Config(**{**cfg, "num_hidden_layers": n + 1})
    model = DeepseekV3ForCausalLM.from_pretrained(str(folder), config=hf_cfg, dtype=torch.float32).eval()
    w = {k: torch.from_numpy(v) for k, v in _release_tensors(folder).items() if k.startswith(f"model.layers.{n}.")}
    pre, eps = f"model.layers.{n}.", cfg["rms_norm_eps"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    seen = {}
    next_ids = torch.from_numpy(tokens[:, 1:].astype(np.int64))

    def replace_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen["hidden"] = hidden[:, :-1].detach().clone()
        e = rms(w[pre + "embed_tokens.weight"][next_ids], w[pre + "enorm.weight"])
        h = rms(hidden[:, :-1], w[pre + "hnorm.weight"])
        x = torch.cat([e, h], -1) @ w[pre + "eh_proj.weight"].T
        x = torch.cat([x, torch.zeros_like(hidden[:, -1:])], 1)  # the last position has no next token
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def capture(module, args, kwargs, output):
        seen["out"] = (output[0] if isinstance(output, tuple) else output)[:, :-1].detach().clone()

    layer = model.model.layers[n]
    handles = [layer.register_forward_pre_hook(replace_input, with_kwargs=True),
               layer.register_forward_hook(capture, with_kwargs=True)]
    with torch.no_grad():
        model(torch.from_numpy(tokens.astype(np.int64)))
        logits = rms(seen["out"], w[pre + "shared_head.norm.weight"]) @ w[pre + "shared_head.head.weight"].T
    for h in handles:
        h.remove()
    return seen["hidden"].numpy(), logits.numpy()


def _run(model, tokens: np.ndarray, lengths: np.ndarray):
    kw = model.program_kwargs
    logits, hidden = jax.jit(lambda p, t, n: forward_hidden(p, t, n, **kw))(model.params, tokens, lengths)
    nxt = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    mtp_logits, mtp_hidden = jax.jit(lambda p, h, t, n: mtp_forward(p, h, t, n, **kw))(
        model.params, hidden, jnp.asarray(nxt), lengths)
    return np.asarray(logits), np.asarray(hidden), np.asarray(mtp_logits), np.asarray(mtp_hidden)


@pytest.mark.slow
def test_mtp_forward_matches_reference(mtp_fixture, mtp_model):
    tokens = mtp_fixture.tokens[:1]  # the full-length row
    lengths = np.array([tokens.shape[1]], np.int32)
    logits, hidden, mtp_logits, mtp_hidden = _run(mtp_model, tokens, lengths)
    cfg = mtp_model.cfg
    assert mtp_logits.shape == (1, tokens.shape[1], cfg.vocab_size) and mtp_logits.dtype == np.float32
    assert mtp_hidden.shape == (1, tokens.shape[1], cfg.hidden_size)
    assert relative_error(logits[0], mtp_fixture.reference[0]) <= TOLERANCE
    ref_hidden, ref_logits = _reference_mtp(mtp_fixture.folder, tokens)
    assert relative_error(hidden[0, :-1], ref_hidden[0]) <= TOLERANCE
    error = relative_error(mtp_logits[0, :-1], ref_logits[0])
    print(f"\nMTP logits vs reference: max|dlogit|/max|logit| = {error:.2e}")
    assert error <= TOLERANCE
    # The MTP head is not the main head: its logits differ from the main model's.
    assert relative_error(mtp_logits[0, :-1], logits[0, 1:]) > 0.1


@pytest.mark.slow
def test_mtp_forward_is_causal_and_masks_padding(mtp_fixture, mtp_model):
    tokens, lengths = mtp_fixture.tokens, mtp_fixture.lengths
    _, _, full, _ = _run(mtp_model, tokens, lengths)
    for row, n in enumerate(lengths):
        assert not full[row, n:].any(), "outputs past a row's length must be zero"
    # Changing the token at position 20 of row 0 changes nothing before position 19 (which sees it
    # as its next token) and changes position 19 onwards.
    changed = tokens.copy()
    changed[0, 20] = (changed[0, 20] + 1) % mtp_model.cfg.vocab_size
    _, _, other, _ = _run(mtp_model, changed, lengths)
    np.testing.assert_array_equal(other[0, :19], full[0, :19])
    assert np.abs(other[0, 19:lengths[0]] - full[0, 19:lengths[0]]).max(axis=-1).min() > 0
    np.testing.assert_array_equal(other[1:], full[1:])


@pytest.mark.slow
def test_mtp_forward_is_differentiable(mtp_fixture, mtp_model):
    tokens = mtp_fixture.tokens[:1, :12]
    lengths = np.array([12], np.int32)
    kw = mtp_model.program_kwargs
    _, hidden = forward_hidden(mtp_model.params, tokens, lengths, **kw)
    nxt = jnp.asarray(np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1))

    def loss(mtp_params):
        logits, _ = mtp_forward({**mtp_model.params, "mtp": mtp_params}, hidden, nxt, lengths, **kw)
        return jax.nn.logsumexp(logits, axis=-1).mean()

    grads = jax.jit(jax.grad(loss))(mtp_model.params["mtp"])
    for name in ("eh_proj", "enorm", "hnorm", "head", "head_norm"):
        assert np.isfinite(np.asarray(grads[name])).all() and np.abs(np.asarray(grads[name])).max() > 0, name
    assert np.abs(np.asarray(grads["block"]["moe"]["gate"])).max() > 0


def test_mtp_forward_needs_mtp_params(mtp_fixture):
    model = dsr1.load(mtp_fixture.folder, dtype="float32", progress=False)
    hidden = jnp.zeros((1, 4, model.cfg.hidden_size))
    with pytest.raises(ValueError, match="mtp=True"):
        mtp_forward(model.params, hidden, jnp.zeros((1, 4), jnp.int32), jnp.array([4]), **model.program_kwargs)
