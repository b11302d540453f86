"""k for every row of a batch, from measured costs and each row's measured acceptance.

A step costs t_target(B, N) + sum_m c_m(B_m)·K_m + B·o: the target forward over B rows padded
to N = max k + 1 positions (fitted online on [1, B, B·N, X(B·N)] by non-negative, exponentially
weighted least squares, seeded by a calibration at start; X is an MoE target's expected
distinct experts per layer for B·N independently routed tokens ÷ top-k, 0 for a dense one:
on MoE the window's cost grows with the experts it reads), each method's draft chain (one
forward per chain step for all B_m rows of that method, K_m steps deep), and a per-row
overhead (acceptance, bookkeeping). The plan maximises the batch's
expected committed tokens per second, sum_i E_i(k_i) / cost. Verifying B·(k+1) positions grows
with B, so k falls as the batch fills, to 0 when it no longer pays; no batch-size rule.

Rows whose acceptance makes speculation a loss even alone are "off" (controller.py). Their
probes widen the whole batch's window, which on MoE targets costs the batch nearly a step per
probe step: due rows probe together, and only as often as keeps probes under PROBE_BUDGET of
the decoding time at the current batch's measured costs.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .controller import PROBE_STEPS, RowController, expected_tokens

logger = logging.getLogger(__name__)

FORGET = 0.97  # weight of past observations per new one in the forward-cost fit
RIDGE = 1e-6  # fixed, relative to the Gram matrix's scale: identical observations stay solvable
EWMA = 0.1
RESOLVE_EVERY = 16  # observations between solves of the forward-cost fit
NEAR_TIE = 1.02  # prefer the smaller k unless the larger is 2% better
PROBE_BUDGET = 0.02  # the share of decoding time probes of "off" rows may cost the batch
SPEC_BIAS_RANGE = (0.8, 2.0)  # how far measured misses may scale a speculative step's cost


def moe_shape(config: dict) -> tuple[int, int] | None:
    """(routed experts, experts per token) of an MoE target's config, or None for a dense one."""
    experts = next((config[k] for k in ("n_routed_experts", "num_local_experts", "num_experts")
                    if config.get(k)), None)
    top_k = config.get("num_experts_per_tok") or config.get("moe_top_k")
    return (int(experts), int(top_k)) if experts and top_k and top_k < experts else None


def distinct_experts(moe: tuple[int, int] | None, tokens: int) -> float:
    """Expected distinct experts an MoE layer reads for `tokens` independently routed tokens,
    in units of one token's (1 at one token, at most experts ÷ top-k); 0 when dense."""
    if moe is None:
        return 0.0
    experts, top_k = moe
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens) / top_k


class ForwardCostModel:
    """t_target(B, N) ≈ c0 + c1·B + c2·B·N + c3·X(B·N), non-negative coefficients; X (see
    distinct_experts) only for an MoE target."""

    def __init__(self, moe: tuple[int, int] | None = None):
        self.moe = moe
        self.gram = np.zeros((4, 4))
        self.moment = np.zeros(4)
        self._coef = np.zeros(4)
        self._stale = 0  # observations since the last solve (solved when next needed)
        self.num_observations = 0

    def features(self, rows: int, window: int) -> np.ndarray:
        return np.array([1.0, rows, rows * window, distinct_experts(self.moe, rows * window)])

    @property
    def coef(self) -> np.ndarray:
        # A solve costs ~0.5 ms; one observation barely moves the fit, so re-solve once enough
        # have arrived (every one during the first few, which set the fit from scratch).
        if self._stale >= (1 if self.num_observations < 32 else RESOLVE_EVERY):
            self._stale = 0
            coef = _nonnegative_solve(self.gram, self.moment)
            if np.isfinite(coef).all():  # else keep the last good fit
                self._coef = coef
        return self._coef

    def observe(self, rows: int, window: int, seconds: float, weight: float = 1.0) -> None:
        """Cheap (plain decoding observes every step and never plans): the fit is solved
        lazily, when a plan or a report next needs it."""
        if not math.isfinite(seconds) or seconds < 0:
            return  # a clock glitch must not poison the fit
        x = self.features(rows, window)
        if self.num_observations > 8:  # a one-off stall (GC, a new shape) must not swing the fit
            reference = float(x @ self._coef)
            if reference > 0:
                seconds = min(seconds, 3 * reference)
        self.gram = FORGET * self.gram + weight * (x[:, None] * x[None, :])
        self.moment = FORGET * self.moment + weight * seconds * x
        self.num_observations += 1
        self._stale += 1

    def predict(self, rows: int, window: int) -> float:
        return max(float(self.features(rows, window) @ self.coef), 1e-6)


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """Ridge least squares with coefficients clamped at zero (active set). The ridge is fixed
    relative to the Gram matrix, so a fit from one repeated shape (rank 1) stays well-posed."""
    scale = max(float(np.trace(gram)) / len(moment), 1e-12)
    regularized = gram + RIDGE * scale * np.eye(len(moment))
    active = list(range(len(moment)))
    coef = np.zeros(len(moment))
    for _ in range(len(moment)):
        sub = np.linalg.lstsq(regularized[np.ix_(active, active)], moment[active], rcond=None)[0]
        if (sub >= 0).all():
            coef[:] = 0
            coef[active] = sub
            return coef
        active = [a for a, v in zip(active, sub) if v > 0]
        if not active:
            break
    return coef


