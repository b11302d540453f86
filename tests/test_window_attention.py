"""Blocks of 2+ queries (verify windows, prefill) on MLX's CUDA backend attend unfused (models/window_attention.py): the same
attention as MLX's fused kernel, and through the engine greedy speculation still equals plain.
The CPU has no CUDA, so the tests force the path on."""

from __future__ import annotations

import mlx.core as mx
import pytest

from macspec.models import window_attention
from macspec.sampling import SamplingParams

from .conftest import generate


def qkv(batch, heads, kv_heads, length, keys_len, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((batch, heads, length, 64), key=k1),
            mx.random.normal((batch, kv_heads, keys_len, 64), key=k2),
            mx.random.normal((batch, kv_heads, keys_len, 64), key=k3))


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("length", [2, 5])
def test_unfused_equals_mlx_kernel(mask_kind, length):
    q, k, v = qkv(2, 8, 2, length, 37)
    rows = mx.arange(37 - length, 37)[:, None] >= mx.arange(37)[None]
    padded = mx.concatenate([mx.zeros((1, 1, length, 3), mx.bool_),  # row 0 skips 3 padded keys
                             mx.ones((1, 1, length, 3), mx.bool_)])
    bool_mask = mx.concatenate([padded, mx.broadcast_to(rows[None, None, :, 3:], (2, 1, length, 34))], axis=-1)
    mask = {"none": None, "causal": "causal", "bool": bool_mask,
            "additive": mx.where(bool_mask, 0.0, -1e9)}[mask_kind]
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = window_attention.attend(q, k, v, 0.125, mask)
    assert mx.allclose(got, expected, atol=1e-5).item()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "dflash"])  # dflash: macspec's own drafter calls MLX directly
def test_speculative_greedy_equals_plain_on_the_unfused_path(runtime_for, prompts, monkeypatch, method):
    windows = []
    attend = window_attention.attend
    monkeypatch.setattr(window_attention, "attend", lambda q, *a: windows.append(q.shape[2]) or attend(q, *a))
    monkeypatch.setattr(window_attention._force, "on", True)
    runtime = runtime_for("draft")
    for prompt in [p[::-1] for p in prompts[:4]]:  # reversed: no other test's prefix-cache entry
        with window_attention.mlx_only():
            plain, _ = generate(runtime, prompt, 24, SamplingParams(), k=0)
        spec, _ = generate(runtime, prompt, 24, SamplingParams(), k=3, method=method)
        assert spec == plain
    assert 4 in windows  # the verify windows went through the unfused path
    assert max(windows) > 4  # and so did the prompts' prefill
