"""The policy on a simulated clock: step costs from tables measured on the development machine
(docs/benchmarks.md), acceptance drawn per draft position from a seeded stream, rows that each
keep their own estimate as the speculator does. No wall clock: every run is deterministic.

A run returns committed tokens per simulated second, so the policy (adaptive k) can be compared
with plain decoding and with every fixed k on the same streams.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from macspec.speculative.acceptance import METHOD_MEMORY, Acceptance, observe_step, remember, share_weight
from macspec.speculative.policy import Pace, PlanRow, Policy

# Target forward ms by batch size, per window W = 1..5 (docs/benchmarks.md: tiny-wide's from "MoE
# targets: the stand-in and its cost surface", 2026-11-24; tiny-moe's from `cost_surface.py --rows
# 1,4,16 --windows 1,2,3,4,5 --repeats 7`, 2026-11-28, its windows sorted by expert; SmolLM2 with
# its EAGLE-3 head, 2026-11-25), and the proposer chain's ms per draft step by batch size
# (tiny-wide: the distilled draft; tiny-moe: its MTP head, whose block is an MoE layer, set so a
# window of 2 costs what it did beside a plain step through serve, 1.32x / 1.70x / 1.68x at 1, 4
# and 16 rows, 2026-11-28).
TABLES = {
    "tiny-wide": ({1: [60.4, 76.7, 77.3, 77.9, 94.8], 4: [78.5, 70.7, 108.3, 95.8, 132.7],
                   16: [98.7, 145.1, 191.5, 236.9, 289.2]}, {1: 3.0, 4: 4.0, 16: 6.0}),
    "tiny-moe": ({1: [21.5, 23.9, 28.2, 34.0, 39.1], 4: [36.6, 52.7, 66.2, 75.8, 87.5],
                  16: [75.4, 111.6, 145.5, 175.7, 207.4]}, {1: 4.5, 4: 9.5, 16: 15.0}),
    "smollm2": ({1: [50.0, 58.0, 61.0, 64.0, 68.0]}, {1: 3.0}),
}

# Acceptance of draft i given 1..i-1 accepted, per position.
HEADS = {
    "useless": (0.0, 0.0, 0.0, 0.0),
    "weak": (0.3, 0.3, 0.3, 0.3),
    "eagle3": (0.45, 0.42, 0.47, 0.40),  # SmolLM2's EAGLE-3 head, held out
    "good": (0.75, 0.6, 0.6, 0.6),  # tiny-moe's MTP head
    "mtp-moe": (0.81, 0.39, 0.33, 0.33),  # tiny-moe's MTP head through serve, 2026-11-28
    "echo": (0.95, 0.95, 0.95, 0.95),  # a request restating its context
}
WARMING = 40  # tokens over which a warming request's acceptance rises
LOAD_PERIOD, LOADED = 80, 30  # a neighbour's bursts: steps apart, steps long
WARM_DRAFTS = 300  # a warm prior's drafted steps before a burst (METHOD_MEMORY's worth and more)


@dataclass
class Stream:
    """How acceptance moves over a request: steady, in easy and hard stretches, dropping to
    nothing half-way (a request that stops restating its context), or warming (hard right after
    its prompt, easier over its first WARMING tokens)."""

    head: str
    shape: str = "steady"  # "steady", "stretches", "drop", "warming"

    def alphas(self, rng: random.Random, step: int, steps: int, state: dict) -> list[float]:
        base = list(HEADS[self.head])
        if self.shape == "warming":
            swing = -0.3 + 0.4 * min(1.0, state.get("done", 0) / WARMING)
            return [min(0.97, max(0.0, a + swing)) for a in base]
        if self.shape == "stretches":
            if rng.random() < 0.05:
                state["hard"] = not state.get("hard", False)
            swing = -0.3 if state.get("hard") else 0.2
            return [min(0.97, max(0.0, a + swing)) if a else 0.0 for a in base]
        if self.shape == "drop" and step >= steps // 2:
            return [0.0] * len(base)
        return base


def step_seconds(table: str, size: int, window: int, chained: bool = True) -> float:
    """A step's seconds on `table` at batch `size`: the forward of `window` positions, plus the
    draft chain's window - 1 steps when `chained`."""
    forward, chain = TABLES[table]
    if not chained:
        return forward[size][window - 1] / 1e3
    return (forward[size][window - 1] + chain[size] * (window - 1)) / 1e3


def seeded_policy(table: str, size: int, rows: int, k_max: int, bias: float = 1.0) -> Policy:
    """A policy whose table a calibration seeded at `rows`, windows 1, 2 and k_max + 1 (the
    forward alone, and with the chain), each `bias` too high."""
    policy = Policy(probe_min_steps=64, probe_max_steps=4096)
    for window in (1, 2, k_max + 1):
        policy.costs.seed("", rows, window, step_seconds(table, size, window, chained=False) * bias)
        if window > 1:
            policy.costs.seed("sim", rows, window, step_seconds(table, size, window) * bias)
    return policy


