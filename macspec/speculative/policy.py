"""Deciding k, by measurement; docs/architecture.md ("The policy") explains it on one page.

Each step the plan picks the window W and the methods that draft, whichever maximise the batch's
expected committed tokens per second, sum_i E_i(k_i) / seconds(chain, B, W): E from each
request's measured acceptance (acceptance.py), seconds from the step-cost table (costs.py). A
drafting row takes all the k its window allows (min(W - 1, its k_max)): the window is paid for.

Two measured promises bound it. A guard per (method, batch bucket) compares the committed tokens
per second of that method's last drafting steps with what plain decoding costs now at each step's
own row count (a bucket spans rows; a plain step priced when a step ran goes stale): trailing by
more than GUARD_MARGIN, even one standard error of its tokens up, lowers the method there one rung
(its first draft alone, where that would have paid, else off), as do deeper windows trailing what
its first drafts alone would have paid on their own steps, until a probe, after `interval`
steps (doubling while re-probes lose), measures it winning; a method the plan leaves idle that long
is probed too, and nothing is off before a probe measured it, nor on misses its drafts landing at
the method's other batch sizes make luck. And each
request keeps its pace: one behind plain decoding's pace by GUARD_MARGIN takes no window it
expects to slow it further (a row that does not draft pays the batch's window all the same)
while it is the batch's last, else none that slows it more than the batch gains a row; and
once the batch drains (a request left, none joined for a while), its last request takes none it
expects to lose in, behind or not: a burst ends with it (a probe waits for the quiet alone).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from .acceptance import METHOD_MEMORY, PRIOR_TRIALS, STRETCH, expected_tokens
from .costs import YOUNG, StepCosts, bucket

logger = logging.getLogger(__name__)
GUARD_MARGIN = 0.03  # speculation may trail plain by this much before it stops: noise, not loss
PROBE_STEPS = 4  # speculative steps a probe measures (a first trial too), at a window of 2
GUARD_MEMORY = 64  # steps a guard's comparison spans (a stretch of hard text is not a loss), and
# how often what the plan does not take is measured again: plain decoding while speculating (today's
# load, not the calibration's) and, while drafting, the plan's runner-up (costs ~1/64 of a gap)
DECAY = 1.0 - 1.0 / GUARD_MEMORY


@dataclass
class PlanRow:
    """One row as the plan sees it."""

    method: str
    k_max: int  # the most it may draft this step (its cap, its room, its proposer's offer)
    alphas: list[float]  # its expected acceptance per position for this step's offer
    chained: bool = True  # drafting runs its method's chain (a lookup's drafts do not)
    fixed: bool = False  # a fixed-k request: k = k_max whatever the plan
    pace: Pace | None = None  # its request's pace (None: not kept)
    left: float = math.inf  # tokens its request may still make (unknown: as if the most)


@dataclass
class Pace:
    """One request's decode steps: the seconds plain decoding would have taken for its tokens, and
    the seconds they took. A plain step is on pace (its noise is no one's loss)."""

    plain_s: float = 0.0
    spent_s: float = 0.0
    drafted: int = 0  # its steps that drafted
    step_s: float = 0.0  # a plain step's seconds at its last step

    @property
    def speedup(self) -> float | None:
        return self.plain_s / self.spent_s if self.spent_s > 0 else None

    @property
    def behind(self) -> bool:
        """Behind by the margin; while its own acceptance is still mostly the start's (fewer
        drafting steps than the start weighs), one rejected window is luck: a plain step of slack.
        Without it a new request held 16 rows for ~36 steps (tiny-moe through serve)."""
        slack = self.step_s if self.drafted < PRIOR_TRIALS else 0.0
        return self.spent_s > (1.0 + GUARD_MARGIN) * self.plain_s + slack

    def observe(self, tokens: float, seconds: float, plain_s: float, speculative: bool, drafted: bool) -> None:
        self.plain_s += tokens * plain_s
        self.spent_s += seconds if speculative else tokens * plain_s
        self.drafted += drafted
        self.step_s = plain_s


@dataclass
class Tally:
    """A guard's drafting steps (decayed): the tokens per row each committed at each row count,
    what their first drafts alone would have, their seconds at the table's load (costs.py) and a
    window of 2's there, priced against plain decoding when read (Policy.speedup)."""

    units: dict[int, float] = field(default_factory=dict)  # rows -> tokens committed per row
    firsts: dict[int, float] = field(default_factory=dict)  # rows -> by their first drafts alone
    squares: float = 0.0  # each step's tokens per row, squared: their noise
    weight: float = 0.0  # steps
    spent_s: float = 0.0
    first_s: float = 0.0

    def observe(self, rows: int, *step: float) -> None:
        """Ages what it holds, then adds `step` if given: (tokens per row, by their first drafts
        alone, its seconds, a window of 2's)."""
        for r in self.units:
            self.units[r], self.firsts[r] = self.units[r] * DECAY, self.firsts[r] * DECAY
        per_row, firsts, spent_s, first_s = step or (0.0,) * 4
        if step:
            self.units[rows] = self.units.get(rows, 0.0) + per_row
            self.firsts[rows] = self.firsts.get(rows, 0.0) + firsts
        self.squares, self.weight = self.squares * DECAY + per_row ** 2, self.weight * DECAY + bool(step)
        self.spent_s, self.first_s = self.spent_s * DECAY + spent_s, self.first_s * DECAY + first_s

    @property
    def noise(self) -> float:
        """The standard error of its mean tokens per row a step, relative to that mean."""
        if self.weight <= 1.0:
            return 0.0
        mean = sum(self.units.values()) / self.weight
        spread = max(0.0, self.squares / self.weight - mean * mean)
        return math.sqrt(spread / self.weight) / mean if mean > 0 else 0.0

    @property
    def landed(self) -> bool:
        """Whether any of its drafts was accepted (a row committed more than 1 token)."""
        return sum(self.units.values()) > self.weight * (1.0 + 1e-9)


@dataclass
class Guard:
    """One method at one batch bucket: its drafting steps, and apart its steps with windows over 2
    (what the deeper drafts add is judged on their own steps)."""

    interval: int = 0  # steps before the next probe while off, capped, or left idle by the plan
    probe_left: int = PROBE_STEPS
    k_max: float = math.inf  # the most k the plan may give it here: 1 its first draft alone, 0 off
    waited: int = 0  # steps it could have drafted here (or deeper) and did not
    probes: int = 0  # probes judged here, its first trial included
    drafts: int = 0  # first drafts its steps verified (rows that drafted), since its restart
    unseen: bool = False  # off on a first trial that missed every draft before any landed elsewhere
    last: float | None = None  # the speed-up its steps measured last: what a status shows after a restart
    steps: int = 0  # its drafting steps since its restart
    tally: Tally = field(default_factory=Tally)
    deeper: Tally = field(default_factory=Tally)

    @property
    def state(self) -> str:
        if self.probe_left:
            return "probing"
        if self.k_max < math.inf:
            return "off" if not self.k_max else "capped"
        return "idle" if self.waited else "on"  # idle: by the plan

    def restart(self, probe: int = PROBE_STEPS) -> None:
        self.probe_left, self.waited, self.unseen = probe, 0, False
        self.steps, self.drafts, self.tally, self.deeper = 0, 0, Tally(), Tally()


class Policy:
    def __init__(self, probe_min_steps: int = 64, probe_max_steps: int = 4096):
        self.costs = StepCosts()
        self.guards: dict[tuple[str, int], Guard] = {}
        self.probe_steps = (probe_min_steps, max(probe_min_steps, probe_max_steps))
        self.held_by_pace = 0  # steps whose best window (or due probe) a lagging request vetoed
        self.since_join = 0  # steps since a request joined the batch (its first decode step)
        self.rows_at_join = 0  # the batch's rows then: fewer now (none joined since), it drains

    def guard(self, method: str, rows: int) -> Guard:
        return self.guards.setdefault((method, bucket(rows)), Guard(interval=self.probe_steps[0]))

    # ---- a step's decision -------------------------------------------------------------------
    def plan(self, rows: list[PlanRow]) -> list[int]:
        """k for every row. A decision, not a query: it advances the guards' waits and probes."""
        joined = any(row.pace is not None and not row.pace.plain_s for row in rows)
        self.since_join = 0 if joined else self.since_join + 1
        self.rows_at_join = len(rows) if joined else self.rows_at_join
        fixed = [row.k_max if row.fixed else 0 for row in rows]
        free = sorted({row.method for row in rows if not row.fixed and row.k_max > 0})
        if not free or not any(fixed) and self._plain_due(len(rows)):
            return fixed  # nothing to plan, or plain decoding is due its re-measurement
        guards = {m: self.guard(m, len(rows)) for m in free}
        for m, g in guards.items():  # its first trial's misses were the request's: tried again
            if g.unseen and self._elsewhere(m, g):
                g.restart()
                g.probes = 0
        must = [m for m in free if guards[m].probe_left]
        allowed = [m for m in free if guards[m].k_max or guards[m].probe_left]
        cap = {m: math.inf if guards[m].probe_left else guards[m].k_max for m in allowed}
        ranked, vetoed = [], 0.0
        # A probe runs a window of 2: a miss costs a row less than a new request's slack (a window
        # of 3 put three of 16 tiny-moe rows behind their pace for ~37 steps). One a request behind
        # its pace would lose waits for that request to leave (it measures, it does not promise).
        for window in range(2, 3) if must else range(1, max(row.k_max for row in rows) + 2):
            for mask in range(1 << len(allowed)):
                on = {m for j, m in enumerate(allowed) if mask >> j & 1}
                if not set(must) <= on or (window > 1) != bool(on):
                    continue
                ks = [f if row.fixed else min(window - 1, row.k_max, cap[row.method]) if row.method in on else 0
                      for f, row in zip(fixed, rows)]
                rate = self.expected_rate(rows, ks)
                if window > 1 and self._slows_a_request(rows, ks, probe=bool(must)):
                    vetoed = max(vetoed, rate)
                    continue
                ranked.append((rate, -len(ranked), ks))
        ranked.sort(reverse=True)
        self.held_by_pace += vetoed > (ranked[0][0] if ranked else 0.0)  # what the promise costs
        # Now and then, while drafting, the runner-up once: its cell and deeper drafts measured
        # again (a cell measured once, high by noise, or a position rejected once would stand).
        explore = (len(ranked) > 1 and self.costs.clock % GUARD_MEMORY == GUARD_MEMORY - 1
                   and any(ranked[0][2]))  # plain's best: an idle method waits for its probe
        ks = ranked[1 if explore else 0][2] if ranked else fixed
        self._count_waits(rows, ks, guards)
        return ks

    def expected_rate(self, rows: list[PlanRow], ks: list[int]) -> float:
        tokens = sum(expected_tokens(row.alphas, k) for row, k in zip(rows, ks))
        return tokens / self.costs.seconds(chain_of(rows, ks), len(rows), max(ks) + 1)

    def _slows_a_request(self, rows: list[PlanRow], ks: list[int], probe: bool = False) -> bool:
        """Whether a request expects fewer tokens from this step than plain decoding would commit
        for it in the same seconds, and either is the batch's last (the most tokens left) while
        behind its pace, or while the batch drains where it is offered drafts, or is behind its pace
        and loses a larger share of its step than the batch's rows gain on average (its loss counts
        once per row; each such request alone: summed, three a little behind held 16 rows). A
        draining burst ends with its last request, so its lost second is everyone's: on pace, at the
        margin, it paid for the others' windows (SmolLM2's MTP on json at four clients, 0.92x spec
        off on its own server). The batch drains once no request joined for STRETCH steps and
        one left since (none took its place); a `probe` waits for the quiet alone. While none left,
        the finished ones' places may be taken at once (serve's clients): holding the window for the
        last, DFlash decoded 87 of 107 four-row SmolLM2 steps plainly. While requests join, its
        newest request (the last) holding every row's window cost 16 tiny-wide rows 2.4 %
        (simulated). Without the average, one behind request among 16 held every row's window for
        ~20 steps at a time: tiny-wide through serve, 0.91x k = 1 (prompts that differ; simulated,
        0.93x)."""
        behind = [row.pace is not None and row.pace.behind for row in rows]
        last = max(row.left for row in rows)
        drains = last < math.inf and self.since_join >= STRETCH and (probe or len(rows) < self.rows_at_join)
        if not drains and not any(behind):
            return False  # the common case, asked once per candidate window: nothing to price
        plain_s = self.costs.seconds("", len(rows), 1)
        step_s = self.costs.seconds(chain_of(rows, ks), len(rows), max(ks) + 1)
        gains = [expected_tokens(row.alphas, k) * plain_s - step_s for row, k in zip(rows, ks)]
        lost = [late and g < 0 for late, g in zip(behind, gains)]
        if any(row.left >= last and (lose or (drains and g < 0 and row.k_max and not row.fixed))
               for row, g, lose in zip(rows, gains, lost)):
            return True
        total = sum(gains)
        return any(lose and total + (len(rows) - 1) * g < 0 for lose, g in zip(lost, gains))

    def _plain_due(self, rows: int) -> bool:
        since, measured = self.costs.plain_measured(rows)  # YOUNG steps first: one set what a guard
        # compared with, and one 3x slow (a 10 ms stall on a 4 ms step) had a random draft read 1.29x plain
        return measured < YOUNG or since >= GUARD_MEMORY

    def _count_waits(self, rows: list[PlanRow], ks: list[int], guards: dict[str, Guard]) -> None:
        drafted = {row.method for row, k in zip(rows, ks) if k}
        for method, guard in guards.items():
            if method in drafted and (guard.k_max == math.inf or guard.probe_left):
                guard.waited = 0
                continue
            guard.waited += 1
            if guard.waited >= guard.interval:  # off, or idle by the plan: measure it again
                guard.last = self.speedup(guard.tally) or guard.last
                guard.restart()

    # ---- a step's measurement ----------------------------------------------------------------
    def observe_step(self, rows: list[PlanRow], ks: list[int], seconds: float, tokens: list[int]) -> None:
        """The step just run: `seconds` from plan to commit, `tokens` each row committed."""
        if not self.costs.observe(chain_of(rows, ks), len(rows), max(ks, default=0) + 1, seconds):
            return  # a clock glitch, or one-off work (costs.py): no one's evidence
        plain_s = self.costs.seconds("", len(rows), 1)
        if self.costs.knows(""):  # else nothing to compare a request's steps with
            for row, k, committed in zip(rows, ks, tokens):
                if row.pace is not None:
                    row.pace.observe(committed, seconds, plain_s, speculative=any(ks), drafted=k > 0)
        for method in {row.method for row, k in zip(rows, ks) if k and not row.fixed}:
            guard = self.guard(method, len(rows))
            step = (sum(tokens) / len(rows), sum(min(t, 2) for t in tokens) / len(rows),
                    seconds / self.costs.load, self.costs.base(chain_of(rows, ks), len(rows), 2))
            guard.tally.observe(len(rows), *step)
            guard.deeper.observe(len(rows), *(step if max(ks) > 1 else ()))  # its windows over 2 apart
            guard.steps += 1
            guard.drafts += sum(1 for row, k in zip(rows, ks) if k and row.method == method)
            was, verdict = guard.k_max, None
            if guard.probe_left:
                guard.probe_left -= 1
                if not guard.probe_left:
                    verdict = self._judge(method, guard, ended_probe=True)
            elif guard.steps >= STRETCH:  # a stretch, not a word: a 4-step verdict turned a
                # head off in its hard stretches where it paid 1.2x overall (simulated)
                verdict = self._judge(method, guard, ended_probe=False)
            if guard.k_max != was:
                logger.info("%s %s at batch %d: measured %.2fx plain%s", method,
                            {0: "off", 1: "at k <= 1"}.get(guard.k_max, "on"), bucket(len(rows)),
                            verdict or 0.0, "" if guard.k_max == math.inf else f"; probed within {guard.interval} steps")

    def speedup(self, tally: Tally, first: bool = False) -> float | None:
        """Its steps' tokens at what a plain step costs at each one's row count, over the seconds
        they took, both at the table's load (None: plain decoding never measured). `first`: what
        their first drafts alone would have committed, over what windows of 2 cost in the table."""
        units, spent_s = (tally.firsts, tally.first_s) if first else (tally.units, tally.spent_s)
        known = spent_s and self.costs.knows("")
        return sum(n * self.costs.base("", r, 1) for r, n in units.items()) / spent_s if known else None

    def _judge(self, method: str, guard: Guard, ended_probe: bool) -> float | None:
        """A probe backs off (losing) or resets the interval and lifts a method's cap; only the
        steps the plan chose to draft can lower it (a probe of a method the plan left idle
        measures a step it did not want), and a first trial none of whose drafts landed: the
        start's optimism chose it, and a loss with hits may be the warm-up's (SmolLM2's EAGLE-3
        lost its first trial at 0.74x, then paid). Judged only after 16 steps, a head whose
        drafts never landed drafted ~16 of its first 36 steps: SmolLM2's MTP on tools at one
        client through serve (accepting 0.05), 0.93x spec off; simulated, 0.955-0.963x, and
        0.979-0.984x so.
        Losing where its first drafts alone would have paid (their hits at a window of 2's cost),
        the method keeps its first draft: SmolLM2's MTP at one client read 0.86x plain at windows
        of 3-4 on a hard stretch where they read 0.99x, and off it lost the 1.2x k = 1 gave after.
        Else, or losing at k <= 1, it is off. Its deeper windows trailing its first drafts alone
        cap it too (a probe lifts the cap only where they no longer do): SmolLM2's DFlash at four
        rows read 0.90-0.96x its k = 1 through serve, its plan expecting more of the deeper drafts
        than they gave. They are judged on their own steps: mixed with windows of 2, windows of 4
        paying 0.85x their first drafts alone read within the guard's noise (simulated, 0.955x
        k = 1). A first trial none of whose drafts landed, where the method's first drafts
        land at its other batch sizes, runs on a step at a time while its misses could be their
        luck; one judged before any landed elsewhere is tried again once they do (serve's first
        request, 8 tokens at one row, turned SmolLM2's MTP off there for the next level's whole
        first request: 65 of 105 steps plain). -> the speed-up it judged."""
        speedup, first = self.speedup(guard.tally), self.speedup(guard.tally, first=True)
        guard.last = guard.last if speedup is None else speedup
        losing = self._trails(guard, speedup, 1.0)
        deeper = guard.deeper  # its windows over 2, against what their first drafts alone would have paid
        deeper_lose = bool(guard.k_max) and deeper.weight >= PRIOR_TRIALS and self._trails(
            guard, self.speedup(deeper), self.speedup(deeper, first=True))
        first_lose = self._trails(guard, first, 1.0)  # its first drafts alone, against plain
        if not ended_probe:
            if losing or deeper_lose:
                self._lower(guard, losing, first_lose)
            return speedup
        capped = losing or (guard.k_max == 1 and deeper_lose)
        first_trial = not guard.probes
        elsewhere = self._elsewhere(method, guard)
        luck = elsewhere > 0 and (1 - elsewhere) ** guard.drafts * METHOD_MEMORY >= 1  # over 1 in 200
        if capped and first_trial and not guard.tally.landed and luck:
            guard.probe_left = 1  # judged again a step on: the method's drafts land at other sizes
            return speedup
        backoff = capped and not first_trial  # a first trial's loss is the warm-up's, not a re-probe's
        guard.interval = min(2 * guard.interval, self.probe_steps[1]) if backoff else self.probe_steps[0]
        guard.probes += 1
        if not capped:
            guard.k_max = math.inf
        elif guard.k_max == 1:
            guard.restart(probe=0)  # its first draft is judged on its own steps, not the probe's
        elif first_trial and not guard.tally.landed:
            self._lower(guard, losing, first_lose)
            guard.unseen = not elsewhere
        return speedup

    def _elsewhere(self, method: str, guard: Guard) -> float:
        """How often the method's first drafts landed at its other batch buckets (0: none measured)."""
        others = [g for (m, _), g in self.guards.items() if m == method and g is not guard and g.tally.weight]
        return sum(sum(g.tally.firsts.values()) for g in others) / sum(g.tally.weight for g in others) - 1.0 if others else 0.0

    @staticmethod
    def _lower(guard: Guard, losing: bool, first_lose: bool) -> None:
        """Uncapped and its first drafts alone paying: capped at them; else, losing: off."""
        if guard.k_max == math.inf and not first_lose:
            guard.k_max = 1
            guard.restart(probe=0)
        elif losing:
            guard.k_max = 0

    @staticmethod
    def _trails(guard: Guard, speedup: float | None, bar: float | None) -> bool:
        """Behind `bar` (1.0: plain) by the margin even one standard error up. A step commits 1 to
        k + 1 tokens, so 16 steps of a head worth 1.1x read ~0.95 often (~14 % error at one row); a
        proposer whose drafts never land commits 1 every step: no noise, stopped at once."""
        return None not in (speedup, bar) and speedup * (1.0 + guard.tally.noise) < (1.0 - GUARD_MARGIN) * bar

    # ---- reporting ---------------------------------------------------------------------------
    def explain(self, method: str, rows: int = 1) -> str:
        """One line on where `method` stands at this batch size, for a stats line."""
        guard = self.guards.get((method, bucket(rows)))
        if guard is None:
            return "not measured yet"
        speedup = self.speedup(guard.tally)
        measured = (f"measured {speedup:.2f}x plain" if speedup else f"last measured {guard.last:.2f}x plain"
                    if guard.last else "not measured yet")  # a probe starts its tally afresh
        why = {"off": "", "idle": " (no gain expected at the measured acceptance)",
               "capped": " at its first draft (its deeper windows lost)"}
        if guard.state not in why:
            return f"{guard.state} at batch {rows}: {measured}"
        return (f"{guard.state} at batch {rows}: {measured}{why[guard.state]}; probed again within "
                f"{guard.interval - guard.waited} steps")

    def as_dict(self) -> dict:
        guards: dict = {}
        for (method, b), g in sorted(self.guards.items()):
            speedup = self.speedup(g.tally) or g.last  # restarted: what it measured before
            guards.setdefault(method, {})[str(b)] = {
                "state": g.state, "speedup": round(speedup, 3) if speedup else None,
                "probe_interval": g.interval}
        return {"step_ms": self.costs.as_dict(), "guards": guards, "steps_held_by_pace": self.held_by_pace}


def chain_of(rows: list[PlanRow], ks: list[int]) -> str:
    """The methods whose draft chain a step with these ks runs ("" for none)."""
    return ",".join(sorted({row.method for row, k in zip(rows, ks) if k and row.chained}))
