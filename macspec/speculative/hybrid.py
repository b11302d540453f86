"""A model proposer and suffix decoding on the same row (`mtp+suffix`, `draft+suffix`): each
step, per row, the proposal with the larger expected accepted length. The suffix index knows
when the answer restates its context (its match is long and its continuation agreed on); the
model guesses everything else.

The choice is made before the plan, in the row's offer: a row whose suffix draft wins offers
that draft (its kind, "own" or "recent", and its path probabilities), so the plan weighs the
two by what each is expected to yield and charges a suffix row no chain steps. Each kind's
acceptance is the request's own measurement (speculator.py keeps it, per request and kind); a
suffix position is also capped by the share of matching occurrences that agree on it: path
probabilities alone promised 1.0 for a match seen once, and at c = 4 the hybrid drafted 2.6
tokens a step, kept 3 %, and lost 10 %.
A row drafting from its suffix rides along in the model's chain with k = 0 and catches up from
the committed tokens next time, so the model's cache never keeps tokens it did not verify.
"""

from __future__ import annotations

from typing import Callable

from .. import proposers
from .acceptance import expected_tokens
from .base import ChainRow, Drafts, Offer, ProposerGroup
from .suffix import SuffixGroup, make_group as make_suffix_group


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


class HybridGroup(ProposerGroup):
    def __init__(self, method: str, model: ProposerGroup, suffix: SuffixGroup, chain_k_max: int):
        self.method = method
        self.model = model
        self.suffix = suffix
        self.needs_hidden = model.needs_hidden
        self.lazy_chain = model.lazy_chain
        self.chain_k_max = chain_k_max  # the model drafts at most this deep (a suffix draft: up to k)
        self.chained: set[int] = set()  # rows whose drafts this step came from the model's chain

    @property
    def keys(self) -> list[int]:
        return self.suffix.keys

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        self.model.join(key, committed, prompt_hidden, hidden_start=hidden_start)
        self.suffix.join(key, committed, prompt_hidden, hidden_start=hidden_start)

    def leave(self, key: int) -> None:
        self.chained.discard(key)
        self.suffix.leave(key)
        self.model.leave(key)

    def observe(self, key, hidden) -> None:
        self.model.observe(key, hidden)

    def status(self) -> dict:
        return self.model.status()  # its model's joins and kept prefixes (suffix shows none)

    def cache_arrays(self) -> list:
        return self.model.cache_arrays()

    def offer(self, row: ChainRow, alphas: Callable[[str], list[float]]) -> Offer:
        """The suffix's draft where it is expected to yield at least what the model's would."""
        model = Offer(min(row.k, self.chain_k_max), chained=self.lazy_chain)
        suffix = self.suffix.offer(row, alphas)
        if not suffix.k_max:
            return model
        expected = expected_tokens(suffix.alphas(alphas(suffix.kind)), suffix.k_max)
        return suffix if expected >= expected_tokens(alphas(model.kind), model.k_max) else model

    def _offer_of(self, row: ChainRow) -> Offer:
        return row.offer if row.offer is not None else self.offer(row, lambda kind: [])

    def _model_k(self, row: ChainRow, offer: Offer) -> int:
        """How deep the model's chain drafts for the row (0: a suffix draft's row rides along in
        the chain, catching up next time)."""
        return 0 if offer.tokens else min(row.k, self.chain_k_max)

    def start_rows(self, rows: list[ChainRow]) -> None:
        self.model.start_rows([ChainRow(row.key, row.context, self._model_k(row, self._offer_of(row)), row.rng)
                               for row in rows])

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        picked: dict[int, Drafts] = {}
        model_rows = []
        self.chained = set()
        for row in rows:
            offer = self._offer_of(row)
            k = self._model_k(row, offer)
            if offer.tokens and row.k:
                picked[row.key] = Drafts(offer.tokens[:row.k])
            elif k:
                self.chained.add(row.key)
            model_rows.append(ChainRow(row.key, row.context, k, row.rng))
        for key, drafts in self.model.propose(model_rows).items():
            if key in self.chained:
                picked[key] = drafts
        return picked

    def settle(self, accepted: dict[int, int]) -> None:
        """The model keeps what its own drafts earned (a suffix row's chain ran nothing it keeps)."""
        self.model.settle({key: accepted.get(key, 0) for key in self.chained})
        self.chained = set()
