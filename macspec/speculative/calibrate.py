"""Seed the step-cost table at start (costs.py), so the first steps plan from measurements: the
target forward at 1, 4 and the largest batch, windows 1, 2 and k_max + 1, and each model
proposer's chain step at one row and at four, added for the chain's depth. Every real step then
replaces its cell's seed. A model proposer first asked for by a request (not the profile's) is
timed when its group is made.

A table an earlier run kept (kept.py) seeds the start instead, when it holds every forward
cell: timing takes 1-4 s on a CPU, ~20 s under load. Its cells are seeds, so today's steps
re-measure them (a seed's first real step rescales its bucket's other seeds)."""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from .. import proposers
from ..progress import phase
from ..sampling import Rng, RowContext, SamplingParams
from .base import ChainRow, ProposerGroup
from .speculator import Speculator

logger = logging.getLogger(__name__)


def calibrate(speculator: Speculator, runner, method: str, max_batch: int,
              cached: dict[tuple[str, int, int], float] | None = None) -> bool:
    """`runner.time_forward(rows, window, repeats)` times the target; `runner.states_width` is
    the width of the states heads read (wider once an EAGLE-3 head's layers are tapped).
    `cached`: an earlier run's table (kept.load_costs); used when it holds every forward cell timed
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
