"""Everything speculation keeps across steps and requests, behind one object the engine calls:
one proposer group per method, the batch planner, acceptance priors and probe backoff, totals
per method, and the one fault guard.

Speculation is bookkeeping around the target: whatever raises in here costs speculation (this
step's drafts, a row's proposer, or a method's group), never a request. The engine hands in its
sequences (engine/sequence.py); this module reads their request id, method, proposer, controller
and context, and sets `proposer`/`controller.k_max` when a fault costs a row its proposer.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from .. import faults, proposers
from ..faults import SpecFaults
from ..sampling import RowContext
from .base import ChainRow, Drafts, ProposerGroup
from .controller import AcceptancePrior, RowController
from .planner import BatchPlanner
from .stats import SpecStats


class Speculator:
    def __init__(self, make_group: Callable[[str], ProposerGroup], settings, vocab_size: int,
                 moe: tuple[int, int] | None = None):
        self.make_group = make_group  # method -> a fresh group for every row of that method
        self.settings = settings  # the profile's SpeculativeConfig
        self.vocab_size = vocab_size
        self.planner = BatchPlanner(moe)  # moe: an MoE target's (experts, top-k), for step costs
        self.groups: dict[str, ProposerGroup] = {}
        # Acceptance per draft position by method, across requests: a new request starts here.
        self.priors: dict[str, AcceptancePrior] = {}
        # Probe backoff by method, across requests: a useless proposer is not re-probed at the
        # minimum interval by every new request.
        self.probe_intervals: dict[str, int] = {}
        self.totals: dict[str, SpecStats] = {}
        self.faults = SpecFaults()
        # method -> times its chain into the planner (set by calibration; None: not calibrated).
        self.calibrate_chain: Callable[[str], None] | None = None

    # ---- a new request -----------------------------------------------------------------------
    def group(self, method: str) -> ProposerGroup | None:
        if method == proposers.PLAIN:
            return None
        if method not in self.groups:
            group = self.groups[method] = self.make_group(method)
            if group.max_chain is not None:
                self.planner.chain_caps[method] = group.max_chain
            if self.calibrate_chain is not None and method not in self.planner.chain_cost:
                self.guarded("cost_model", self.calibrate_chain, method)  # drops nothing
        return self.groups[method]

    def controller(self, method: str, k_max: int, adaptive: bool, processed: bool = False) -> RowController:
        prior = self.priors.get(method)
        return RowController(k_max, adaptive, method, self.settings.probe_min_steps,
                             self.settings.probe_max_steps, prior=prior.alphas if prior else None,
                             first_probe_interval=self.probe_intervals.get(method), processed=processed)

    def start(self, seq, hidden: mx.array | None, hidden_start: int) -> None:
        """`seq`'s prompt is in and its first token committed: its proposer takes it on."""
        if self._orphaned(seq):
            return
        self.guarded("proposer_start", seq.proposer.join, seq.request.id, seq.committed, hidden,
                     hidden_start=hidden_start, drop=seq)

    # ---- one decode step ---------------------------------------------------------------------
    def plan(self, seqs: list, max_context: int) -> list[int]:
        """k for every row: the planner's choice, within each row's room; 0 without a proposer."""
        for seq in seqs:
            self._orphaned(seq)
        self._retain(seqs)
        for seq in seqs:
            self._look_ahead(seq, max_context)
        ks = self.guarded("plan", self.planner.plan, [s.controller for s in seqs])
        if ks is None or len(ks) != len(seqs):
            return [0] * len(seqs)
        return [min(max(0, int(k)), seq.room(max_context)) if seq.proposer is not None else 0
                for k, seq in zip(ks, seqs)]

    def _look_ahead(self, seq, max_context: int) -> None:
        """What the row's proposer already knows of this step before the plan (controller.py:
        `outlook`, `draft_limit`)."""
        controller = seq.controller
        controller.outlook = controller.draft_limit = None
        if seq.proposer is None:
            return
        row = ChainRow(seq.request.id, seq.context(), min(controller.k_max, seq.room(max_context)), seq.rng)
        controller.outlook = self.guarded("propose", seq.proposer.outlook, row, drop=seq)
        if seq.proposer is not None:
            controller.draft_limit = len(controller.outlook) if controller.outlook is not None else \
                self.guarded("propose", seq.proposer.draft_limit, row, drop=seq)

    def propose(self, seqs: list, ks: list[int]) -> list[Drafts | None]:
        """Each group drafts for all of its rows; a fault costs that group's rows their drafts."""
        out: list[Drafts | None] = [None] * len(seqs)
        for method, group in list(self.groups.items()):
            members = [(i, s) for i, s in enumerate(seqs) if s.proposer is group]
            if not any(ks[i] for i, _ in members):
                continue
            t0 = time.perf_counter()
            chain = [ChainRow(s.request.id, _draft_context(s, ks[i]), ks[i], s.rng) for i, s in members]
            drafts = self.guarded("propose", self._checked_drafts, group, chain, drop=method)
            if drafts is None:
                continue
            if not group.lazy_chain:  # host proposers are timed here
                self.guarded("cost_model", self.planner.observe_proposer, method,
                             max(ks[i] for i, _ in members), time.perf_counter() - t0)
            for i, s in members:
                out[i] = drafts.get(s.request.id)
        return out

    def cache_arrays(self) -> list:
        """The groups' caches, evaluated in the step's one host sync."""
        return [a for group in self.groups.values() for a in group.cache_arrays()]

    def observe(self, seq, drafted: int, accepted: int, emitted: int, hidden: mx.array) -> None:
        """One row's outcome: its stats, its proposer's view of the target, its controller."""
        seq.stats.spec.observe_step(drafted, accepted, emitted)
        self.totals.setdefault(seq.method, SpecStats()).observe_step(drafted, accepted, emitted)
        if not self._orphaned(seq) and seq.proposer.needs_hidden:
            seq.keep_states(hidden)
            self.guarded("proposer_observe", seq.proposer.observe, seq.request.id, hidden, drop=seq)
        self.guarded("controller", self._observe_controller, seq.controller, drafted, accepted)

    def settle(self, accepted: dict[int, int]) -> None:
        """Every group rolls its rows back to the drafts they kept."""
        for method, group in list(self.groups.items()):
            self.guarded("proposer_observe", group.settle, accepted, drop=method)

    def observe_step(self, seqs: list, ks: list[int], width: int, forward_s: float, commit_s: float) -> None:
        """The step's measured cost (a window `width` wide), drafting taken out, refines the
        planner's cost model."""
        drafting = self.guarded("cost_model", self.planner.draft_seconds, [s.controller for s in seqs], ks)
        self.guarded("cost_model", self.planner.observe_step, len(seqs), width,
                     max(forward_s - (drafting or 0.0), 0.0), commit_s, drafting or 0.0)

    # ---- ends --------------------------------------------------------------------------------
    def leave(self, seq) -> None:
        if seq.proposer is not None and seq.proposer is self.groups.get(seq.method):
            self.guarded("proposer_observe", seq.proposer.leave, seq.request.id, drop=seq.method)
        seq.proposer = None

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
                source = f"proposer:{drop.method}"
                self._drop_proposer(drop)
            self.faults.record(source, exc)
            return None

    def _drop_proposer(self, seq) -> None:
        """This row decodes plainly from now on; its group forgets it."""
        group, seq.proposer = seq.proposer, None
        seq.controller.k_max = 0
        if group is not None:
            try:
                group.leave(seq.request.id)
            except Exception:  # the group's own state is suspect: its next fault drops it
                pass

    def _orphaned(self, seq) -> bool:
        """A row whose group was dropped after a fault decodes plainly (-> True)."""
        if seq.proposer is None:
            return True
        if seq.proposer is self.groups.get(seq.method):
            return False
        seq.proposer = None
        seq.controller.k_max = 0
        return True

    def _retain(self, seqs: list) -> None:
        """Rows that left the batch (finished, cancelled, failed) leave their group."""
        for method, group in list(self.groups.items()):
            live = {s.request.id for s in seqs if s.proposer is group}
            for key in group.keys:
                if key not in live:
                    self.guarded("proposer_observe", group.leave, key, drop=method)

    def _checked_drafts(self, group: ProposerGroup, chain: list[ChainRow]) -> dict[int, Drafts]:
        drafts = group.propose(chain)
        for d in drafts.values():
            if isinstance(d.tokens, list) and any(t < 0 or t >= self.vocab_size for t in d.tokens):
                raise ValueError(f"proposed token id out of range [0, {self.vocab_size})")
        return drafts

    def _observe_controller(self, controller: RowController, drafted: int, accepted: int) -> None:
        if controller.k_max == 0:  # plain decoding: nothing to decide
            return
        if controller.outlook is not None:  # a lookup's step: its group tracks how those hold
            controller.last_k = drafted
            return
        controller.observe(drafted, accepted, not controller.adaptive or self.planner.pays_alone(controller))
        if controller.num_probes:
            self.probe_intervals[controller.method] = controller.probe_interval
        if drafted:
            self.priors.setdefault(controller.method, AcceptancePrior()).observe(drafted, accepted)

    # ---- across runs and for /v1/status --------------------------------------------------------
    def remembered_priors(self, path, target: str) -> Callable[[], None]:
        """Load the acceptance priors saved at `path` for this target and each method's own
        model; -> a function that saves them back (call it when done)."""
        from . import priors

        keys = {p.name: priors.pair_key(p.name, target, proposers.own_model(p.name, self.settings),
                                        paired=p.model_key is not None)
                for p in proposers.PROPOSERS}
        self.priors.update({m: AcceptancePrior(a) for m, a in priors.load(path, keys).items()})
        return lambda: priors.save(path, keys, {m: p.alphas for m, p in self.priors.items()})

    def status(self) -> dict:
        return {
            "speculation": {m: st.as_dict() for m, st in self.totals.items()},
            "speculation_faults": self.faults.as_dict(),
            "acceptance_priors": {m: [round(a, 3) for a in p.alphas] for m, p in self.priors.items()},
            "cost_model": self.planner.as_dict(),
        }


def _draft_context(seq, k: int) -> RowContext:
    """A grammar's mask is known on the host for the first draft only (the later positions
    depend on lazy drafts): the proposer drafts that one inside the grammar."""
    if seq.constraint is None or not k:
        return seq.context()
    return seq.context(seq.constraint.masks([])[0])
