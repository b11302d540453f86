"""Each distinct expert read once per step: the MoE layers of a multi-token forward (a verify
window, a batch of rows, a prefill chunk) grouped by expert.

mlx-lm's `SwitchGLU` sorts a step's (token, expert) pairs by expert only from 64 pairs; below
that each pair is its own gather in routing order, so an expert that two positions of a window
share is read twice from memory (MLX's CPU `gather_mm` is one matvec per pair; Metal's
`gather_qmm` reuses weights across rows only from 4 rows per expert). Two groupings, each where
it measured best on this CPU (tiny-moe's MoE layers, float32, 2026-11-27):
- **sorted** (a verify window, a decode batch): the pairs sorted by expert in the graph, then
  mlx-lm's per-pair matvecs in that order, so an expert's later pairs find its weights in cache.
  No host round trip. A 4-token window: 0.79x mlx-lm's forward, under the bytes floor.
- **stacked** (prefill; from STACK_FROM pairs per expert on average): the distinct experts found on
  the host, each expert's tokens stacked into one block of rows (padded to the busiest expert's
  count) and every projection one gemm per expert. A gemm of a few rows costs more here than as
  many cached matvecs (a 4-token window: 1.3x sorted), plus a host round trip per layer; from
  ~32 rows per expert the gemm wins (256 and 512 tokens: 0.78x sorted).
Both lay the result out per (token, slot) exactly as mlx-lm's, so the caller's gate-weighted sum
is unchanged. One switch (the profile's `model.expert_union`, on by default) routes
`SwitchGLU.__call__` here for steps of 2 tokens or more; one token (plain decoding at one row)
stays on mlx-lm's path. Quantized experts on the CPU backend stay there too: MLX's CPU quantized
matvec is compute-bound (sorting gains nothing: 4-bit, 0.99-1.02x) and its stacked `qmm` is slower
(1.4-2.2x). On Metal the stacked rows take `qmm`/`gather_mm`, which read an expert once per block
of rows (from MLX's kernel selection; not measured here), so Metal stacks every multi-token step.
On CUDA the stacked layout's host round trip drains the GPU's queue once per MoE layer: on an H200
tiny-moe's 2-token window took 5.9 ms stacked against 2.5 ms on mlx-lm's path, and 4 or 16 rows
6.7-8.0 ms against 3.6-4.2 (docs/benchmarks.md, "On an NVIDIA GPU"), so CUDA keeps mlx-lm's path
(sorting there is not measured).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from .switch import Switch, on_cuda

MIN_TOKENS = 2  # one token has nothing to share
# (Token, expert) pairs per expert, on average over all experts, from which stacking beats
# sorting on the CPU: tiny-moe's forward (64 experts, top 8) at 128 tokens (16 a expert) took
# 1.33x sorted's time stacked, at 256 tokens (32) 0.78x, at 512 0.79x.
STACK_FROM = 32
PATCHED = "_macspec_expert_union"
_switch = Switch()  # the profile's model.expert_union
enable = _switch.set
mlx_lm_path = _switch.off  # mlx-lm's own path inside: the reference
_forced: list[str] = []  # a grouping the benchmarks impose on every multi-token step


def layout(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's routing [N, K] -> (its distinct experts [U], the token of each expert's rows
    [U, M] (padded with token 0), each (token, slot)'s flat row u·M + m [N, K])."""
    tokens, top_k = indices.shape
    flat = indices.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    group = np.repeat(np.arange(len(experts)), counts)
    rank = np.arange(flat.size) - starts[group]
    width = int(counts.max())
    rows = np.zeros((len(experts), width), np.int32)
    rows[group, rank] = order // top_k
    where = np.empty(flat.size, np.int32)
    where[order] = group * width + rank
    return experts.astype(np.uint32), rows, where.reshape(tokens, top_k)


def stacked_glu(glu, x: mx.array, indices: mx.array) -> mx.array:
    """`SwitchGLU(x, indices)` with each distinct expert's weights read once, its rows stacked:
    x [..., D], indices [..., K] -> [..., K, D], the same layout mlx-lm returns."""
    lead, top_k = indices.shape[:-1], indices.shape[-1]
    experts, rows, where = layout(np.array(indices.reshape(-1, top_k)))
    used = mx.array(experts)
    stacked = x.reshape(-1, x.shape[-1])[mx.array(rows)]  # [U, M, D]
    up = glu.up_proj(stacked, used)
    gate = glu.gate_proj(stacked, used)
    out = glu.down_proj(glu.activation(up, gate), used)  # [U, M, D]
    out = out.reshape(-1, out.shape[-1])[mx.array(where)]  # [N, K, D]
    return out.reshape(*lead, top_k, out.shape[-1])


def sorted_glu(glu, x: mx.array, indices: mx.array) -> mx.array:
    """`SwitchGLU(x, indices)` with the pairs taken in expert order (mlx-lm's sorted path at any
    size): x [..., D], indices [..., K] -> [..., K, D]. All in the graph: no host round trip."""
    top_k = indices.shape[-1]
    flat = mx.stop_gradient(indices).reshape(-1)
    order = mx.argsort(flat)
    rows = x.reshape(-1, 1, x.shape[-1])[order // top_k]  # [N·K, 1, D]: each pair's token
    experts = flat[order]
    up = glu.up_proj(rows, experts, sorted_indices=True)
    gate = glu.gate_proj(rows, experts, sorted_indices=True)
    out = glu.down_proj(glu.activation(up, gate), experts, sorted_indices=True)  # [N·K, 1, D]
    return out[mx.argsort(order)].reshape(*indices.shape, x.shape[-1])


def path(glu, indices: mx.array) -> str | None:
    """The grouping a step takes: "sorted", "stacked", or None (mlx-lm's own path)."""
    tokens, top_k = indices.size // indices.shape[-1], indices.shape[-1]
    if _forced and _switch.on and tokens >= MIN_TOKENS:
        return _forced[-1]
    cpu = mx.default_device() == mx.cpu
    # MLX's CPU quantized matmul: sorting gains nothing, stacking costs 1.4-2.2x (the docstring).
    # On CUDA the stacked layout's host round trip costs 2x what it saves; sorting not measured.
    if not _switch.on or tokens < MIN_TOKENS or (cpu and hasattr(glu.up_proj, "scales")) or on_cuda():
        return None
    experts = glu.up_proj.weight.shape[0]
    return "stacked" if not cpu or tokens * top_k >= STACK_FROM * experts else "sorted"


GROUPINGS = {"sorted": sorted_glu, "stacked": stacked_glu}


@contextmanager
def forced(grouping: str):
    """Every multi-token step grouped `grouping`'s way, on any backend and dtype (the benchmarks'
    candidates beside the engine's choice)."""
    _forced.append(grouping)
    try:
        yield
    finally:
        _forced.pop()


def install() -> bool:
    """Route mlx-lm's SwitchGLU through here (where the switch is on); idempotent."""
    from mlx_lm.models import switch_layers

    cls = switch_layers.SwitchGLU
    if getattr(cls, PATCHED, False):
        return False
    original = cls.__call__

    def call(self, x, indices):
        grouping = path(self, indices)
        return GROUPINGS[grouping](self, x, indices) if grouping else original(self, x, indices)

    cls.__call__ = call
    setattr(cls, PATCHED, True)
    return True
