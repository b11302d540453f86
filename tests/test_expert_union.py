"""MoE steps read each distinct expert once (models/expert_union.py) and compute what mlx-lm's
SwitchGLU computes; tiny-moe's routers route as fitted (models/upcycle.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from macspec.models import expert_union, upcycle

EXPERTS, TOP_K, D, H = 16, 4, 64, 64


def routing(tokens: int, seed: int) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)]).astype(np.uint32))


@pytest.mark.parametrize("grouping", ["sorted", "stacked"])
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("shape", [(1, 2), (2, 4), (4, 8), (1, 70)])
def test_groupings_compute_what_mlx_lm_computes(grouping, bits, shape):
    glu = SwitchGLU(D, H, EXPERTS)
    if bits:
        nn.quantize(glu, group_size=32, bits=bits)
    mx.eval(glu.parameters())
    x = mx.random.normal((*shape, D), key=mx.random.key(shape[1]))
    indices = routing(shape[0] * shape[1], shape[1]).reshape(*shape, TOP_K)
    with expert_union.mlx_lm_path():
        reference = glu(x, indices)
    # (Quantized experts take these paths on Metal only; here they are called directly.)
    # A gemm row and a gemv, or one matvec kernel and another, may round differently (~1e-7 here;
    # a dense layer's rows differ by ~1e-5 between one position and a window).
    grouped = expert_union.GROUPINGS[grouping](glu, x, indices)
    assert mx.allclose(grouped, reference, rtol=1e-5, atol=1e-6)


def test_a_step_groups_by_its_size():
    glu = SwitchGLU(D, H, EXPERTS)
    one, window, chunk = (routing(n, 0) for n in (1, 4, 8 * EXPERTS))
    assert expert_union.path(glu, one) is None  # plain decoding at one row: mlx-lm's own path
    assert expert_union.path(glu, window) == "sorted"  # a verify window: cached matvecs
    assert expert_union.path(glu, chunk) == "stacked"  # a prefill chunk: one gemm per expert
    with expert_union.mlx_lm_path():
        assert expert_union.path(glu, window) is None


def test_layout_reads_each_expert_once():
    indices = np.array([[0, 1], [1, 2], [1, 0]])
    experts, rows, where = expert_union.layout(indices)
    assert experts.tolist() == [0, 1, 2]  # three reads for six (token, expert) pairs
    flat = rows.reshape(-1)
    assert all(flat[where[t, j]] == t for t in range(3) for j in range(2))


def drifting_states(tokens: int = 3000, dims: int = 48, seed: int = 0) -> np.ndarray:
    """Hidden states with slow and fast components, as a language model's residual stream."""
    rng = np.random.default_rng(seed)
    keep = np.r_[np.zeros(dims // 2), np.linspace(0.9, 0.99, dims - dims // 2)]  # memory per component
    states = np.zeros((tokens, dims))
    for t in range(1, tokens):
        states[t] = keep * states[t - 1] + np.sqrt(1 - keep ** 2) * rng.normal(size=dims)
    return states + 3.0 * np.random.default_rng(99).normal(size=dims)  # a mean: the popularity the fit removes


def test_routers_fit_the_published_overlap_and_independence():
    states = drifting_states()
    trained = upcycle.fit_router(states, "trained", seed=0)
    independent = upcycle.fit_router(states, "independent", seed=0)
    held_out = drifting_states(seed=1)
    assert upcycle._overlap(held_out, trained) == pytest.approx(upcycle.NEXT_TOKEN_OVERLAP, abs=0.06)
    chance = upcycle.TOP_K / upcycle.EXPERTS
    assert upcycle._overlap(held_out, independent) < chance + 0.05
