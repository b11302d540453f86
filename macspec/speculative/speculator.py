"""Everything speculation keeps across steps and requests, behind one object the engine calls:
one proposer group per method, a record per request (its proposer, k_max, acceptance per draft
kind, counters), the acceptance priors across requests, the policy that decides k (policy.py),
totals per method, and the one fault guard.

Speculation is bookkeeping around the target: whatever raises in here costs speculation (this
step's drafts, a request's proposer, or a method's group), never a request. The engine's
Sequence holds its request's Record; only this module writes one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .. import faults, proposers
from ..faults import SpecFaults
from ..sampling import RowContext
from .acceptance import ALPHA_PRIOR, METHOD_MEMORY, Acceptance, observe_step, remember, share_weight
from .base import ChainRow, Drafts, Offer, ProposerGroup
from .policy import Pace, PlanRow, Policy
from .stats import SpecStats

LOOKUP_KINDS = ("own", "recent")  # draft kinds a lookup's match finds (base.Offer.kind)


@dataclass
class Record:
    """One request's speculation."""

    method: str
    group: ProposerGroup | None  # its method's group; None: it decodes plainly
    k_max: int  # the most it drafts a step
    adaptive: bool  # False: k = k_max every step (a fixed-k request)
    acceptance: dict[str, Acceptance]  # by draft kind (base.Offer.kind)
    starts: dict[str, list[float]]  # where a kind's estimate starts on it, per position
    stats: SpecStats = field(default_factory=SpecStats)
    pace: Pace = field(default_factory=Pace)  # its decode time against plain decoding's
    offer: Offer | None = None  # its proposer's offer for this step
    k: int = 0  # drafts verified in the last step

    def alphas(self, kind: str) -> list[float]:
        if kind not in self.acceptance:
            self.acceptance[kind] = Acceptance(self.starts.get(kind))
        return self.acceptance[kind].alphas(self.k_max)

    def as_dict(self) -> dict:
        return {"k_max": self.k_max, "adaptive": self.adaptive, "last_k": self.k,
                "acceptance": {kind: [round(a, 3) for a in self.alphas(kind)] for kind in self.acceptance}}


