"""A model proposer and suffix decoding on the same row (`mtp+suffix`, `draft+suffix`): each
step, per row, the proposal with the larger expected accepted length. The suffix index knows
when the answer restates its context (its match is long and its continuation agreed on); the
model guesses everything else.

The choice is made before the plan (`outlook`): a row whose suffix draft wins hands the planner
that draft's path probabilities as this step's acceptance, so the planner weighs the two kinds by
what each is expected to yield and charges a suffix row no chain steps; the row's controller
keeps tracking the model's drafts only.

Expected accepted tokens, per row: the suffix draft's Σ path probability (the share of matching
occurrences agreeing on each prefix), scaled by how well such estimates held for this row; the
model's Σ α^j over its k drafts, α its measured per-token acceptance on this row. Both are
tracked from each step's outcome (`settle`). A row drafting from its suffix rides along in the
model's chain with k = 0 and catches up from the committed tokens next time, so the model's
cache never keeps tokens it did not verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import proposers
from .base import ChainRow, Drafts, ProposerGroup
from .suffix import SuffixGroup, make_group as make_suffix_group, with_recent

EWMA = 0.2
MODEL_ALPHA_PRIOR = 0.6  # until measured on the row
SUFFIX_TRUST_PRIOR = 0.9  # path-probability estimates hold this well until measured


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


@dataclass
class RowChoice:
    model_alpha: float = MODEL_ALPHA_PRIOR
    suffix_trust: float = SUFFIX_TRUST_PRIOR
    used: str = ""  # "model" | "suffix" | "": which proposal the last step verified
    drafted: int = 0
    expected: float = 0.0  # what the suffix estimate promised for that draft
    # This step's suffix draft as outlook() found it: (committed length, tokens, path
    # probabilities, whether it beats the model's).
    found: tuple[int, list[int], list[float], bool] | None = None


def suffix_alphas(trust: float, probs: list[float]) -> list[float]:
    """Per-position acceptance whose expected accepted length is trust × Σ path probabilities."""
    alphas, before = [], 1.0
    for i, p in enumerate(probs):
        alphas.append(min(1.0, trust * p) if i == 0 else (p / before if before > 0 else 0.0))
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

    @property
    def keys(self) -> list[int]:
        return list(self.choices)

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        self.model.join(key, committed, prompt_hidden, hidden_start=hidden_start)
        self.suffix.join(key, committed, prompt_hidden, hidden_start=hidden_start)
        self.choices[key] = RowChoice()

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
        tokens, probs = self.suffix.suggest(row.key, row.committed, row.k, with_recent(row))
        wins = bool(tokens) and self._suffix_wins(choice, probs, row.k)
        choice.found = (len(row.committed), tokens, probs, wins)
        return suffix_alphas(choice.suffix_trust, probs) if wins else None

    def _suffix_wins(self, choice: RowChoice, probs: list[float], k: int) -> bool:
        model_gain = sum(choice.model_alpha ** j for j in range(1, min(k, self.model_k_max) + 1))
        return choice.suffix_trust * sum(probs) >= model_gain

    def _found(self, choice: RowChoice, row: ChainRow) -> tuple[list[int], list[float], bool]:
        """The suffix draft for this step: outlook's (the plan counted on its choice), or found now."""
        if choice.found is not None and choice.found[0] == len(row.committed):
            _, tokens, probs, wins = choice.found
            return tokens[:row.k], probs[:row.k], wins and row.k > 0
        tokens, probs = self.suffix.suggest(row.key, row.committed, row.k, with_recent(row))
        return tokens, probs, bool(tokens) and self._suffix_wins(choice, probs, row.k)

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        picked: dict[int, Drafts] = {}
        model_rows = []
        for row in rows:
            choice = self.choices[row.key]
            choice.used, choice.drafted = "", 0
            tokens, probs, suffix_wins = self._found(choice, row)
            choice.found = None
            model_k = min(row.k, self.model_k_max)
            if suffix_wins:
                picked[row.key] = Drafts(tokens)
                choice.used, choice.drafted, choice.expected = "suffix", len(tokens), sum(probs)
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
            n = accepted.get(key, 0)
            if choice.used == "model":
                model_accepted[key] = n
                choice.model_alpha += EWMA * (n / max(choice.drafted, 1) - choice.model_alpha)
            elif choice.used == "suffix":
                # The model's chain ran nothing useful for this row: it keeps none of it.
                ratio = n / choice.expected if choice.expected else 0.0
                choice.suffix_trust += EWMA * (min(ratio, 1.5) - choice.suffix_trust)
        self.model.settle(model_accepted)