class BatchPlanner:
    def __init__(self, moe: tuple[int, int] | None = None):
        self.forward = ForwardCostModel(moe)
        # Seconds per draft-chain step of a method's whole group: a + b·rows (proposers draft
        # for all their rows in one forward per chain step).
        self.chain_cost: dict[str, tuple[float, float]] = {}
        self.row_overhead = 0.0
        # method -> the deepest its chain runs whatever k (a hybrid's model drafts at most its
        # own k; deeper drafts come from its suffix index, free of chain steps).
        self.chain_caps: dict[str, int] = {}
        # method -> seconds per chain step a processed row (sampled, penalised) adds to the chain:
        # its processed distribution over the whole vocabulary (calibration times it).
        self.processed_cost: dict[str, float] = {}
        self.steps_since_probe = 1 << 30  # the first due probe may start at once
        # Measured ÷ predicted step time, running means, for plain steps and speculative ones.
        self.misses = {"plain": 1.0, "spec": 1.0}
        self.num_misses = {"plain": 0, "spec": 0}

    def proposer_cost(self, method: str, rows: int = 1) -> float:
        """Seconds per chain step of `method` drafting for `rows` rows at once."""
        a, b = self.chain_cost.get(method, (0.0, 0.0))
        return a + b * rows

    def chain_seconds(self, method: str, k: int, rows: int = 1, processed: int = 0) -> float:
        """Seconds `method` spends drafting k tokens for `rows` rows at once, `processed` of them
        processed rows."""
        steps = min(k, self.chain_caps.get(method, k))
        return (self.proposer_cost(method, rows) + processed * self.processed_cost.get(method, 0.0)) * steps

    def observe_proposer(self, method: str, tokens: int, seconds: float) -> None:
        """A measured chain of `tokens` steps (one row's worth; the per-row slope is kept)."""
        if tokens and math.isfinite(seconds) and seconds >= 0:
            per_step = seconds / tokens
            a, b = self.chain_cost.get(method, (None, 0.0))
            self.chain_cost[method] = (per_step - b if a is None else a + EWMA * (per_step - b - a), b)

    def calibrate_proposer(self, method: str, one_row_s: float, many_rows: int, many_s: float) -> None:
        """Chain-step times measured at one row and at `many_rows` rows."""
        slope = max(0.0, (many_s - one_row_s) / max(1, many_rows - 1))
        self.chain_cost[method] = (max(0.0, one_row_s - slope), slope)

    def draft_seconds(self, rows: list[RowController], ks: list[int]) -> float:
        """Each method's chain runs max(k) steps over all of its rows."""
        depth: dict[str, int] = {}
        members: dict[str, int] = {}
        processed: dict[str, int] = {}
        for row, k in zip(rows, ks):
            chain_k = 0 if row.outlook is not None else k  # a lookup's drafts need no chain steps
            members[row.method] = members.get(row.method, 0) + 1
            depth[row.method] = max(depth.get(row.method, 0), chain_k)
            processed[row.method] = processed.get(row.method, 0) + int(row.processed and chain_k > 0)
        return sum(self.chain_seconds(m, k, members[m], processed[m]) for m, k in depth.items() if k)

    def observe_step(self, rows: int, window: int, forward_s: float, rest_s: float,
                     draft_s: float = 0.0) -> None:
        """A step's measured time: the target forward (drafting taken out), the rest, and the
        drafting the plan expected. First, how far the prediction for it was off."""
        predicted = self._unbiased_cost(rows, window, draft_s)
        actual = forward_s + draft_s + rest_s
        if math.isfinite(actual) and actual > 0 and predicted > 1e-6 and self.forward.num_observations > 8:
            kind = "spec" if window > 1 else "plain"
            ratio = min(max(actual / predicted, 0.5), 3.0)
            self.misses[kind] += EWMA * (ratio - self.misses[kind])
            self.num_misses[kind] += 1
        self.forward.observe(rows, window, forward_s)
        self.row_overhead += EWMA * (rest_s / rows - self.row_overhead)

    @property
    def spec_bias(self) -> float:
        """How much more speculative steps really cost than predicted, relative to plain steps.
        The fit cannot see everything a drafting step adds (a head's catch-up over its rows'
        new states, host work around the chain); on SmolLM2 at three rows an MTP k = 1 step
        cost 1.26x a plain one where the fit said 1.08x, so MTP drafted at a loss."""
        low = SPEC_BIAS_RANGE[0] if self.num_misses["spec"] >= 8 else 1.0  # no discount unmeasured
        return min(max(self.misses["spec"] / self.misses["plain"], low), SPEC_BIAS_RANGE[1])

    def _unbiased_cost(self, rows: int, window: int, draft_seconds: float) -> float:
        return self.forward.predict(rows, window) + draft_seconds + rows * self.row_overhead

    def step_cost(self, rows: int, window: int, draft_seconds: float) -> float:
        cost = self._unbiased_cost(rows, window, draft_seconds)
        return cost * self.spec_bias if window > 1 else cost

    def pays_alone(self, row: RowController) -> bool:
        """Does this row's best k, with the batch to itself, beat plain decoding?"""
        plain = 1.0 / self.step_cost(1, 1, 0.0)
        return any(expected_tokens(row.alphas, k) / self.step_cost(1, k + 1, self.chain_seconds(
                       row.method, k, processed=int(row.processed)))
                   > plain * NEAR_TIE
                   for k in range(1, row.k_max + 1))

    def plan(self, rows: list[RowController]) -> list[int]:
        """The window (max k + 1) and the set of methods that draft, whichever maximise the
        batch's expected tokens per second. Inside the window a drafting row takes all the k it
        may: its chain runs that deep for its group anyway and the window is paid for."""
        forced = [row.forced_k() for row in rows]
        self._start_due_probes(rows, forced)
        free = [i for i, f in enumerate(forced) if f is None]
        if not free:
            return [int(f) for f in forced]
        methods = sorted({rows[i].method for i in free})
        best_ks, best_rate = None, -1.0
        for cap in range(0, max(rows[i].most for i in free) + 1):
            for mask in range(1 << len(methods)):
                on = {m for j, m in enumerate(methods) if mask >> j & 1}
                if cap == 0 and on:
                    continue
                ks = [int(f) if f is not None else (min(cap, rows[i].most) if rows[i].method in on else 0)
                      for i, f in enumerate(forced)]
                rate = self._rate(rows, ks)
                if rate > best_rate * NEAR_TIE:
                    best_ks, best_rate = ks, rate
        return best_ks

    def _start_due_probes(self, rows: list[RowController], forced: list) -> None:
        """Due rows probe together once the batch has decoded long enough since the last probe
        for PROBE_STEPS steps at the probe's window to stay within PROBE_BUDGET."""
        self.steps_since_probe += 1
        due = [i for i, row in enumerate(rows) if row.probe_due and row.outlook is None]
        if not due:
            return
        k = 1 if self.forward.moe else 2  # on MoE every extra position reads more experts
        plain = self.step_cost(len(rows), 1, 0.0)
        probe = self.step_cost(len(rows), k + 1, max(self.chain_seconds(rows[i].method, k, len(due)) for i in due))
        extra_steps = PROBE_STEPS * max(0.0, probe / plain - 1.0)
        if self.steps_since_probe * PROBE_BUDGET < extra_steps:
            return
        self.steps_since_probe = 0
        for i in due:
            forced[i] = rows[i].start_probe(k)

    def _rate(self, rows, ks) -> float:
        gain = sum(expected_tokens(r.outlook if r.outlook is not None else r.alphas, k)
                   for r, k in zip(rows, ks))
        return gain / self.step_cost(len(rows), max(ks) + 1, self.draft_seconds(rows, ks))

    def as_dict(self) -> dict:
        c = self.forward.coef
        return {
            "forward_ms": {"base": round(float(c[0]) * 1e3, 4), "per_row": round(float(c[1]) * 1e3, 4),
                           "per_position": round(float(c[2]) * 1e3, 5),
                           **({"per_expert_read": round(float(c[3]) * 1e3, 5)} if self.forward.moe else {})},
            "moe": list(self.forward.moe) if self.forward.moe else None,
            "draft_chain_step_ms": {m: {"base": round(a * 1e3, 4), "per_row": round(b * 1e3, 5),
                                        "per_processed_row": round(self.processed_cost.get(m, 0.0) * 1e3, 5)}
                                    for m, (a, b) in self.chain_cost.items()},
            "row_overhead_ms": round(self.row_overhead * 1e3, 4),
            "speculative_step_bias": round(self.spec_bias, 3),
        }
