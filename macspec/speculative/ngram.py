"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

from .base import ChainRow, Drafts, Offer, ProposerGroup


def load(runtime, method: str, fallback: bool = True) -> None:
    """Nothing to load: the context is the model."""


def make_group(runtime, method: str, vocab_size: int) -> "NgramGroup":
    spec = runtime.profile.speculative
    return NgramGroup(spec.ngram_max, spec.ngram_min)


def kv_bytes_per_token(runtime, method: str) -> int:
    return 0


class NgramIndex:
    """One row's index: n-gram -> where the token after its latest occurrence sits."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in sizes}
        self.indexed = 0

    def lookup(self, committed: list[int], k: int) -> list[int]:
        for follow in range(max(self.indexed, 1), len(committed)):  # incremental
            for n in self.sizes:
                if follow >= n:
                    self.index[n][tuple(committed[follow - n:follow])] = follow
        self.indexed = len(committed)
        for n in self.sizes:
            if len(committed) >= n:
                follow = self.index[n].get(tuple(committed[-n:]))
                if follow is not None:
                    return committed[follow:follow + k]
        return []


class NgramGroup(ProposerGroup):
    method = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1):
        self.sizes = range(ngram_max, ngram_min - 1, -1)
        self.rows: dict[int, NgramIndex] = {}

    @property
    def keys(self) -> list[int]:
        return list(self.rows)

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        self.rows[key] = NgramIndex(self.sizes)

    def leave(self, key: int) -> None:
        self.rows.pop(key, None)

    def offer(self, row: ChainRow, alphas) -> Offer:
        tokens = self.rows[row.key].lookup(row.committed, row.k) if row.k else []
        return Offer(len(tokens), tokens=tokens)

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        out = {}
        for row in rows:
            offer = row.offer if row.offer is not None else self.offer(row, None)
            if row.k and offer.tokens:
                out[row.key] = Drafts(offer.tokens[:row.k])
        return out
