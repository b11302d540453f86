"""Per-request choice of k from measured acceptance and measured step cost.

E(k) = sum_{j=0..k} prod_{i<=j} alpha_i (alpha_0 = 1) tokens per step; cost(k) = the measured
wall time of a step with k drafts (draft + verify + accept), fitted as a + b*k where k was not
tried. k* = argmax E(k)/cost(k); k* = 0 turns speculation off, and probes then retry it after
P steps, P doubling up to a cap while probes fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ALPHA_PRIOR = 0.7  # optimistic start so k_max is tried (and measured) first
ALPHA_WEIGHT = 0.15  # EWMA weight of one observation
COST_WEIGHT = 0.2
PROBE_STEPS = 4  # speculative steps in one probe
REFRESH_PLAIN_EVERY = 64  # while on, one plain step this often keeps cost(0) current


@dataclass
class ControllerConfig:
    k_max: int
    adaptive: bool = True
    probe_min_steps: int = 64
    probe_max_steps: int = 4096


@dataclass
class KController:
    cfg: ControllerConfig
    alphas: list[float] = field(default_factory=list)
    costs: dict[int, float] = field(default_factory=dict)
    is_off: bool = False
    probe_interval: int = 0
    steps_until_probe: int = 0
    probe_left: int = 0
    num_turned_off: int = 0
    num_probes: int = 0
    probe_intervals: list[int] = field(default_factory=list)
    warmed_up: set = field(default_factory=set)
    steps_since_plain: int = 0

    def __post_init__(self):
        self.alphas = [ALPHA_PRIOR] * self.cfg.k_max
        self.probe_interval = self.cfg.probe_min_steps

    @property
    def state(self) -> str:
        if self.probe_left:
            return "probing"
        return "off" if self.is_off else "on"

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.alphas, k)

    def cost(self, k: int) -> float | None:
        if k in self.costs:
            return self.costs[k]
        points = sorted(self.costs.items())
        if len(points) < 2:
            return None
        n = len(points)
        mean_k = sum(p[0] for p in points) / n
        mean_t = sum(p[1] for p in points) / n
        var = sum((p[0] - mean_k) ** 2 for p in points)
        slope = sum((p[0] - mean_k) * (p[1] - mean_t) for p in points) / var
        return max(mean_t + slope * (k - mean_k), 1e-9)

    def best_k(self) -> int:
        """argmax E(k)/cost(k) over the ks whose cost is known or can be fitted."""
        best, best_rate = 0, None
        for k in range(self.cfg.k_max + 1):
            c = self.cost(k)
            if c is None:
                continue
            rate = self.expected_tokens(k) / c
            if best_rate is None or rate > best_rate * 1.02:  # prefer smaller k on near ties
                best, best_rate = k, rate
        return best

    def choose_k(self) -> int:
        if not self.cfg.adaptive:
            return self.cfg.k_max
        if 0 not in self.costs:
            return 0  # measure plain decode first
        if len(self.costs) < 2:
            return self.cfg.k_max  # then the largest k: two points fit the cost line
        if not self.is_off and self.steps_since_plain >= REFRESH_PLAIN_EVERY:
            return 0
        if self.probe_left:
            return self._probe_k()
        if self.is_off:
            self.steps_until_probe -= 1
            if self.steps_until_probe > 0:
                return 0
            self.num_probes += 1
            self.probe_left = PROBE_STEPS
            return self._probe_k()
        return self.best_k()

    def _probe_k(self) -> int:
        return max(1, min(self.cfg.k_max, 2))

    def observe(self, k: int, accepted: int, seconds: float) -> None:
        self.steps_since_plain = 0 if k == 0 else self.steps_since_plain + 1
        if k in self.warmed_up:  # a first step at a new shape pays one-off costs: skip it
            old = self.costs.get(k)
            self.costs[k] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self.warmed_up.add(k)
        observe_acceptance(self.alphas, k, accepted)
        if self.cfg.adaptive and len(self.costs) >= 2:
            self._update_state(k)

    def _update_state(self, k: int) -> None:
        if self.probe_left:
            self.probe_left -= 1
            if self.probe_left:
                return
            if self.best_k() > 0:
                self._turn_on()
            else:
                self.probe_interval = min(self.probe_interval * 2, self.cfg.probe_max_steps)
                self._schedule_probe()
            return
        if not self.is_off and k > 0 and self.best_k() == 0:
            self.is_off = True
            self.num_turned_off += 1
            self._schedule_probe()
            logger.info("speculation off: %.2f tokens/step at k=%d does not pay for its cost "
                        "(alpha=%s); next probe in %d steps", self.expected_tokens(k), k,
                        _fmt(self.alphas), self.probe_interval)

    def _schedule_probe(self) -> None:
        self.steps_until_probe = self.probe_interval
        self.probe_intervals.append(self.probe_interval)

    def _turn_on(self) -> None:
        if self.is_off:
            logger.info("speculation back on after a probe (alpha=%s)", _fmt(self.alphas))
        self.is_off = False
        self.probe_interval = self.cfg.probe_min_steps


def expected_tokens(alphas: list[float], k: int) -> float:
    """E(k): the committed tokens a step with k drafts yields on average."""
    total, run = 1.0, 1.0
    for alpha in alphas[:k]:
        run *= alpha
        total += run
    return total


def observe_acceptance(alphas: list[float], k: int, accepted: int) -> None:
    """EWMA of the acceptance at each draft position reached in a step of k drafts."""
    for i in range(min(accepted + 1, k)):
        hit = 1.0 if i < accepted else 0.0
        alphas[i] += ALPHA_WEIGHT * (hit - alphas[i])
    # Positions beyond the deepest one observed so far are assumed no better than it.
    for i in range(k, len(alphas)):
        if k > 0:
            alphas[i] = min(alphas[i], alphas[k - 1])


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"
