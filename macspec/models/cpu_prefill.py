"""Prefill at the machine's speed on MLX's CPU backend: attention and the gated MLP's SiLU.

MLX's CPU `exp` is scalar and slow, and a long prefill is mostly exps: for SmolLM2, one layer's
attention for a 512-token chunk over a 4,096-token history took 543 ms, 348 of them in `exp`
(19M scores), and the MLP's SiLU (`swiglu`) took as long as its three matmuls together. Here the
same arithmetic runs in NumPy, whose `exp` is vectorised: attention as one sgemm per KV head with
the query heads of its group stacked (GQA), the softmax in place, blocks of query rows spread over
the cores; SiLU·up likewise. Results equal MLX's up to float rounding (max |Δ| ~1e-7 on
unit-scale inputs).

One switch (the profile's `model.cpu_prefill`, on by default) routes mlx-lm's
`scaled_dot_product_attention` and `swiglu` in the model modules macspec loads through here; only
blocks of at least MIN_QUERIES positions on the CPU device in float32 take this path (no attention
sinks, no quantized KV cache, no MoE expert batches). Decode and verification windows stay on
MLX, so a plain run and a speculative one share every path: both prefill here, decode there.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import numpy as np

from .switch import Switch, route_model_modules

logger = logging.getLogger(__name__)

MIN_QUERIES = 64  # positions per block below which MLX runs (decode, verify windows)
ROW_BLOCK = 64  # query rows per unit of work: 3 heads x 64 x 4k scores stay in a 1 MB L2
PATCHED = "_macspec_cpu_prefill"  # set on a module once its functions are routed here
_switch = Switch()  # the profile's model.cpu_prefill
enable = _switch.set
mlx_only = _switch.off  # mlx-lm's own path inside: the reference


def _here(x: mx.array, positions: int) -> bool:
    return (_switch.on and positions >= MIN_QUERIES and x.dtype == mx.float32
            and mx.default_device() == mx.cpu)


def routed_attention(original):
    """mlx-lm's `scaled_dot_product_attention(q, k, v, cache, scale, mask, sinks=None)`."""

    def attention(queries, keys, values, cache, scale, mask, sinks=None):
        if (not _here(queries, queries.shape[2]) or sinks is not None or hasattr(cache, "bits")
                or not (mask is None or isinstance(mask, mx.array) or mask == "causal")):
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        return attend(queries, keys, values, scale, mask)

    attention.__wrapped__ = original
    return attention


def routed_swiglu(original):
    """mlx-lm's `swiglu(gate, x)` = silu(gate) * x, for dense (batch, positions, width) blocks."""

    def swiglu(gate, x):
        if gate.ndim != 3 or gate.shape != x.shape or x.dtype != gate.dtype or not _here(gate, gate.shape[1]):
            return original(gate, x)
        return gated_silu(gate, x)

    swiglu.__wrapped__ = original
    return swiglu