def run(table: str, rows: int, stream: Stream, k: int | None, steps: int = 400, seed: int = 0,
        k_max: int = 4, noise: float = 0.1, calibration_bias: float = 1.3,
        tokens: int | None = None, spread: float = 0.0, load: float = 1.0) -> float:
    """Tokens per simulated second for `rows` rows decoding `steps` steps: k None = the policy,
    else a fixed k for every row. Each step's time is the table's, times up to ±`noise`; the
    policy's table starts from a calibration that read every cell `calibration_bias` too high
    (measured under load). `tokens`: each row's request ends after that many, and a new one takes
    its row, starting from the prior (None: one request a row). `spread`: each request's
    first-position acceptance differs from the stream's by a normal draw of this deviation (prompts
    that suit the proposer more or less). `load`: the last LOADED of every LOAD_PERIOD steps run
    this much slower, every step alike (a neighbour process)."""
    size = min(TABLES[table][0], key=lambda b: abs(b - rows))
    rng = random.Random(seed)
    policy = seeded_policy(table, size, rows, k_max, calibration_bias)
    prior, finished = Acceptance(memory=METHOD_MEMORY), []
    estimates = [Acceptance(prior.measured(k_max)) for _ in range(rows)]
    states: list[dict] = [_request(rng, spread) for _ in range(rows)]
    paces = [Pace() for _ in range(rows)]
    spent, total = 0.0, 0
    for step in range(steps):
        share_weight(estimates, finished, prior)
        plan_rows = [PlanRow("sim", k_max, e.alphas(k_max), fixed=k is not None, pace=pace,
                             left=math.inf if tokens is None else tokens - state.get("done", 0))
                     for e, pace, state in zip(estimates, paces, states)]
        if k is not None:
            ks = [k] * rows
        else:
            ks = policy.plan(plan_rows)
        window = max(ks) + 1
        seconds = step_seconds(table, size, window) * (1.0 + rng.uniform(-noise, noise))
        seconds *= load if step % LOAD_PERIOD >= LOAD_PERIOD - LOADED else 1.0
        committed = [_verify(rng, _shifted(stream.alphas(rng, step, steps, states[i]), states[i]), ks[i],
                             estimates[i], prior) for i in range(rows)]
        if k is None:
            policy.observe_step(plan_rows, ks, seconds, committed)
        spent += seconds
        total += sum(committed)
        for i, n in enumerate(committed):
            states[i]["done"] = states[i].get("done", 0) + n
            if tokens is not None and states[i]["done"] >= tokens:
                remember(finished, estimates[i])
                estimates[i], states[i], paces[i] = Acceptance(prior.measured(k_max)), _request(rng, spread), Pace()
    return total / spent


def _request(rng: random.Random, spread: float) -> dict:
    """A new request's state: how far its first position's acceptance lies from the stream's."""
    return {"shift": rng.gauss(0.0, spread)} if spread else {}


def _shifted(alphas: list[float], state: dict) -> list[float]:
    shift = state.get("shift", 0.0)
    return [min(0.97, max(0.0, alphas[0] + shift)), *alphas[1:]] if shift else alphas


def _verify(rng: random.Random, truth, k: int, estimate: Acceptance, prior: Acceptance) -> int:
    """One row's step: its k drafts accepted as `truth` says, observed by its estimate and the
    prior -> the tokens it commits."""
    accepted = 0
    while accepted < k and rng.random() < truth[accepted]:
        accepted += 1
    observe_step({"sim": estimate}, "sim" if k else None, k, accepted)
    if k:
        prior.observe(k, accepted)
    return accepted + 1


CONFIGS = [("plain", 0), ("k=1", 1), ("k=2", 2), ("k=3", 3), ("k=4", 4), ("adaptive", None)]


def compare(table: str, rows: int, stream: Stream, seeds: int = 3, **kw) -> dict:
    """Mean tokens per second over `seeds` seeded runs: plain, each fixed k and the policy."""
    return {name: sum(run(table, rows, stream, k, seed=s, **kw) for s in range(seeds)) / seeds
            for name, k in CONFIGS}


# The tiny target with its distilled draft, the whole step (chain included) in ms by batch size
# per window, measured in-process on 2026-11-27 (a burst of 4 held-out prompts, 64 tokens).
BURST_TABLE = {1: [8.5, 11.5, 14.5, 17.5, 20.5], 2: [9.3, 12.0, 15.2, 18.4, 21.6],
               3: [9.4, 14.0, 17.5, 21.0, 24.5], 4: [10.0, 15.8, 21.5, 27.2, 33.0]}


