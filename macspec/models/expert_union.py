"""Each distinct expert read once per step: the MoE layers of a multi-token forward (a verify
window, a batch of rows) grouped by expert.

mlx-lm's `SwitchGLU` groups a step's (token, expert) pairs by expert only from 64 pairs; below
that every pair is its own gather (MLX's CPU `gather_mm` reads the expert's weights again for each
pair, and Metal's `gather_qmm` reuses them across rows only from 4 rows per expert), so an expert
that two positions of a window share is read twice. Here the step's distinct experts are found on
the host, each expert's tokens are stacked into one block of rows (padded to the busiest
expert's count), and every projection is one gather whose batch entry is an expert: its weights
are read once for all its rows. The result is laid back out per (token, slot) exactly as
mlx-lm's, so the caller's gate-weighted sum over slots is unchanged.

One switch (the profile's `model.expert_union`, on by default) routes `SwitchGLU.__call__` here
for steps of MIN_TOKENS tokens or more, prefill chunks included (on this CPU mlx-lm's sorted
path, from 64 pairs, reads the expert per pair too: 2,048 tokens took 5.0 s there, 0.55 s here);
one token (plain decoding at one row) stays on mlx-lm's path: nothing to share. So do quantized
experts on the CPU backend, where MLX's quantized matmul of stacked rows is slower than its
per-pair matvecs (4-bit tiny-moe: 1.4-2.2x); on Metal stacked rows take `qmm`, which reads an
expert once per block of rows (from MLX's kernel selection; not measured here). On CUDA the
layout's host round trip drains the GPU's queue once per MoE layer: on an H200 tiny-moe's
2-token window took 5.9 ms through here against 2.5 ms on mlx-lm's path, and 4 or 16 rows
6.7-8.0 ms against 3.6-4.2 (docs/benchmarks.md, "On an NVIDIA GPU"), so CUDA keeps mlx-lm's
path. Metal's queue drains the same way; whether its saved reads pay for it is not measured.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .switch import Switch, on_cuda

# Tokens per step from which the union runs: on tiny-moe (trained-like routing, 2026-11-26) a
# 2-token window took 0.99x mlx-lm's time, 3 tokens 0.89x, 4-8 0.66-0.76x, batches 0.3-0.7x.
MIN_TOKENS = 2
PATCHED = "_macspec_expert_union"
_switch = Switch()  # the profile's model.expert_union
enable = _switch.set
mlx_lm_path = _switch.off  # mlx-lm's own path inside: the reference


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


def union_glu(glu, x: mx.array, indices: mx.array) -> mx.array:
    """`SwitchGLU(x, indices)` with each distinct expert's weights read once: x [..., D],
    indices [..., K] -> [..., K, D], the same layout mlx-lm returns."""
    lead, top_k = indices.shape[:-1], indices.shape[-1]
    experts, rows, where = layout(np.array(indices.reshape(-1, top_k)))
    used = mx.array(experts)
    stacked = x.reshape(-1, x.shape[-1])[mx.array(rows)]  # [U, M, D]
    up = glu.up_proj(stacked, used)
    gate = glu.gate_proj(stacked, used)
    out = glu.down_proj(glu.activation(up, gate), used)  # [U, M, D]
    out = out.reshape(-1, out.shape[-1])[mx.array(where)]  # [N, K, D]
    return out.reshape(*lead, top_k, out.shape[-1])


def _engages(glu, indices: mx.array) -> bool:
    tokens = indices.size // indices.shape[-1]
    # MLX's CPU quantized matmul is fast only as a matvec: stacked rows cost 1.4-2.2x there.
    quantized_on_cpu = hasattr(glu.up_proj, "scales") and mx.default_device() == mx.cpu
    # On CUDA the layout's host round trip costs 2x what it saves (the module's docstring).
    return _switch.on and tokens >= MIN_TOKENS and not quantized_on_cpu and not on_cuda()


def install() -> bool:
    """Route mlx-lm's SwitchGLU through here (where the switch is on); idempotent."""
    from mlx_lm.models import switch_layers

    cls = switch_layers.SwitchGLU
    if getattr(cls, PATCHED, False):
        return False
    original = cls.__call__

    def call(self, x, indices):
        return union_glu(self, x, indices) if _engages(self, indices) else original(self, x, indices)

    cls.__call__ = call
    setattr(cls, PATCHED, True)
    return True
