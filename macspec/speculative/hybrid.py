"""A model proposer and suffix decoding on the same row (`mtp+suffix`, `draft+suffix`): each
step, per row, the proposal with the larger expected accepted length. The suffix index knows
when the answer restates its context (its match is long and its continuation agreed on); the
model guesses everything else.

The choice is made before the plan (`outlook`): a row whose suffix draft wins hands the planner
that draft's expected acceptance per position, so the planner weighs the two kinds by what each
is expected to yield and charges a suffix row no chain steps; the row's controller keeps
tracking the model's drafts only.

Expected accepted tokens, per row, from each kind's measured acceptance per draft position on
that row (a running mean, as the controller keeps; a new row starts from the group's record of
that kind over earlier rows): the model's drafts; suffix drafts matched in the row's own tokens;
suffix drafts matched only in other requests' answers. A suffix position is also capped by the
share of matching occurrences that agree on it. Path probabilities alone promised 1.0 for a
match seen once: at c = 4 the hybrid drafted 2.6 tokens a step and kept 3 %, and lost 10 %.
A row drafting from its suffix rides along in the model's chain with k = 0 and catches up from
the committed tokens next time, so the model's cache never keeps tokens it did not verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import proposers
from .base import ChainRow, Drafts, ProposerGroup
from .controller import ALPHA_PRIOR, AcceptancePrior, expected_tokens, observe_acceptance
from .suffix import Lookup, SuffixGroup, make_group as make_suffix_group, with_recent

# The kinds of draft a row's acceptance is tracked for: the model's, and suffix drafts by where
# their match was found (a request restating itself is not one echoing another's answer).
KINDS = ("model", "own", "recent")
DEPTH = 32  # draft positions tracked (suffix_max_tokens' upper bound)


def _model_method(method: str) -> str:
    return proposers.BY_NAME[method].parts[0]


def load(runtime, method: str, fallback: bool = True) -> None:
    model = _model_method(method)
    proposers.implementation(model).load(runtime, model, fallback=False)


def make_group(runtime, method: str, vocab_size: int) -> "HybridGroup":
    model = _model_method(method)
    return HybridGroup(method, proposers.implementation(model).make_group(runtime, model, vocab_size),
                       make_suffix_group(runtime, proposers.BY_NAME[method].parts[1], vocab_size),
                       runtime.profile.speculative.num_draft_tokens)


def kv_bytes_per_token(runtime, method: str) -> int:
    model = _model_method(method)
    return proposers.implementation(model).kv_bytes_per_token(runtime, model)


class Tracked:
    """One kind of draft's acceptance per position on one row: a running mean (controller.py),
    starting from the group's record of that kind, or from ALPHA_PRIOR where that is higher: a
    kind that failed on earlier requests (chat) is tried afresh on each new one (an edit), since
    a row's estimate only moves when that kind drafts for it."""

    def __init__(self, record: AcceptancePrior | None = None):
        start = [max(alpha, ALPHA_PRIOR) for alpha in record.alphas[:DEPTH]] if record else []
        self.alphas = start + [start[-1] if start else ALPHA_PRIOR] * (DEPTH - len(start))
        self.prior = list(self.alphas)
        self.reached = [0] * DEPTH

    def observe(self, drafted: int, accepted: int) -> None:
        observe_acceptance(self.alphas, min(drafted, DEPTH), accepted, self.reached, self.prior)


@dataclass
class RowChoice:
    tracked: dict[str, Tracked]
    used: str = ""  # a KINDS entry, or "": which proposal the last step verified
    drafted: int = 0
    # This step's suffix draft as outlook() found it: (committed length, the lookup, whether it
    # beats the model's).
    found: tuple[int, Lookup, bool] | None = None
    isolated: bool = False  # its estimates start from no other request's (a seeded replay)


def suffix_alphas(tracked: list[float], probs: list[float]) -> list[float]:
    """Per-position acceptance of a suffix draft: what such drafts achieved on the row, capped
    by the share of matching occurrences that agree on the token given the ones before it."""
    alphas, before = [], 1.0
    for measured, p in zip(tracked, probs):
        alphas.append(min(measured, p / before if before > 0 else 0.0))
        before = p
    return alphas


