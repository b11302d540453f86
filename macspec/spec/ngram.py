"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from .base import Proposal, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self._index: dict[int, dict[tuple, int]] = {}
        self._indexed = 0

    def start(self, prompt, prompt_hidden, hidden_start=0) -> None:
        self._index = {n: {} for n in self.sizes}
        self._indexed = 0

    def _extend(self, committed: list[int]) -> None:
        # n-gram -> index of the token that followed its latest occurrence (incremental).
        for follow in range(max(self._indexed, 1), len(committed)):
            for n in self.sizes:
                if follow >= n:
                    self._index[n][tuple(committed[follow - n:follow])] = follow
        self._indexed = len(committed)

    def propose(self, committed, k, params, rng) -> Proposal:
        self._extend(committed)
        for n in self.sizes:
            if len(committed) >= n:
                follow = self._index[n].get(tuple(committed[-n:]))
                if follow is not None:
                    return Proposal(committed[follow:follow + k])
        return Proposal([])
