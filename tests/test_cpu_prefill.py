"""The CPU prefill path (models/cpu_prefill.py) computes what MLX computes: attention for every
mask mlx-lm passes (none, causal, boolean and additive arrays, GQA, batches, a fully masked row)
and the gated SiLU, within float rounding; a long prompt through the engine gives the same
greedy answer with the switch on and off; short windows never take it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu

from macspec.models import cpu_prefill
from macspec.models.cpu_prefill import attend, gated_silu, mlx_only
from macspec.engine.engine import Engine
from macspec import corpus
from macspec.sampling import SamplingParams


def _qkv(batch, q_heads, kv_heads, length, positions, dims=16, value_dims=None):
    keys = mx.random.split(mx.random.key(length * 7 + positions), 3)
    return (mx.random.normal((batch, q_heads, length, dims), key=keys[0]),
            mx.random.normal((batch, kv_heads, positions, dims), key=keys[1]),
            mx.random.normal((batch, kv_heads, positions, value_dims or dims), key=keys[2]))


@pytest.mark.parametrize("shape", [(1, 4, 4, 70, 70), (2, 6, 2, 65, 200), (1, 8, 1, 128, 300)],
                         ids=["mha", "gqa-batch", "mqa-history"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
def test_attention_matches_mlx(shape, mask_kind):
    batch, q_heads, kv_heads, length, positions = shape
    q, k, v = _qkv(*shape, value_dims=12)
    mask = {"none": None, "causal": "causal",
            "bool": mx.random.uniform(shape=(batch, 1, length, positions)) > 0.3,
            "additive": mx.random.normal((length, positions))}[mask_kind]
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    ours = attend(q, k, v, 0.3, mask)
    assert ours.shape == theirs.shape and ours.dtype == mx.float32
    assert mx.allclose(ours, theirs, atol=2e-6, rtol=1e-5).item()


def test_a_fully_masked_row_gives_zeros_not_nan():
    q, k, v = _qkv(1, 2, 2, 64, 64)
    mask = mx.ones((64, 64), dtype=mx.bool_)
    mask[3] = False
    out = attend(q, k, v, 0.25, mask)
    assert not mx.isnan(out).any().item()
    assert mx.all(out[:, :, 3] == 0).item()


def test_gated_silu_matches_mlx_at_the_extremes():
    gate = mx.concatenate([mx.random.normal((1, 80, 64)) * 5, mx.full((1, 1, 64), 200.0),
                           mx.full((1, 1, 64), -200.0)], axis=1)
    up = mx.random.normal(gate.shape)
    assert mx.allclose(gated_silu(gate, up), swiglu(gate, up), atol=1e-5, rtol=1e-5).item()


def test_short_windows_and_the_switch_keep_mlx():
    """Decode and verification windows (< MIN_QUERIES positions) and switch-off go to MLX's own
    functions, untouched."""
    calls = []
    routed = cpu_prefill.routed_attention(lambda *a, **kw: calls.append("mlx") or a[0])
    q, k, v = _qkv(1, 2, 2, cpu_prefill.MIN_QUERIES - 1, 80)
    routed(q, k, v, None, scale=1.0, mask="causal")
    q, k, v = _qkv(1, 2, 2, cpu_prefill.MIN_QUERIES, 80)
    routed(q, k, v, None, scale=1.0, mask="causal")
    with mlx_only():
        routed(q, k, v, None, scale=1.0, mask="causal")
    assert calls == ["mlx", "mlx"]


@pytest.mark.slow
def test_a_long_prompt_answers_the_same_with_the_switch_on_and_off(runtime_for):
    """Greedy through the engine (a fresh one each: no prefix cache between them): ~300 prompt
    tokens of real text, prefilled in chunks on the NumPy path, answer as MLX alone does."""
    runtime = runtime_for("none")
    text = " ".join(t[:400] for t in corpus.read_texts(heldout=True)[:4])
    prompt = runtime.tokenizer.encode(text, add_special_tokens=False)[:300]
    assert len(prompt) == 300

    def answer():
        [done] = Engine(runtime, max_batch=1).generate([prompt], SamplingParams(temperature=0.0), 24)
        return done.tokens

    ours = answer()
    with mlx_only():
        theirs = answer()
    assert ours == theirs and len(ours) == 24
