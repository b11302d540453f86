"""Seed the planner's cost model at start: the target forward at a few (rows, window) shapes,
and the proposer's chain step at one row and at four, so the first requests plan from
measurements instead of guesses (the model refines itself online after that). A model proposer
first asked for by a request (not the profile's) is timed when its group is made: its chain
runs inside the step's one sync, so nothing times it online, and an untimed chain looks free."""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from .. import proposers
from ..sampling import Rng, RowContext, SamplingParams
from .base import ChainRow
from .speculator import Speculator

logger = logging.getLogger(__name__)


def calibrate(speculator: Speculator, runner, method: str, max_batch: int) -> None:
    """`runner.time_forward(rows, window, repeats)` times the target; `runner.states_width` is
    the width of the states heads read (wider once an EAGLE-3 head's layers are tapped)."""
    k_max = max(1, speculator.settings.num_draft_tokens)
    # The largest batch too: on a CPU a wide batch leaves the bandwidth-bound regime.
    # An MoE target's window cost is curved (the experts it reads): one more window to fit it.
    windows = sorted({1, 2, k_max + 1}) if speculator.planner.forward.moe else (1, k_max + 1)
    for rows in sorted({1, min(4, max_batch), max_batch}):
        for window in windows:
            for seconds in runner.time_forward(rows, window, 3)[1:]:  # the first pays one-off costs
                speculator.planner.forward.observe(rows, window, seconds)
    if method != proposers.PLAIN:
        speculator.guarded("cost_model", _calibrate_chain, speculator, method, k_max,
                           runner.states_width, drop=method)
    # A head loaded later (a request's method) may tap layers: read the width then.
    speculator.calibrate_chain = lambda other: _calibrate_chain(speculator, other, k_max,
                                                                runner.states_width)
    costs = speculator.planner.as_dict()
    logger.info("calibrated step costs (ms): target %s, draft chain %s", costs["forward_ms"],
                costs["draft_chain_step_ms"])


PROCESSED = SamplingParams(temperature=0.7)  # a sampled row: what processed drafting costs


def _calibrate_chain(speculator: Speculator, method: str, k_max: int, width: int) -> None:
    """Seconds per chain step of a model proposer, on scratch rows of a scratch group: plain
    greedy at one and four rows, and one sampled row (its processed distribution per draft)."""
    seconds = {}
    for count, params in ((1, SamplingParams()), (4, SamplingParams()), ("sampled", PROCESSED)):
        seconds[count] = _time_chain(speculator, method, k_max, width, 1 if count == "sampled" else count,
                                     params)
        if seconds[count] is None:
            return
    speculator.planner.calibrate_proposer(method, seconds[1], 4, seconds[4])
    speculator.planner.processed_cost[method] = max(0.0, seconds["sampled"] - seconds[1])


def _time_chain(speculator: Speculator, method: str, k_max: int, width: int, count: int,
                params: SamplingParams) -> float | None:
    """Seconds per chain step over `count` scratch rows drafting with `params` (None: a host
    proposer, timed as it runs)."""
    group = speculator.make_group(method)
    if not group.lazy_chain:
        return None
    committed = list(range(1, 18))
    # Random states, not zeros: an MoE head routes zeros of every row to the same experts.
    states = mx.random.normal((16 + 3 * count, width), key=mx.random.key(count))
    hidden = states[:16] if group.needs_hidden else None
    for key in range(count):
        group.join(key, committed, hidden)
    times = []
    for repeat in range(3):
        rows = [ChainRow(key, RowContext(params, committed), k_max, Rng(0))
                for key in range(count)]
        for key in range(count):
            group.observe(key, states[16 + 3 * key + repeat][None])
        t0 = time.perf_counter()
        drafts = group.propose(rows)
        mx.eval([d.tokens for d in drafts.values()], group.cache_arrays())
        times.append((time.perf_counter() - t0) / k_max)
        group.settle({})
        committed = committed + [1]
    return min(times[1:])
