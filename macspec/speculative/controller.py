"""One request's speculation state: its acceptance per draft position and whether it is on,
off, or probing. The batch planner (planner.py) picks k for every row from these and the
measured costs; this module holds what belongs to one row.

E(k) = sum_{j=0..k} prod_{i<=j} alpha_i (alpha_0 = 1) tokens per step. A row whose acceptance
makes speculation a loss even with the batch to itself turns "off"; a probe retries it after P
of its steps, P doubling up to a cap while probes fail, back to the minimum when one succeeds.
A row whose wait is over is "due": the planner starts due rows' probes together, when the
batch can afford the wider window (planner.py), never one row at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

ALPHA_PRIOR = 0.7  # optimistic start so k_max is tried (and measured) first
# A position's n-th observation weighs 1 / (n + PRIOR_TRIALS): the first few move the estimate
# off its prior at once (a useless draft is off within ~6 steps), later ones average over
# ~1 / ALPHA_WEIGHT steps (a fixed 0.15 swung ±0.14 on a 0.45 head and turned rows off by chance).
PRIOR_TRIALS = 3
ALPHA_WEIGHT = 0.08
PROBE_STEPS = 4  # speculative steps in one probe


@dataclass
class RowController:
    """One request's acceptance estimate and on/off/probe state."""

    k_max: int
    adaptive: bool = True
    method: str = "none"
    probe_min_steps: int = 64
    probe_max_steps: int = 4096
    alphas: list[float] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)  # observations per draft position
    is_off: bool = False
    probe_interval: int = 0
    steps_until_probe: int = 0
    probe_left: int = 0
    num_turned_off: int = 0
    num_probes: int = 0
    probe_intervals: list[int] = field(default_factory=list)  # each wait before a probe, in order
    last_k: int = 0
    probe_due: bool = False  # waited its interval; the planner starts the probe
    probe_k: int = 2
    # The method's acceptance so far across requests; after init, this row's starting estimate.
    prior: list[float] | None = None
    # Its drafts are processed (sampled, penalised, biased): each chain step also computes its
    # processed distribution over the whole vocabulary, a cost plain greedy rows do not pay.
    processed: bool = False
    first_probe_interval: int | None = None  # the method's probe backoff so far, if any
    # This step's acceptance per position from a lookup that knows its match (a hybrid's suffix
    # draft), set before each plan; it stands in for `alphas`, which track the model's drafts,
    # and an off row may still take it.
    outlook: list[float] | None = None
    # The most its proposer can draft this step, when a lookup knows before drafting (None: any k).
    draft_limit: int | None = None

    def __post_init__(self):
        # Start from what this method achieved for earlier requests: no exploration from scratch.
        prior = list(self.prior or [])[:self.k_max]
        self.alphas = prior + [prior[-1] if prior else ALPHA_PRIOR] * (self.k_max - len(prior))
        self.prior = list(self.alphas)  # where a position this row never reached starts from
        self.reached = [0] * self.k_max
        self.probe_interval = min(max(self.first_probe_interval or 0, self.probe_min_steps),
                                  self.probe_max_steps)

    @property
    def state(self) -> str:
        if self.k_max == 0:
            return "plain"
        if self.probe_left:
            return "probing"
        if self.is_off:
            return "off"
        return "on" if self.last_k > 0 or not self.adaptive else "held"

    @property
    def most(self) -> int:
        """The deepest it may draft this step: k_max, or less where a lookup knows its match."""
        return self.k_max if self.draft_limit is None else min(self.k_max, self.draft_limit)

    def forced_k(self) -> int | None:
        """k fixed regardless of the plan (fixed-k requests, probes, off rows), else None."""
        if not self.adaptive or self.k_max == 0:
            return self.k_max
        if self.probe_left:
            return min(self.k_max, self.probe_k)
        if self.is_off:
            self.steps_until_probe = max(0, self.steps_until_probe - 1)
            self.probe_due = self.steps_until_probe == 0
            return 0 if self.outlook is None else None
        return None

    def start_probe(self, k: int) -> int:
        """The planner's go for a due row: PROBE_STEPS steps at k drafts -> k."""
        self.probe_due = False
        self.num_probes += 1
        self.probe_left = PROBE_STEPS
        self.probe_k = k
        return min(self.k_max, k)

    def observe(self, k: int, accepted: int, pays_alone: bool) -> None:
        """After a step: k drafted, `accepted` taken; `pays_alone` = speculation beats plain
        for this row's acceptance even with the batch to itself."""
        self.last_k = k
        observe_acceptance(self.alphas, k, accepted, self.reached, self.prior)
        if not self.adaptive or self.k_max == 0:
            return
        if self.probe_left:
            self.probe_left -= 1
            if self.probe_left == 0:
                if pays_alone:
                    self.is_off = False
                    self.probe_interval = self.probe_min_steps
                    logger.info("speculation back on for a request after a probe (alpha=%s)",
                                _fmt(self.alphas))
                else:
                    self.probe_interval = min(self.probe_interval * 2, self.probe_max_steps)
                    self._schedule_probe()
            return
        if not self.is_off and not pays_alone:  # also when the plan already gave it k = 0
            self.is_off = True
            self.num_turned_off += 1
            self._schedule_probe()
            logger.info("speculation off for a request: acceptance %s does not pay; probe in %d "
                        "steps", _fmt(self.alphas), self.probe_interval)

    def _schedule_probe(self) -> None:
        self.steps_until_probe = self.probe_interval
        self.probe_intervals.append(self.probe_interval)