class Speculator:
    def __init__(self, make_group: Callable[[str], ProposerGroup], settings, vocab_size: int):
        self.make_group = make_group  # method -> a fresh group for every row of that method
        self.settings = settings  # the profile's SpeculativeConfig
        self.vocab_size = vocab_size
        self.policy = Policy(settings.probe_min_steps, settings.probe_max_steps)
        self.groups: dict[str, ProposerGroup] = {}
        # (method, kind) -> acceptance per draft position across requests: a new request starts here.
        self.priors: dict[tuple[str, str], Acceptance] = {}
        self.remembered: dict[str, float] = {}  # method -> the acceptance a saved prior started at
        # (method, kind) -> recently finished adaptive requests' estimates (acceptance.remember).
        self.finished: dict[tuple[str, str], list[Acceptance]] = {}
        self.totals: dict[str, SpecStats] = {}
        self.faults = SpecFaults()
        self.step_rows: list[PlanRow] = []  # the last plan's view of its rows
        self.start_s = 0.0  # this step's first-proposal prefills (base.start_rows), seconds
        self.catch_up_s = 0.0  # all of them so far: speculation's cost outside the step table
        # method -> seeds its chain's step costs (set by calibration; None: not calibrated).
        self.calibrate_chain: Callable[[str], None] | None = None

    # ---- a new request -----------------------------------------------------------------------
    def group(self, method: str) -> ProposerGroup | None:
        if method == proposers.PLAIN:
            return None
        if method not in self.groups:
            self.groups[method] = self.make_group(method)
            if self.calibrate_chain is not None and not self.policy.costs.knows(method):
                self.guarded("cost_model", self.calibrate_chain, method)  # drops nothing
        return self.groups[method]

    def admit(self, method: str, k_max: int, adaptive: bool, isolated: bool = False) -> Record:
        """A request's record. `isolated`: its estimates start from no other request's (a seeded
        sampling request replays exactly only if its choices do)."""
        group = self.group(method)
        starts = {} if isolated else {kind: prior.measured(k_max)
                                      for (m, kind), prior in self.priors.items() if m == method}
        for kind in LOOKUP_KINDS:  # a lookup kind's record is the request's own: an edit
            if kind in starts:  # restates where a chat never did, so each request tries afresh
                starts[kind] = [max(starts[kind][0], ALPHA_PRIOR)]
        return Record(method, group, 0 if group is None else k_max, adaptive, {}, starts)

    def start(self, seq, hidden: mx.array | None, hidden_start: int) -> None:
        """`seq`'s prompt is in and its first token committed: its proposer takes it on."""
        if self._orphaned(seq):
            return
        self.guarded("proposer_start", seq.spec.group.join, seq.request.id, seq.committed, hidden,
                     hidden_start=hidden_start, drop=seq)

    # ---- one decode step ---------------------------------------------------------------------
    def plan(self, seqs: list, max_context: int) -> list[int]:
        """k for every row: the policy's choice within each row's room and its proposer's offer."""
        for seq in seqs:
            self._orphaned(seq)
        self._retain(seqs)
        self.guarded("acceptance", self._share_weights, seqs)
        self.step_rows = [self._plan_row(seq, max_context) for seq in seqs]
        ks = self.guarded("plan", self.policy.plan, self.step_rows)
        if ks is None or len(ks) != len(seqs):
            return [0] * len(seqs)
        return [min(max(0, int(k)), row.k_max) for k, row in zip(ks, self.step_rows)]

    def _share_weights(self, seqs: list) -> None:
        """Each method's adaptive requests shrink toward what they accept together, per draft kind
        (acceptance.share_weight). A fixed-k request (a seeded one) keeps its own, and so does a
        lookup's: its matches are its own context's."""
        estimates: dict[tuple[str, str], list[Acceptance]] = {}
        for seq in seqs:
            for kind, estimate in _shared(seq.spec):
                estimates.setdefault((seq.spec.method, kind), []).append(estimate)
        for key, group in estimates.items():
            share_weight(group, self.finished.get(key, ()), self.priors.get(key))

    def _plan_row(self, seq, max_context: int) -> PlanRow:
        record = seq.spec
        record.offer = None
        k = min(record.k_max, seq.room(max_context))
        if record.group is not None:
            row = ChainRow(seq.request.id, seq.context(), k, seq.rng)
            record.offer = self.guarded("propose", record.group.offer, row, record.alphas, drop=seq)
        if record.offer is None:
            return PlanRow(record.method, 0, [], fixed=not record.adaptive, pace=record.pace, left=seq.left)
        k = min(k, record.offer.k_max)
        return PlanRow(record.method, k, record.offer.alphas(record.alphas(record.offer.kind)),
                       record.offer.chained, fixed=not record.adaptive, pace=record.pace, left=seq.left)

    def propose(self, seqs: list, ks: list[int]) -> list[Drafts | None]:
        """Each group drafts for all of its rows; a fault costs that group's rows their drafts."""
        out: list[Drafts | None] = [None] * len(seqs)
        for method, group in list(self.groups.items()):
            members = [(i, s) for i, s in enumerate(seqs) if s.spec.group is group]
            if not any(ks[i] for i, _ in members):
                continue
            chain = [ChainRow(s.request.id, _draft_context(s, ks[i]), ks[i], s.rng, s.spec.offer)
                     for i, s in members]
            started = time.perf_counter()
            self.guarded("proposer_start", group.start_rows, chain, drop=method)
            spent = time.perf_counter() - started
            self.start_s += spent
            self.catch_up_s += spent
            if self.groups.get(method) is not group:  # it faulted taking rows on: dropped
                continue
            drafts = self.guarded("propose", self._checked_drafts, group, chain, drop=method)
            for i, s in members:
                out[i] = (drafts or {}).get(s.request.id)
        return out

    def cache_arrays(self) -> list:
        """The groups' caches, evaluated in the step's one host sync."""
        return [a for group in self.groups.values() for a in group.cache_arrays()]

    def observe(self, seq, drafted: int, accepted: int, emitted: int, hidden: mx.array) -> None:
        """One row's outcome: its counters, its proposer's view of the target, its acceptance."""
        record = seq.spec
        record.k = drafted
        record.stats.observe_step(drafted, accepted, emitted)
        self.totals.setdefault(record.method, SpecStats()).observe_step(drafted, accepted, emitted)
        if not self._orphaned(seq) and record.group.needs_hidden:
            seq.keep_states(hidden)
            self.guarded("proposer_observe", record.group.observe, seq.request.id, hidden, drop=seq)
        self.guarded("acceptance", self._observe_acceptance, record, drafted, accepted)

    def _observe_acceptance(self, record: Record, drafted: int, accepted: int) -> None:
        """A step that drafted measures its kind, here and in the method's prior; every step ages
        the request's evidence, drafted or not (acceptance.py)."""
        kind = record.offer.kind if drafted and record.offer is not None else None
        if kind is not None:
            record.alphas(kind)  # made from its start if this is its first
            prior = self.priors.setdefault((record.method, kind), Acceptance(memory=METHOD_MEMORY))
            prior.observe(drafted, accepted)
        observe_step(record.acceptance, kind, drafted, accepted)

    def settle(self, accepted: dict[int, int]) -> None:
        """Every group rolls its rows back to the drafts they kept."""
        for method, group in list(self.groups.items()):
            self.guarded("proposer_observe", group.settle, accepted, drop=method)

    def observe_step(self, ks: list[int], seconds: float, tokens: list[int]) -> None:
        """The step just run (plan to commit) and the tokens each row committed, for the policy: less
        the rows' first-proposal prefills (a request's cost, not a step's: counted in the step,
        one draft-model prefill priced every probe of a new request as a loss)."""
        spent, self.start_s = seconds - self.start_s, 0.0
        if len(ks) == len(self.step_rows):
            self.guarded("cost_model", self.policy.observe_step, self.step_rows, ks, spent, tokens)

    # ---- ends --------------------------------------------------------------------------------
    def leave(self, seq) -> None:
        record = seq.spec
        for kind, estimate in _shared(record):
            self.guarded("acceptance", remember, self.finished.setdefault((record.method, kind), []), estimate)
        if record.group is not None and record.group is self.groups.get(record.method):
            self.guarded("proposer_observe", record.group.leave, seq.request.id, drop=record.method)
        record.group = None

    def reset(self) -> None:
        """Every row is gone (a failed step): fresh groups for the next requests."""
        self.groups.clear()

    # ---- the one fault guard -----------------------------------------------------------------
    def guarded(self, point: str, fn, *args, drop=None, **kwargs):
        """Run bookkeeping `fn` (fault point `point`); on a fault count it, log it once and return
        None. `drop` is what the fault costs beyond this step: a sequence loses its proposer for
        the rest of its request, a method loses its group (every row it held decodes plainly;
        new requests get a fresh group) — in both cases the proposer's state is unknown."""
        try:
            faults.check(point)
            return fn(*args, **kwargs)
        except Exception as exc:
            source = point
            if isinstance(drop, str):
                source = f"proposer:{drop}"
                self.groups.pop(drop, None)
            elif drop is not None:
                source = f"proposer:{drop.spec.method}"
                self._drop_proposer(drop)
            self.faults.record(source, exc)
            return None

    def _drop_proposer(self, seq) -> None:
        """This row decodes plainly from now on; its group forgets it."""
        group, seq.spec.group, seq.spec.k_max = seq.spec.group, None, 0
        if group is not None:
            try:
                group.leave(seq.request.id)
            except Exception:  # the group's own state is suspect: its next fault drops it
                pass

    def _orphaned(self, seq) -> bool:
        """A row whose group was dropped after a fault decodes plainly (-> True)."""
        record = seq.spec
        if record.group is None:
            return True
        if record.group is self.groups.get(record.method):
            return False
        record.group, record.k_max = None, 0
        return True

    def _retain(self, seqs: list) -> None:
        """Rows that left the batch (finished, cancelled, failed) leave their group."""
        for method, group in list(self.groups.items()):
            live = {s.request.id for s in seqs if s.spec.group is group}
            for key in group.keys:
                if key not in live:
                    self.guarded("proposer_observe", group.leave, key, drop=method)

    def _checked_drafts(self, group: ProposerGroup, chain: list[ChainRow]) -> dict[int, Drafts]:
        drafts = group.propose(chain)
        for d in drafts.values():
            if isinstance(d.tokens, list) and any(t < 0 or t >= self.vocab_size for t in d.tokens):
                raise ValueError(f"proposed token id out of range [0, {self.vocab_size})")
        return drafts

    # ---- across runs and for /v1/status --------------------------------------------------------
    def remembered_priors(self, path, target: str) -> Callable[[], None]:
        """Load the acceptance priors saved at `path` for this target and each method's own
        model; -> a function that saves them back (call it when done)."""
        from . import kept

        keys = {p.name: kept.pair_key(p.name, target, proposers.own_model(p.name, self.settings),
                                      paired=p.model_key is not None)
                for p in proposers.PROPOSERS}
        for method, alphas in kept.load_priors(path, keys).items():
            self.priors[(method, "drafts")] = Acceptance(alphas, memory=METHOD_MEMORY)
            self.remembered[method] = alphas[0]
        return lambda: kept.save_priors(path, keys, {m: p.alphas(self.settings.num_draft_tokens)
                                                     for (m, kind), p in self.priors.items() if kind == "drafts"})

    def status(self) -> dict:
        acceptance: dict = {}
        for (method, kind), prior in sorted(self.priors.items()):
            acceptance.setdefault(method, {})[kind] = [round(a, 3) for a in prior.alphas(
                max(len(prior.trials), 1))]
        return {
            "speculation": {m: st.as_dict() for m, st in self.totals.items()},
            "speculation_faults": self.faults.as_dict(),
            "acceptance_priors": acceptance,
            "policy": self.policy.as_dict(),
            "catch_up_s": round(self.catch_up_s, 3),
            "proposers": {m: st for m, g in self.groups.items() if (st := g.status())},
        }


def _shared(record: Record) -> list[tuple[str, Acceptance]]:
    """The estimates a record shares with its method's other requests: an adaptive request's,
    of a model proposer's kind (a lookup's matches are its own context's)."""
    if not record.adaptive:
        return []
    return [(kind, e) for kind, e in record.acceptance.items() if kind not in LOOKUP_KINDS]


def _draft_context(seq, k: int) -> RowContext:
    """A grammar's mask is known on the host for the first draft only (the later positions
    depend on lazy drafts): the proposer drafts that one inside the grammar."""
    if seq.constraint is None or not k:
        return seq.context()
    return seq.context(seq.constraint.masks([])[0])
