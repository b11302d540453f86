"""Small matmuls at the row count this machine runs fastest (MLX's CPU backend, float32).

A decode step multiplies each weight by rows × window tokens, a handful. OpenBLAS splits a
product's rows between its threads and runs them through fixed-size kernels, and some row counts
leave a slow tail: on this 2-core machine (Haswell kernels, 2 threads) a 576 x 1536 product took
290 µs at 6 rows and 174 µs at 8, and SmolLM2's forward at 3 rows x a window of 2 cost 1.30-1.44x
its 3-row step (so drafting at three rows paid only above ~0.4 acceptance). Which counts are slow
depends on the library, its kernels and its threads, so it is measured (measured_table(), through
the loaded model's own weights), and a product of m rows runs at the count p >= m measured
fastest, padded with zero rows whose outputs are dropped. Each output row is its own
dot products, so padding changes no value beyond the kernel's rounding (as any batch size does).

One switch (the profile's `model.cpu_row_padding`, on by default); the measured table is kept per
machine in the cache dir. MACSPEC_ROW_PADS=none runs every product as given (the test suite's
default: a table measured under load must not pick which kernel a test's greedy tokens see).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..paths import cache_dir, read_json, update_json
from ..progress import phase
from .switch import Switch

logger = logging.getLogger(__name__)

TOP_ROWS = 64  # row counts measured; a product of more rows runs as given (its tail is a fraction)
PAD_GAIN = 0.05  # a padded count must be this much faster: the timings' noise is not a gain
REPEATS = 3  # timings per count, interleaved across counts, the least kept (noise only adds)
SAMPLE_BYTES = 64 << 20  # weights timed per run (every stride-th layer's): more than a CPU caches
PADS_FILE = "row-pads.json"  # in the cache dir
ENV = "MACSPEC_ROW_PADS"  # "none": every product as given

_switch = Switch()
enable = _switch.set
_table: list[int] | None = None  # rows -> the rows it runs at (index 0 unused)


def choose(seconds: dict[int, float], gain: float = PAD_GAIN) -> list[int]:
    """Row counts measured -> the count each runs at: the fastest count at or above it, where that
    is faster by `gain` (else its own)."""
    top = max(seconds)
    table = [0]
    for rows in range(1, top + 1):
        best = min(range(rows, top + 1), key=lambda p: (seconds[p], p))
        table.append(best if seconds[best] < (1.0 - gain) * seconds[rows] else rows)
    return table


def rows_for(rows: int) -> int:
    """The count a product of `rows` rows runs at now."""
    if not _switch.on or _table is None or rows >= len(_table):
        return rows
    return _table[rows]


@contextmanager
def fixed(table: list[int]):
    """Run with this table (tests: a padding chosen by hand, not by a timing)."""
    global _table
    before, _table = _table, table
    try:
        with _switch.held(True):
            yield
    finally:
        _table = before


def padded(x: mx.array, product) -> mx.array:
    """product(x), its rows run at the table's count for them."""
    width = x.shape[-1]
    rows = x.size // width if width else 0
    to = rows_for(rows) if x.dtype == mx.float32 and mx.default_device() == mx.cpu else rows
    if to == rows:
        return product(x)
    out = _run_at(x.reshape(rows, width), to, product)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _run_at(x: mx.array, to: int, product) -> mx.array:
    """product(x) for 2-D x, run at `to` rows: zero rows added, their outputs cut."""
    if to == x.shape[0]:
        return product(x)
    return product(mx.pad(x, [(0, to - x.shape[0]), (0, 0)]))[: x.shape[0]]


class PaddedLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return padded(x, super().__call__)


class PaddedEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied output head
        return padded(x, super().as_linear)