def expected_tokens(alphas: list[float], k: int) -> float:
    """E(k): the committed tokens a step with k drafts yields on average."""
    total, run = 1.0, 1.0
    for alpha in alphas[:k]:
        run *= alpha
        total += run
    return total


def observe_acceptance(alphas: list[float], k: int, accepted: int, reached: list[int],
                       prior: list[float]) -> None:
    """Running mean (see PRIOR_TRIALS) of the acceptance at each draft position reached in a step
    of k drafts; `reached` counts each position's observations, `prior` is where it started."""
    for i in range(min(accepted + 1, k)):
        reached[i] += 1
        hit = 1.0 if i < accepted else 0.0
        alphas[i] += max(ALPHA_WEIGHT, 1.0 / (reached[i] + PRIOR_TRIALS)) * (hit - alphas[i])
    # A position never reached is assumed no better than the one before it, as it stands now: a
    # cap kept from a bad stretch would stop k from ever growing past it again.
    for i in range(1, len(alphas)):
        if not reached[i]:
            alphas[i] = min(prior[i], alphas[i - 1])


class AcceptancePrior:
    """A method's acceptance per draft position over all requests: decayed hit and trial
    counts on top of a few pseudo-trials at a base (ALPHA_PRIOR, or what a saved prior said),
    so the first observations move it at once."""

    PSEUDO_TRIALS = 2.0
    DECAY = 0.995  # about the last 200 observations per position count

    def __init__(self, base: list[float] | None = None):
        self.base = list(base or [])
        self.hits = [0.0] * len(self.base)
        self.trials = [0.0] * len(self.base)

    @property
    def alphas(self) -> list[float]:
        out: list[float] = []
        for i, (hits, trials) in enumerate(zip(self.hits, self.trials)):
            base = self.base[i] if i < len(self.base) else ALPHA_PRIOR
            alpha = (hits + base * self.PSEUDO_TRIALS) / (trials + self.PSEUDO_TRIALS)
            if out and trials < 1.0:  # rarely reached: assume no better than the one before
                alpha = min(alpha, out[-1])
            out.append(alpha)
        return out

    def observe(self, k: int, accepted: int) -> None:
        while len(self.trials) < k:
            self.hits.append(0.0)
            self.trials.append(0.0)
        for i in range(min(accepted + 1, k)):
            self.hits[i] = self.hits[i] * self.DECAY + (1.0 if i < accepted else 0.0)
            self.trials[i] = self.trials[i] * self.DECAY + 1.0


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"
