"""k for every row of a batch, from measured costs and each row's measured acceptance.

A step costs t_target(B, N) + sum_i p(m_i)·k_i + B·o: the target forward over B rows padded to
N = max k + 1 positions (fitted online on [1, B, B·N] by non-negative, exponentially weighted
least squares, seeded by a calibration at start), each proposer's measured seconds per draft
token, and a per-row overhead (acceptance, bookkeeping). The plan maximises the batch's
expected committed tokens per second, sum_i E_i(k_i) / cost. Verifying B·(k+1) positions grows
with B, so k falls as the batch fills, to 0 when it no longer pays; no batch-size rule.

Rows whose acceptance makes speculation a loss even alone are "off" (controller.py).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .controller import RowController, expected_tokens

logger = logging.getLogger(__name__)

FORGET = 0.97  # weight of past observations per new one in the forward-cost fit
RIDGE = 1e-6  # fixed, relative to the Gram matrix's scale: identical observations stay solvable
EWMA = 0.1
NEAR_TIE = 1.02  # prefer the smaller k unless the larger is 2% better


class ForwardCostModel:
    """t_target(B, N) ≈ c0 + c1·B + c2·B·N, non-negative coefficients."""

    def __init__(self):
        self.gram = np.zeros((3, 3))
        self.moment = np.zeros(3)
        self._coef = np.zeros(3)
        self._stale = False  # observations since the last solve (solved when next needed)
        self.num_observations = 0

    @staticmethod
    def features(rows: int, window: int) -> np.ndarray:
        return np.array([1.0, rows, rows * window])

    @property
    def coef(self) -> np.ndarray:
        if self._stale:
            self._stale = False
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
            if self._stale and self.num_observations % 32 == 0:
                _ = self.coef  # refresh the reference now and then
            reference = float(x @ self._coef)
            if reference > 0:
                seconds = min(seconds, 3 * reference)
        self.gram = FORGET * self.gram + weight * (x[:, None] * x[None, :])
        self.moment = FORGET * self.moment + weight * seconds * x
        self.num_observations += 1
        self._stale = True

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
    def __init__(self):
        self.forward = ForwardCostModel()
        self.draft_cost: dict[str, float] = {}  # seconds per draft token, by method
        self.row_overhead = 0.0

    def proposer_cost(self, method: str) -> float:
        return self.draft_cost.get(method, 0.0)

    def observe_proposer(self, method: str, tokens: int, seconds: float) -> None:
        if tokens:
            per_token = seconds / tokens
            old = self.draft_cost.get(method)
            self.draft_cost[method] = per_token if old is None else old + EWMA * (per_token - old)

    def observe_step(self, rows: int, window: int, forward_s: float, rest_s: float) -> None:
        self.forward.observe(rows, window, forward_s)
        self.row_overhead += EWMA * (rest_s / rows - self.row_overhead)

    def step_cost(self, rows: int, window: int, draft_seconds: float) -> float:
        return self.forward.predict(rows, window) + draft_seconds + rows * self.row_overhead

    def pays_alone(self, row: RowController) -> bool:
        """Does this row's best k, with the batch to itself, beat plain decoding?"""
        cost = self.proposer_cost(row.method)
        plain = 1.0 / self.step_cost(1, 1, 0.0)
        return any(expected_tokens(row.alphas, k) / self.step_cost(1, k + 1, cost * k) > plain * NEAR_TIE
                   for k in range(1, row.k_max + 1))

    def plan(self, rows: list[RowController]) -> list[int]:
        forced = [row.forced_k() for row in rows]
        free = [i for i, f in enumerate(forced) if f is None]
        floor = max([f for f in forced if f is not None], default=0)
        if not free:
            return [int(f) for f in forced]
        best_ks, best_rate = None, -1.0
        for cap in range(0, max(rows[i].k_max for i in free) + 1):
            ks = self._fill(rows, forced, free, cap)
            window = max(floor, max(ks)) + 1
            rate = self._rate(rows, ks, window)
            if rate > best_rate * NEAR_TIE:
                best_ks, best_rate = ks, rate
        return best_ks

    def _fill(self, rows, forced, free, cap) -> list[int]:
        """Every free row takes the k <= cap that most helps the batch's rate, given the rest."""
        ks = [int(f) if f is not None else min(cap, rows[i].k_max) for i, f in enumerate(forced)]
        window = max(ks) + 1
        fixed_cost = self.step_cost(len(rows), window, 0.0)
        draft_cost = [self.proposer_cost(r.method) for r in rows]
        gains = [expected_tokens(r.alphas, k) for r, k in zip(rows, ks)]
        total_gain = sum(gains)
        total_cost = fixed_cost + sum(c * k for c, k in zip(draft_cost, ks))
        for i in free:
            base_gain = total_gain - gains[i]
            base_cost = total_cost - draft_cost[i] * ks[i]
            options = [((base_gain + expected_tokens(rows[i].alphas, k)) / (base_cost + draft_cost[i] * k), k)
                       for k in range(min(cap, rows[i].k_max) + 1)]
            best_rate, best_k = options[0]
            for rate, k in options[1:]:  # one row moves the batch rate little: no tie margin
                if rate > best_rate:
                    best_rate, best_k = rate, k
            total_gain = base_gain + expected_tokens(rows[i].alphas, best_k)
            total_cost = base_cost + draft_cost[i] * best_k
            gains[i], ks[i] = expected_tokens(rows[i].alphas, best_k), best_k
        return ks

    def _rate(self, rows, ks, window) -> float:
        gain = sum(expected_tokens(r.alphas, k) for r, k in zip(rows, ks))
        drafts = sum(self.proposer_cost(r.method) * k for r, k in zip(rows, ks))
        return gain / self.step_cost(len(rows), window, drafts)

    def as_dict(self) -> dict:
        c = self.forward.coef
        return {
            "forward_ms": {"base": round(float(c[0]) * 1e3, 4), "per_row": round(float(c[1]) * 1e3, 4),
                           "per_position": round(float(c[2]) * 1e3, 5)},
            "draft_ms_per_token": {m: round(v * 1e3, 4) for m, v in self.draft_cost.items()},
            "row_overhead_ms": round(self.row_overhead * 1e3, 4),
        }