class HybridGroup(ProposerGroup):
    def __init__(self, method: str, model: ProposerGroup, suffix: SuffixGroup, model_k_max: int):
        self.method = method
        self.model = model
        self.suffix = suffix
        self.model_k_max = model_k_max  # the model drafts at most this deep (suffix: up to k)
        self.needs_hidden = model.needs_hidden
        self.lazy_chain = model.lazy_chain  # its model's chain is what a drafting step costs
        self.max_chain = model_k_max  # drafts beyond it are the suffix's
        self.choices: dict[int, RowChoice] = {}
        # Each kind's acceptance over all rows so far: where a new row's estimates start.
        self.records = {kind: AcceptancePrior() for kind in KINDS}

    @property
    def keys(self) -> list[int]:
        return list(self.choices)

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        self.model.join(key, committed, prompt_hidden, hidden_start=hidden_start)
        self.suffix.join(key, committed, prompt_hidden, hidden_start=hidden_start)
        self.choices[key] = RowChoice({kind: Tracked(record) for kind, record in self.records.items()})

    def leave(self, key: int) -> None:
        self.choices.pop(key, None)
        self.suffix.leave(key)
        self.model.leave(key)

    def observe(self, key, hidden) -> None:
        self.model.observe(key, hidden)

    def cache_arrays(self) -> list:
        return self.model.cache_arrays()

    def outlook(self, row: ChainRow) -> list[float] | None:
        choice = self.choices.get(row.key)
        if choice is None:
            return None
        found, alphas, wins = self._weigh(choice, row)
        choice.found = (len(row.committed), found, wins)
        return alphas if wins else None

    def _weigh(self, choice: RowChoice, row: ChainRow) -> tuple[Lookup, list[float], bool]:
        """The row's suffix draft, its expected acceptance per position, and whether it is
        expected to yield at least what the model's k drafts would."""
        if not with_recent(row) and not choice.isolated:
            # A seeded request replays exactly only if its choices do: nothing from other requests.
            choice.tracked, choice.isolated = {kind: Tracked() for kind in KINDS}, True
        found = self.suffix.lookup(row.key, row.committed, row.k, with_recent(row))
        if not found.tokens:
            return found, [], False
        alphas = suffix_alphas(choice.tracked[found.source].alphas, found.probs)
        model_k = min(row.k, self.model_k_max)
        wins = expected_tokens(alphas, len(alphas)) >= expected_tokens(choice.tracked["model"].alphas, model_k)
        return found, alphas, wins

    def _found(self, choice: RowChoice, row: ChainRow) -> tuple[Lookup, bool]:
        """The suffix draft for this step: outlook's (the plan counted on its choice), or found now."""
        if choice.found is not None and choice.found[0] == len(row.committed):
            _, found, wins = choice.found
        else:
            found, _, wins = self._weigh(choice, row)
        return Lookup(found.tokens[:row.k], found.probs[:row.k], found.source), wins and row.k > 0

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        picked: dict[int, Drafts] = {}
        model_rows = []
        for row in rows:
            choice = self.choices[row.key]
            choice.used, choice.drafted = "", 0
            found, suffix_wins = self._found(choice, row)
            choice.found = None
            model_k = min(row.k, self.model_k_max)
            if suffix_wins:
                picked[row.key] = Drafts(found.tokens)
                choice.used, choice.drafted = found.source, len(found.tokens)
                model_k = 0  # rides along in the model's chain, catching up next time
            elif model_k:
                choice.used, choice.drafted = "model", model_k
            model_rows.append(ChainRow(row.key, row.context, model_k, row.rng))
        drafts = self.model.propose(model_rows)
        for key, d in drafts.items():
            if self.choices[key].used == "model":
                picked[key] = d
        return picked

    def settle(self, accepted: dict[int, int]) -> None:
        model_accepted = {}
        for key, choice in self.choices.items():
            if not choice.used:
                continue
            n = accepted.get(key, 0)
            # Once: a step the plan gave no drafts proposes nothing, and must not count this again.
            kind, choice.used = choice.used, ""
            choice.tracked[kind].observe(choice.drafted, n)
            self.records[kind].observe(choice.drafted, n)
            if kind == "model":  # a suffix row: the model's chain ran nothing it keeps
                model_accepted[key] = n
        self.model.settle(model_accepted)
