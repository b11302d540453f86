"""Seed the step-cost table at start (costs.py), so the first steps plan from measurements: the
target forward at 1, 4 and the largest batch, windows 1, 2 and k_max + 1, and each model
proposer's chain step at one row and at four, added for the chain's depth. Every real step then
replaces its cell's seed. A model proposer first asked for by a request (not the profile's) is
timed when its group is made.

The table a run ends with is kept (cache dir, step-costs.json) under a key of what sets a step's
cost — the models' parameter shapes and dtypes, the method, k_max, the batch, the ranks, the
machine and its threads — and seeds the next start with those settings instead of timing them
again: 1-4 s on a CPU, ~20 s under load. Its cells are seeds, so today's steps re-measure them
(a seed's first real step rescales its bucket's other seeds)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import proposers
from ..paths import update_json
from ..progress import phase
from ..sampling import Rng, RowContext, SamplingParams
from .base import ChainRow, ProposerGroup
from .costs import StepCosts
from .speculator import Speculator

logger = logging.getLogger(__name__)

COSTS_FILE = "step-costs.json"  # in the cache dir
KEYS_KEPT = 32  # (models, settings, machine) entries; the least recently saved go first
CACHE_SCHEMA = 1  # bump when what a cell means changes


def calibrate(speculator: Speculator, runner, method: str, max_batch: int,
              cached: dict[tuple[str, int, int], float] | None = None) -> bool:
    """`runner.time_forward(rows, window, repeats)` times the target; `runner.states_width` is
    the width of the states heads read (wider once an EAGLE-3 head's layers are tapped).
    `cached`: an earlier run's table (load_table); used when it holds every forward cell timed
    here. -> whether the cache was used."""
    k_max = max(1, speculator.settings.num_draft_tokens)
    costs = speculator.policy.costs
    grid = [(rows, window) for rows in sorted({1, min(4, max_batch), max_batch})
            for window in sorted({1, 2, k_max + 1})]
    hit = bool(cached) and all(("", rows, window) in cached for rows, window in grid)
    forward: dict[tuple[int, int], float] = {}
    seed = lambda other: _seed_chain(speculator, other, k_max, runner.states_width, forward)  # noqa: E731
    if hit:
        for (chain, rows, window), seconds in cached.items():
            costs.seed(chain, rows, window, seconds)
        forward.update({(rows, window): costs.seconds("", rows, window) for rows, window in grid})
    else:
        with phase("calibrating the target's step cost"):
            for rows, window in grid:
                forward[rows, window] = min(runner.time_forward(rows, window, 3)[1:])  # the first pays one-off costs
                costs.seed("", rows, window, forward[rows, window])
            if method != proposers.PLAIN:
                speculator.guarded("cost_model", seed, method, drop=method)
    speculator.calibrate_chain = seed  # a head loaded later may tap layers: read the width then
    logger.info("%s step costs (ms): %s", "cached" if hit else "calibrated", costs.as_dict())
    return hit


def _seed_chain(speculator: Speculator, method: str, k_max: int, width: int, forward: dict) -> None:
    group = speculator.make_group(method)  # scratch groups: the rows they time are made up
    if not group.lazy_chain:
        return  # a lookup: its drafts cost host work only, measured with the step
    depth_cap = group.chain_k_max or k_max
    depth = min(k_max, depth_cap)  # a block of 4 drafts at most 3, whatever num_draft_tokens says
    one = _time_chain(group, depth, width, 1)
    four = _time_chain(speculator.make_group(method), depth, width, 4)
    for (rows, window), seconds in forward.items():
        if window > 1:
            chain_step = one + (four - one) * (rows - 1) / 3
            steps = 1 if group.block_drafts else min(window - 1, depth_cap)
            speculator.policy.costs.seed(method, rows, window, seconds + chain_step * steps)


def _time_chain(group: ProposerGroup, k_max: int, width: int, count: int) -> float:
    """Seconds per chain step over `count` scratch rows of a scratch model-proposer group."""
    committed = list(range(1, 18))
    # Random states, not zeros: an MoE head routes zeros of every row to the same experts.
    states = mx.random.normal((16 + 3 * count, width), key=mx.random.key(count))
    hidden = states[:16] if group.needs_hidden else None
    for key in range(count):
        group.join(key, committed, hidden)
    times = []
    for repeat in range(3):
        rows = [ChainRow(key, RowContext(SamplingParams(), committed), k_max, Rng(0)) for key in range(count)]
        for key in range(count):
            group.observe(key, states[16 + 3 * key + repeat][None])
        t0 = time.perf_counter()
        drafts = group.propose(rows)
        mx.eval([d.tokens for d in drafts.values()], group.cache_arrays())
        times.append((time.perf_counter() - t0) / (1 if group.block_drafts else k_max))
        group.settle({})
        committed = committed + [1]
    return min(times[1:])


# ---- the table kept between runs -------------------------------------------------------------
def cost_key(runtime, method: str, max_batch: int, ranks: int) -> str:
    """What sets a step's cost, hashed: the loaded models' parameter shapes and dtypes (not their
    values or paths: a copy or a retrained draft costs the same), the settings and the machine."""
    from ..blas import blas_info

    modules = [runtime.target.model, getattr(runtime.draft, "model", None), runtime.mtp_head, runtime.eagle3_head,
               runtime.dflash_drafter]
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    blas = blas_info()
    parts = {"schema": CACHE_SCHEMA, "models": [_shapes(m) for m in modules if m is not None],
             "method": method, "k_max": runtime.profile.speculative.num_draft_tokens,
             "max_batch": max_batch, "ranks": ranks, "hosts": runtime.profile.parallel.hosts,
             "device": str(mx.default_device()), "chip": info.get("device_name", ""),
             "cpu": platform.machine(), "cores": os.cpu_count(), "mlx": mx.__version__,
             "blas": [blas.name, blas.core, blas.threads]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _shapes(module) -> str:
    flat = tree_flatten(module.parameters()) if hasattr(module, "parameters") else []
    text = ";".join(f"{name}:{tuple(a.shape)}:{a.dtype}" for name, a in flat)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_table(path: Path, key: str) -> dict[tuple[str, int, int], float] | None:
    """An earlier run's table for `key`, or None (no file, no entry, unreadable)."""
    try:
        entry = json.loads(path.read_text()).get(key)
        cells = {(str(c), int(b), int(w)): float(s) for c, b, w, s in entry["cells"]}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return {cell: s for cell, s in cells.items() if s > 0} or None


def save_table(path: Path, key: str, costs: StepCosts) -> None:
    """Merge this table into `path`, keeping the KEYS_KEPT most recently saved keys."""
    def merged(stored: dict) -> dict:
        stored[key] = {"saved": time.time(), "cells": [[c, b, w, round(cell.seconds, 7)]
                                                       for (c, b, w), cell in sorted(costs.cells.items())]}
        saved = lambda k: stored[k].get("saved", 0) if isinstance(stored[k], dict) else 0  # noqa: E731
        return {k: stored[k] for k in sorted(stored, key=saved, reverse=True)[:KEYS_KEPT]}

    update_json(path, merged, "step costs")
