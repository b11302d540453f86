"""Acceptance per draft position: the one estimator, for a request's drafts of each kind and for a
method's drafts across requests (the prior a new request starts from).

alpha_i is the chance that draft i is accepted given drafts 1..i-1 were; a step with k drafts
then commits E(k) = 1 + a_1 + a_1·a_2 + ... tokens on average.
"""

from __future__ import annotations

import math

ALPHA_PRIOR = 0.7  # a position nothing has measured: optimistic, so that drafting is tried
PRIOR_TRIALS = 3.0  # the least a start weighs, in observations: the first real ones move it at once
STRETCH = 16.0  # steps a stretch spans, not a word: what a request's estimate and a step-cost cell average over
METHOD_MEMORY = 200.0  # observations a method's prior across requests averages over


def expected_tokens(alphas: list[float], k: int) -> float:
    """E(k): the tokens a step with k drafts commits on average."""
    total, run = 1.0, 1.0
    for alpha in alphas[:k]:
        run *= alpha
        total += run
    return total


class Acceptance:
    """Hits and trials per position, decayed at every observation, on top of PRIOR_TRIALS
    pseudo-trials: for the first position at `start` (a method's prior, or ALPHA_PRIOR), for the
    others at the estimate of the position before, times what the method's requests measured
    there against it (its prior's ratio; 1 where unmeasured). A position rarely reached therefore
    drifts back to its predecessor as the method's requests see them: a request expecting of its
    second draft what its first gets drafted windows of 3 first where the method measured 0.81
    then 0.39 (tiny-moe's MTP head: 0.94x k = 1 at one client, simulated), while deep acceptance
    still moves with the request's own first (0.5-0.6 in a hard stretch, not the prior's 0.95).
    Neither a start nor one bad stretch caps k for ever: the prior's unreached positions drift
    back the same way. A request's estimate observes each of its steps, drafted or not: one that fell
    below break-even on the hard text after its prompt drafts again once that evidence is old
    (else it never drafted again: 0.92x the best fixed k, simulated on tiny-moe). A step that
    drafted nothing ages the evidence at half the rate: a request whose drafts never land drafts
    again each time aging lifts its estimate back over break-even a*, on ~PRIOR_TRIALS
    (start / a* - 1) / memory of its steps. At the full rate a tiny-wide prompt (start 0.75,
    a* 0.15) decoded 12 % slower than plain through serve; at half, 7 % simulated, and through
    serve that prompt took 0.98x plain's time. What the start weighs (`weight`) is measured across
    requests: see share_weight(); a request its own drafts show unlike its start weighs it least
    (start_weight())."""

    def __init__(self, starts: list[float] | None = None, memory: float = STRETCH):
        starts = list(starts) if starts else [ALPHA_PRIOR]
        self.start = starts[0]
        self.ratios = [b / a if a > 0 else 1.0 for a, b in zip(starts, starts[1:])]
        self.decay = 1.0 - 1.0 / memory
        self.idle_decay = 1.0 - 0.5 / memory
        self.weight = PRIOR_TRIALS  # the start's pseudo-trials (a deeper position's weigh PRIOR_TRIALS)
        self.hits: list[float] = []
        self.trials: list[float] = []
        self.drafted = 0  # its steps that drafted, over its life (not decayed): whether its start fits it
        self.first_hits = 0  # of those, the ones whose first draft was accepted

    def alphas(self, depth: int) -> list[float]:
        out: list[float] = []
        for i in range(depth):
            hits, trials = (self.hits[i], self.trials[i]) if i < len(self.trials) else (0.0, 0.0)
            ratio = self.ratios[i - 1] if 0 < i <= len(self.ratios) else 1.0  # deeper: predecessor x prior's ratio
            pseudo, weight = (min(1.0, out[-1] * ratio), PRIOR_TRIALS) if i else (self.start, self.start_weight())
            out.append((hits + pseudo * weight) / (trials + weight))
        return out

    def start_weight(self) -> float:
        """`weight`, or PRIOR_TRIALS where its own first drafts over its life make the start
        unlikely: a chance under 1 in METHOD_MEMORY (the Chernoff bound exp(-n KL(own || start))).
        Decayed, its evidence weighs at most STRETCH, so a start of that weight held a
        request whose drafts never landed at ~0.2 among ones accepting 0.3, near break-even:
        it drafted a quarter of its steps and held the others' windows (a burst of three on
        SmolLM2's step costs: 0.960x plain, 0.977x with this; simulated)."""
        if not self.drafted or self.weight <= PRIOR_TRIALS:
            return self.weight
        own = self.first_hits / self.drafted
        unlike = (own != self.start if self.start in (0.0, 1.0)
                  else self.drafted * _divergence(own, self.start) > math.log(METHOD_MEMORY))
        return PRIOR_TRIALS if unlike else self.weight

    def measured(self, depth: int) -> list[float]:
        """Its estimates up to `depth`, through the last position measured PRIOR_TRIALS times (the
        first always): a new request's starts (past them, its own estimates drift)."""
        reached = sum(1 for t in self.trials[1:depth] if t >= PRIOR_TRIALS)
        return self.alphas(1 + reached)

    def observe(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted the first `accepted`: positions up to the
        first rejection were reached (none for a step that drafted nothing: it ages the rest)."""
        grow = [0.0] * (drafted - len(self.trials))  # positions reached for the first time
        if drafted:
            self.drafted += 1
            self.first_hits += accepted > 0
        decay = self.decay if drafted else self.idle_decay
        self.hits = [h * decay for h in self.hits] + grow
        self.trials = [t * decay for t in self.trials] + grow
        for i in range(min(accepted + 1, drafted)):
            self.hits[i] += 1.0 if i < accepted else 0.0
            self.trials[i] += 1.0


def _divergence(own: float, start: float) -> float:
    """KL(own || start) of two acceptance rates, start strictly between 0 and 1."""
    return sum(a * math.log(a / b) for a, b in ((own, start), (1.0 - own, 1.0 - start)) if a > 0)


def observe_step(estimates: dict[str, Acceptance], kind: str | None, drafted: int, accepted: int) -> None:
    """One step of a request: the kind it drafted (None: none) observes its outcome, and every
    other estimate of the request ages."""
    for other, estimate in estimates.items():
        estimate.observe(*((drafted, accepted) if other == kind else (0, 0)))


def share_weight(estimates: list[Acceptance], finished: list[Acceptance] = (), prior: Acceptance | None = None) -> None:
    """Shrink these requests' estimates (one method's live requests, one draft kind) toward what
    its requests accept together, by as much as they are alike, as empirical Bayes does: each
    one's start becomes the first-position acceptance of the method's drafts (`prior`, over all of
    them; without one, the pooled acceptance of these requests), weighing up to STRETCH
    pseudo-trials (its own evidence's most) where they accept alike, so a run of rejections is
    one request's luck, and PRIOR_TRIALS where they differ, so its own evidence rules at once.
    Not the pool's own mean: after 16 clients, two finished requests counted (7.7 trials, their
    evidence ending in the rejections that stopped them) and held every later request at 0.10
    with 16 pseudo-trials while the method's drafts were accepted 0.45 (SmolLM2's MTP at one
    client through serve, traced: mean k 0.1, 0.99x spec off where k = 1 read ~1.25x). A
    fixed 3 at 16 rows let one unlucky request fall below break-even and veto every row's window
    (policy.py's pace): adaptive read 0.93x k = 1 (simulated). The spread is measured over the
    live requests and the method's recently `finished` ones (remember()): at 4 rows, requests
    of 64 tokens were seldom measured 3 times each before they ended, so the live ones alone
    rarely made a spread, one rejection moved a start by 0.14 and held every row's window
    (tiny-moe's MTP through serve: mean k 0.03 where k = 1 gained 5 %). A request counts once its
    own evidence weighs as much as the least start; a spread needs two."""
    measured = [(e.hits[0], e.trials[0]) for e in [*estimates, *finished] if _counts(e)]
    if len(measured) < 2:
        return
    mean = sum(h for h, _ in measured) / sum(t for _, t in measured)
    spread = sum((h / t - mean) ** 2 for h, t in measured) / len(measured)
    luck = sum(mean * (1.0 - mean) / t for _, t in measured) / len(measured)  # binomial noise
    between = spread - luck
    weight = STRETCH if between <= 0 else mean * (1.0 - mean) / between - 1.0
    weight = min(STRETCH, max(PRIOR_TRIALS, weight))
    start = prior.alphas(1)[0] if prior is not None else mean
    for estimate in estimates:
        estimate.start, estimate.weight = start, weight


def remember(finished: list[Acceptance], estimate: Acceptance) -> None:
    """A finished request's estimate joins its method's recent ones (share_weight's history),
    which span the last METHOD_MEMORY first-position trials, as the method's prior does."""
    if _counts(estimate):
        finished.append(estimate)
    while sum(e.trials[0] for e in finished[1:]) >= METHOD_MEMORY:
        finished.pop(0)


def _counts(estimate: Acceptance) -> bool:
    """Whether a request counts toward a spread: its own first-position evidence weighs as much
    as the least start."""
    return bool(estimate.trials) and estimate.trials[0] >= PRIOR_TRIALS
