"""Suffix decoding: propose what followed the longest earlier match of the context's suffix, in
this request's prompt and output and in recent requests' outputs (SuffixDecoding, Oliaro et al.
2024; `method: suffix` in vLLM). Agents restate what their context holds (a rewritten function,
a file read back, the same tool-call shape turn after turn), and a match there is near certain.

Each sequence of tokens is indexed by its anchors (the n-grams of ANCHORS sizes, -> the positions
that end them). A lookup takes the context's last anchor, measures how far back each recent
occurrence matches (up to MAX_MATCH), keeps the occurrences with the longest match m, and walks
their continuations like a frequency tree: each next token is the one most of the remaining
occurrences continue with, and the walk stops when the path's estimated probability falls below
`min_prob` or at `factor · m` tokens (a long match earns a long draft). Proposals are
deterministic (q one-hot), verified losslessly like n-gram's. Indexing costs O(new tokens).

The global index (recent outputs, LRU by request) belongs to the engine's proposer group, so a
request that ends adds its output there; it is bounded by `suffix_cache_requests`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .base import ChainRow, Drafts, Offer, ProposerGroup

ANCHORS = (4, 2)  # anchor n-gram sizes, longest first: a 2-gram only when no 4-gram matches
MAX_MATCH = 48  # how far back a match is measured
MAX_CANDIDATES = 48  # most recent occurrences of an anchor considered per index
PROMPT_TAIL = 16  # prompt tokens kept before a recent answer


def load(runtime, method: str, fallback: bool = True) -> None:
    """Nothing to load: the context and earlier answers are the model."""


def make_group(runtime, method: str, vocab_size: int) -> "SuffixGroup":
    spec = runtime.profile.speculative
    return SuffixGroup(spec.suffix_cache_requests, spec.suffix_factor, spec.suffix_min_prob)


def kv_bytes_per_token(runtime, method: str) -> int:
    return 0


class SuffixIndex:
    """One token sequence (growing), indexed by its anchors."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = {}  # anchor -> positions of its last token, in order
        if tokens:
            self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        tokens, ends = self.tokens, self.ends
        for token in new:
            tokens.append(token)
            end = len(tokens) - 1
            for n in ANCHORS:
                if end >= n - 1:
                    ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)

    def occurrences(self, context: list[int], skip_last: bool) -> list[tuple[int, int]]:
        """(match length, position after the match) for recent occurrences of the context's
        suffix; `skip_last`: the context is this very sequence (its own end is no match)."""
        for n in ANCHORS:
            if len(context) < n:
                continue
            ends = self.ends.get(tuple(context[-n:]))
            if not ends:
                continue
            found = []
            for end in reversed(ends[-MAX_CANDIDATES - 1:]):
                if skip_last and end == len(self.tokens) - 1:
                    continue
                if end + 1 < len(self.tokens):  # something follows it
                    found.append((_match_length(self.tokens, end, context, n), end + 1))
            if found:
                return found[:MAX_CANDIDATES]
        return []


def _match_length(tokens: list[int], end: int, context: list[int], known: int) -> int:
    """How many tokens before and at `end` equal the context's last ones (at least `known`)."""
    length = known
    limit = min(MAX_MATCH, end + 1, len(context))
    while length < limit and tokens[end - length] == context[-1 - length]:
        length += 1
    return length


def scored_walk(candidates: list[tuple[list[int], int]], match: int, k: int, factor: float,
                min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent continuation of (tokens, start) candidates, as a frequency tree walk,
    with each drafted token's estimated path probability (the share of candidates that agree
    on every token so far)."""
    limit = min(k, max(1, int(factor * match)))
    draft: list[int] = []
    probs: list[float] = []
    prob = 1.0
    while candidates and len(draft) < limit:
        counts: dict[int, int] = {}
        for tokens, at in candidates:
            if at < len(tokens):
                counts[tokens[at]] = counts.get(tokens[at], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: item[1])  # a tie: the most recent
        prob *= count / len(candidates)
        if prob < min_prob:
            break
        draft.append(token)
        probs.append(prob)
        candidates = [(tokens, at + 1) for tokens, at in candidates if at < len(tokens) and tokens[at] == token]
    return draft, probs


def with_recent(row: ChainRow) -> bool:
    """A seeded sampling request replays exactly only if its drafts do (rejection sampling's
    outcome depends on them): its drafts come from its own context, never from other requests'."""
    return row.params.seed is None or row.params.is_greedy


class SuffixGroup(ProposerGroup):
    method = "suffix"

    def __init__(self, cache_requests: int = 64, factor: float = 1.0, min_prob: float = 0.1):
        self.rows: dict[int, SuffixIndex] = {}  # request -> its prompt and output
        self.prompt_lengths: dict[int, int] = {}
        self.recent: OrderedDict[int, SuffixIndex] = OrderedDict()  # request -> its output
        self.cache_requests = cache_requests
        self.factor = factor
        self.min_prob = min_prob

    @property
    def keys(self) -> list[int]:
        return list(self.rows)

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        self.rows[key] = SuffixIndex(committed)
        self.prompt_lengths[key] = len(committed) - 1  # the first token is output already

    def leave(self, key: int) -> None:
        """Its output joins the recent answers other requests draft from, behind the end of its
        prompt (a new request's first draft matches across its own prompt's end)."""
        index = self.rows.pop(key, None)
        start = self.prompt_lengths.pop(key, 0)
        if index is None or not self.cache_requests or len(index.tokens) - start < 2:
            return
        self.recent[key] = SuffixIndex(index.tokens[max(0, start - PROMPT_TAIL):])
        while len(self.recent) > self.cache_requests:
            self.recent.popitem(last=False)

    def offer(self, row: ChainRow, alphas) -> Offer:
        found = self.lookup(row.key, row.committed, row.k, with_recent(row))
        return Offer(len(found.tokens), kind=found.source, tokens=found.tokens, probs=found.probs)

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        out = {}
        for row in rows:
            offer = row.offer if row.offer is not None else self.offer(row, None)
            if row.k and offer.tokens:  # a walk cut shorter is a prefix of the longer one
                out[row.key] = Drafts(offer.tokens[:row.k])
        return out

    def lookup(self, key: int, committed: list[int], k: int, recent: bool = True) -> "Lookup":
        """The draft for row `key`, whose tokens are `committed` (indexed first: the index
        follows the row even when it does not draft); `recent`: draft from recent answers too."""
        index = self.rows[key]
        index.extend(committed[len(index.tokens):])
        if not k:
            return Lookup()
        found = [(m, index.tokens, at, True) for m, at in index.occurrences(committed, skip_last=True)]
        for answer in reversed(self.recent.values()) if recent else ():  # the most recent first
            if len(found) >= MAX_CANDIDATES:
                break
            found += [(m, answer.tokens, at, False) for m, at in answer.occurrences(committed, skip_last=False)]
        if not found:
            return Lookup()
        best = max(m for m, _, _, _ in found)
        candidates = [(tokens, at) for m, tokens, at, _ in found if m == best]
        tokens, probs = scored_walk(candidates, best, k, self.factor, self.min_prob)
        own = any(is_own for m, _, _, is_own in found if m == best)
        return Lookup(tokens, probs, "own" if own else "recent")


@dataclass
class Lookup:
    """A suffix draft, each token's path probability, and where its match was found: the
    request's own tokens ("own") or only other requests' answers ("recent")."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    source: str = "own"
