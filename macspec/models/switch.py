"""The paths macspec installs into mlx-lm (cpu_prefill, window_attention, expert_union): an
on/off the profile sets at load (Runtime.load and the TP workers) and tests and benchmarks turn
off for a reference run, and the one routine that routes mlx-lm's model modules through them."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from functools import cache

import mlx.core as mx


class Switch:
    def __init__(self, on: bool = True) -> None:
        self.on = on

    def set(self, on: bool) -> None:
        self.on = on

    def off(self):
        """mlx-lm's own path inside (a reference to compare with)."""
        return self.held(False)

    @contextmanager
    def held(self, on: bool):
        """On or off inside, as it was after."""
        before, self.on = self.on, on
        try:
            yield
        finally:
            self.on = before


def route_model_modules(patched: str, wrappers: dict, skip: tuple[str, ...] = ()) -> int:
    """In every loaded `mlx_lm.models.*` module (but `skip`), replace each function named in
    `wrappers` by wrapper(original); `patched` marks a module done (idempotent).
    -> the number of modules patched now."""
    count = 0
    for name in [n for n in list(sys.modules) if n.startswith("mlx_lm.models.")]:
        module = sys.modules.get(name)
        if module is None or getattr(module, patched, False) or name in skip:
            continue
        for function, wrap in wrappers.items():
            if callable(getattr(module, function, None)):
                setattr(module, function, wrap(getattr(module, function)))
        setattr(module, patched, True)
        count += 1
    return count


@cache
def cuda_backend() -> bool:
    """MLX's CUDA backend is this process's GPU (fixed once MLX is loaded)."""
    return not mx.metal.is_available() and hasattr(mx, "cuda") and mx.cuda.is_available()


def on_cuda() -> bool:
    """Arrays go to a CUDA GPU by default."""
    return mx.default_device() == mx.gpu and cuda_backend()