def route(model) -> int:
    """Run `model`'s float Linear layers (and a tied head) through the table, measuring it on this
    model's weights if this process has none yet; none where no count runs padded (a product then
    pays no wrapper). -> the layers routed now."""
    global _table
    if not _switch.on or mx.default_device() != mx.cpu:
        return 0
    layers = [m for _, m in model.named_modules()
              if type(m) in (nn.Linear, nn.Embedding) and m.weight.dtype == mx.float32]
    if not layers:
        return 0
    if _table is None:
        _table = [] if os.environ.get(ENV) == "none" else _kept_or_measured([m.weight for m in layers])
    if all(to == rows for rows, to in enumerate(_table)):
        return 0
    for layer in layers:
        layer.__class__ = PaddedLinear if type(layer) is nn.Linear else PaddedEmbedding
    return len(layers)


def _kept_or_measured(weights: list[mx.array]) -> list[int]:
    from ..blas import blas_info

    blas = blas_info()
    shapes = sorted(Counter(tuple(w.shape) for w in weights).items())
    key = hashlib.sha256(json.dumps([shapes, blas.config, blas.core, blas.threads, platform.machine(),
                                     os.cpu_count(), mx.__version__]).encode()).hexdigest()[:20]
    path = cache_dir() / PADS_FILE
    kept = read_json(path).get(key)
    if isinstance(kept, list) and kept and all(isinstance(p, int) and p >= r for r, p in enumerate(kept)):
        return kept
    with phase("timing small matmuls"):
        table = measured_table(weights)
    logger.info("row counts run padded on this machine: %s",
                {rows: to for rows, to in enumerate(table) if to != rows} or "none")
    update_json(path, lambda stored: {**stored, key: table}, "row pads")
    return table


def measured_table(weights: list[mx.array], top: int = TOP_ROWS) -> list[int]:
    """Two passes over a forward's products: every count's products alone pick a candidate
    (choose()); then each candidate is timed as it runs, padded and cut back, against its count as
    given, and kept where it is faster by PAD_GAIN. The pad and the cut are two more operations
    per product (~3.5 ms of SmolLM2's ~45 ms forward here)."""
    alone = measure(weights, [(rows, rows) for rows in range(1, top + 1)])
    candidates = choose({rows: seconds for (rows, _), seconds in alone.items()})
    pairs = [(rows, to) for rows, to in enumerate(candidates) if to != rows]
    timed = measure(weights, pairs + [(rows, rows) for rows, _ in pairs])
    return [to if to == rows or timed[rows, to] < (1.0 - PAD_GAIN) * timed[rows, rows] else rows
            for rows, to in enumerate(candidates)]


def measure(weights: list[mx.array], runs: list[tuple[int, int]], repeats: int = REPEATS) -> dict[tuple[int, int], float]:
    """Seconds of a forward's products (the model's own weights, every stride-th where they exceed
    SAMPLE_BYTES, scaled) for each (rows, run at): the least of `repeats` rounds, each timing every
    run once (a neighbour's burst meets them all). The weights are the model's, read from memory
    as a step reads them: one weight timed over and over stays in cache, and there 2-4 rows read
    faster padded to 8, while a SmolLM2 step at one row x a window of 2 was as fast either way."""
    stride = max(1, -(-sum(w.nbytes for w in weights) // SAMPLE_BYTES))
    sample = weights[::stride]
    scale = sum(w.nbytes for w in weights) / sum(w.nbytes for w in sample)
    key = mx.random.key(0)  # not the process's random state
    inputs = {(rows, width): mx.random.normal((rows, width), key=key)
              for rows in {r for r, _ in runs} for width in {w.shape[1] for w in sample}}
    mx.eval(inputs)
    best = {run: float("inf") for run in runs}
    for _ in range(repeats):
        for rows, to in runs:
            start = time.perf_counter()
            mx.eval([_run_at(inputs[rows, w.shape[1]], to, lambda a, w=w: a @ w.T) for w in sample])
            best[rows, to] = min(best[rows, to], time.perf_counter() - start)
    return {run: seconds * scale for run, seconds in best.items()}


def status() -> dict:
    """For /v1/status: the row counts run padded here, and at which count (none: all as given)."""
    return {"on": _switch.on, "padded": {str(rows): to for rows, to in enumerate(_table or []) if to != rows}}


def table() -> list[int]:
    """The table in use ([] for none yet, or none measured): what a step's cost depends on."""
    return list(_table or [])