def gated_silu(gate: mx.array, x: mx.array) -> mx.array:
    """gate · sigmoid(gate) · x, rows spread over the cores."""
    mx.eval(gate, x)
    g, u = np.asarray(gate), np.asarray(x)
    width = g.shape[-1]
    g2, u2 = g.reshape(-1, width), u.reshape(-1, width)
    out = np.empty_like(g2)

    def rows(part: slice) -> None:
        block = np.negative(g2[part])
        with np.errstate(over="ignore"):  # exp(-gate) = inf: gate / inf = -0, silu's own limit
            np.exp(block, out=block)
        block += np.float32(1)
        np.divide(g2[part], block, out=block)
        np.multiply(block, u2[part], out=out[part])

    pool, _, cores = _workers()
    step = max(1, -(-len(g2) // cores))
    list(pool.map(rows, [slice(r, r + step) for r in range(0, len(g2), step)]))
    return mx.array(out.reshape(g.shape))


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """softmax(scale · Q Kᵀ + mask) V for Q (B, Hq, L, D), K (B, Hkv, S, D), V (B, Hkv, S, Dv);
    mask None, "causal" (the L queries are the last L of the S positions) or an array
    broadcastable to (B, Hq, L, S): boolean (True attends) or additive."""
    arrays = [queries, keys, values] + ([mask] if isinstance(mask, mx.array) else [])
    mx.eval(*arrays)
    q, k, v = (np.asarray(a) for a in arrays[:3])
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    bias = _bias(mask, B, Hq, L, S, np.asarray(arrays[3]) if len(arrays) > 3 else None)
    out = np.empty((B, Hq, L, Dv), dtype=np.float32)
    scale = np.float32(scale)

    def one(b: int, h: int, rows: slice) -> None:  # a KV head, its group's query heads stacked
        heads = slice(h * group, (h + 1) * group)
        n = rows.stop - rows.start
        scores = ((q[b, heads, rows] * scale).reshape(group * n, D) @ k[b, h].T).reshape(group, n, S)
        if bias is not None:
            scores += _bias_rows(bias, b, heads, rows)
        peak = scores.max(axis=-1, keepdims=True)
        np.maximum(peak, np.float32(-3e38), out=peak)  # a fully masked row: exp gives 0, not nan
        np.subtract(scores, peak, out=scores)
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        np.maximum(total, np.float32(1e-30), out=total)
        mixed = scores.reshape(group * n, S) @ v[b, h]
        out[b, heads, rows] = mixed.reshape(group, n, Dv) / total

    # NumPy's exp, max and sum run on one core and release the GIL: blocks of query rows go to
    # one worker per core, each block's scores small enough to stay in cache, NumPy's BLAS on
    # one thread meanwhile (its own threads would fight the workers: 2.5x slower here).
    blocks = [(b, h, slice(r, min(r + ROW_BLOCK, L))) for b in range(B) for h in range(Hkv)
              for r in range(0, L, ROW_BLOCK)]
    pool, numpy_blas, _ = _workers()
    with numpy_blas.limit(limits=1):
        list(pool.map(lambda item: one(*item), blocks))
    return mx.array(out)


_WORKERS: list = []


def _workers():
    """-> (a thread pool with one worker per core, a threadpoolctl handle on NumPy's BLAS only
    (the one MLX uses here is macspec's own copy and keeps its threads), the worker count)."""
    if not _WORKERS:
        from concurrent.futures import ThreadPoolExecutor

        from threadpoolctl import ThreadpoolController

        from ..blas import blas_info

        ours = blas_info().library
        blas = ThreadpoolController().select(user_api="blas")
        numpy_blas = blas.select(filepath=[c.filepath for c in blas.lib_controllers if c.filepath != ours])
        cores = blas_info().threads or os.cpu_count() or 1  # macspec's share of the cores (TP ranks split them)
        _WORKERS.extend([ThreadPoolExecutor(cores, thread_name_prefix="macspec-prefill"), numpy_blas, cores])
    return tuple(_WORKERS)


def _bias_rows(bias: np.ndarray, b: int, heads: slice, rows: slice) -> np.ndarray:
    """The bias for these query rows (and heads, where it varies by head), over all positions."""
    if bias.ndim == 4:
        return bias[b, heads, rows]
    return bias[rows]


def _bias(mask, B: int, Hq: int, L: int, S: int, array: np.ndarray | None) -> np.ndarray | None:
    """The mask as an additive float32 bias: (L, S), or (B, Hq, L, S) when it varies by row."""
    if mask is None:
        return None
    if array is None:  # "causal": query i sees positions up to S - L + i
        allowed = np.arange(S)[None, :] <= (S - L) + np.arange(L)[:, None]
        return np.where(allowed, np.float32(0), np.float32(-np.inf))
    bias = np.where(array, np.float32(0), np.float32(-np.inf)) if array.dtype == np.bool_ \
        else array.astype(np.float32, copy=False)
    if bias.ndim <= 2:
        return np.broadcast_to(bias, (L, S))
    return np.broadcast_to(bias, (B, Hq, L, S))


def install() -> int:
    """Route attention and SiLU in every loaded `mlx_lm.models.*` module through here (where the
    switch is on); idempotent. -> the number of modules patched now."""
    return route_model_modules(PATCHED, {"scaled_dot_product_attention": routed_attention, "swiglu": routed_swiglu},
                               skip=("mlx_lm.models.base", "mlx_lm.models.activations"))
