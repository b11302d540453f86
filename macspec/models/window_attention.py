"""Attention of 2 or more queries on MLX's CUDA backend: two matmuls and a softmax.

MLX's CUDA `scaled_dot_product_attention` runs one query through its own vector kernel, but 2 or
more queries through a cuDNN graph built for that exact (batch, queries, keys) shape. Building
one took ~55 ms on an H200 (then ~0.1 ms once cached). A verify window meets a new key length on
every step (fixed k = 1 served 17 tok/s against 536 plain on tiny-wide), and so does nearly every
prompt's prefill (docs/benchmarks.md, "On an NVIDIA GPU"). The same blocks unfused took
0.12-0.17 ms for any shape.

So on CUDA every block of 2 or more queries (verify windows, prefill chunks) attends here unless
its scores would exceed MAX_SCORES elements; one query keeps MLX's vector kernel. Metal's kernels
are compiled ahead for every shape: they keep MLX's path, as the CPU does.
"""

from __future__ import annotations

import mlx.core as mx

from .switch import Switch, on_cuda, route_model_modules

MAX_SCORES = 1 << 27  # B·H·queries·keys float32 scores (512 MB) past which MLX's kernel runs
PATCHED = "_macspec_window_attention"
_switch = Switch()
mlx_only = _switch.off  # MLX's fused kernel inside: the reference
_force = Switch(on=False)  # tests: engage on any device (the CPU has no CUDA to show the path on)


def _engages(queries: mx.array, keys: mx.array, cache, mask, sinks) -> bool:
    batch, heads, length, _ = queries.shape
    return (_switch.on and (_force.on or on_cuda()) and length >= 2 and sinks is None
            and not hasattr(cache, "bits") and batch * heads * length * keys.shape[2] <= MAX_SCORES
            and (mask is None or isinstance(mask, mx.array) or mask == "causal"))


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(q·kᵀ·scale + mask)·v with the query heads of each KV head's group stacked (GQA);
    the softmax in float32, as MLX's kernels keep it."""
    batch, heads, length, dim = queries.shape
    kv_heads, keys_len = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, group * length, dim)
    scores = (q @ keys.swapaxes(-1, -2)).astype(mx.float32)
    scores = scores.reshape(batch, kv_heads, group, length, keys_len)
    if isinstance(mask, str):  # "causal": the queries are the last `length` positions
        rows = mx.arange(keys_len - length, keys_len)[:, None]
        mask = rows >= mx.arange(keys_len)[None]
    if mask is not None:
        mask = _by_group(mask, kv_heads, group)
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    weights = mx.softmax(scores, axis=-1).astype(values.dtype)
    out = weights.reshape(batch, kv_heads, group * length, keys_len) @ values
    return out.reshape(batch, heads, length, values.shape[-1])


def _by_group(mask: mx.array, kv_heads: int, group: int) -> mx.array:
    """A mask broadcastable to [B, H, L, S] as one to [B, KV, G, L, S]."""
    while mask.ndim < 4:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def fast_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` for macspec's own models (the DFlash drafter's
    block), routed as mlx-lm's is."""
    if _engages(queries, keys, None, mask, None):
        return attend(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def routed(original):
    """mlx-lm's `scaled_dot_product_attention(q, k, v, cache, scale, mask, sinks=None)`."""

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if _engages(queries, keys, cache, mask, sinks):
            return attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    attention.__wrapped__ = original
    return attention


def install() -> int:
    """Route attention in every loaded `mlx_lm.models.*` module through here; idempotent.
    -> the number of modules patched now."""
    return route_model_modules(PATCHED, {"scaled_dot_product_attention": routed}, skip=("mlx_lm.models.base",))