# SmolLM2 with its MTP head through serve, the whole step in ms by batch size per window: three
# rows 91.8 plain and 112.6 at a window of 2 (docs/benchmarks.md, "MTP at three rows on json
# traced", 2026-11-28); the other rows set in proportion (a window of 2 at 1.19-1.24x a plain
# step, as the head measured through the engine and serve).
SMOLLM2_BURST_TABLE = {1: [73, 87, 95, 101, 108], 2: [82, 99, 109, 118, 127],
                       3: [92, 113, 125, 135, 145], 4: [100, 124, 139, 151, 164]}


def burst(heads: list[str], tokens: int, k: int | None, seed: int = 0, k_max: int = 4,
          noise: float = 0.1, rounds: int = 2, table: dict | None = None,
          warm: tuple[float, ...] | None = None) -> float:
    """Closed bursts: one request per head, each decoding `tokens` tokens and leaving when done
    (none replaces it), `rounds` bursts in a row on one policy (a warm server). -> the last
    burst's tokens ÷ the time its last request finished, what a client burst measures: a request
    that speculation slows is the burst's tail. `table`: whole-step ms by rows per window
    (BURST_TABLE); `warm`: acceptance by position of drafts the method's prior saw first (another
    workload on the same server)."""
    rng = random.Random(seed)
    table = table or BURST_TABLE
    policy = Policy(probe_min_steps=64, probe_max_steps=4096)
    for rows, windows in table.items():
        policy.costs.seed("", rows, 1, windows[0] / 1e3)
        for window in range(2, k_max + 2):
            policy.costs.seed("sim", rows, window, windows[window - 1] / 1e3)
    prior, finished = Acceptance(memory=METHOD_MEMORY), []
    for _ in range(WARM_DRAFTS if warm else 0):
        _verify(rng, warm, 3, Acceptance(), prior)
    for _ in range(rounds):
        live = [{"head": HEADS[h], "left": tokens, "estimate": Acceptance(prior.measured(k_max)),
                 "pace": Pace()} for h in heads]
        spent = 0.0
        while live:
            share_weight([r["estimate"] for r in live], finished, prior)
            plan_rows = [PlanRow("sim", min(k_max, r["left"] - 1), r["estimate"].alphas(k_max),
                                 fixed=k is not None, pace=r["pace"], left=r["left"]) for r in live]
            ks = [min(k, row.k_max) for row in plan_rows] if k is not None else policy.plan(plan_rows)
            seconds = table[len(live)][max(ks)] / 1e3 * (1.0 + rng.uniform(-noise, noise))
            committed = [_verify(rng, r["head"], kk, r["estimate"], prior) for r, kk in zip(live, ks)]
            for r, n in zip(live, committed):
                r["left"] -= n
            if k is None:
                policy.observe_step(plan_rows, ks, seconds, committed)
            spent += seconds
            for r in live:
                if r["left"] <= 0:
                    remember(finished, r["estimate"])
            live = [r for r in live if r["left"] > 0]
    return len(heads) * tokens / spent


def compare_burst(heads: list[str], tokens: int = 64, seeds: int = 4, **kw) -> dict:
    return {name: sum(burst(heads, tokens, k, seed=s, **kw) for s in range(seeds)) / seeds
            for name, k in CONFIGS}


def in_turn(table: str, heads: list[str], k: int | None, tokens: int = 128, requests: int = 16,
            seed: int = 0, k_max: int = 4, noise: float = 0.1) -> tuple[float, dict[str, float]]:
    """One row, requests one after another, their heads in turn (a method whose drafts land on
    most requests and never on some). -> tokens per second, and each head's mean seconds a request."""
    rng = random.Random(seed)
    policy = seeded_policy(table, 1, 1, k_max)
    prior, finished = Acceptance(memory=METHOD_MEMORY), []
    spent, total, seconds = 0.0, 0, {h: 0.0 for h in heads}
    for r in range(requests):
        head = heads[r % len(heads)]
        estimate, pace, left, began = Acceptance(prior.measured(k_max)), Pace(), tokens, spent
        while left > 0:
            share_weight([estimate], finished, prior)
            row = PlanRow("sim", min(k_max, left - 1), estimate.alphas(k_max), fixed=k is not None, pace=pace,
                          left=left)
            ks = [min(k, row.k_max)] if k is not None else policy.plan([row])
            step = step_seconds(table, 1, max(ks) + 1) * (1.0 + rng.uniform(-noise, noise))
            committed = _verify(rng, HEADS[head], ks[0], estimate, prior)
            if k is None:
                policy.observe_step([row], ks, step, [committed])
            spent, total, left = spent + step, total + committed, left - committed
        remember(finished, estimate)
        seconds[head] += (spent - began) / (requests / len(heads))
    return total / spent, seconds
