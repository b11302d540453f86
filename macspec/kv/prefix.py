"""Which finished requests' KV to keep for prompts that start with the same tokens.

This is the index only (tokens -> entry id, sizes, LRU order); the KV itself lives in each
rank's TargetRunner under the entry id, so under tensor parallelism rank 0 decides what is kept
and evicted and every rank stores and drops the same entries. Lookups walk a radix tree: agent
prompts are 10-50k tokens and a scan over every entry would cost entries x tokens.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from .radix import RadixTree

MIN_REUSE = 4  # shorter shared prefixes are not worth a copy


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], tuple[int, int]] = OrderedDict()  # -> (id, bytes)
        self.tree = RadixTree()
        self._ids = itertools.count()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def lookup(self, prompt: list[int], usable=None) -> tuple[int, int | None]:
        """(m, entry id) of the longest stored prefix of `prompt`; m <= len(prompt) - 1 so the
        last prompt token is always computed (its logits start the generation). `usable(entry)`
        caps how many of the matched entry's tokens the caller can take (default: all)."""
        if usable is None:
            best_len, best_key = self.tree.longest_match(prompt)
            best_len = min(best_len, len(prompt) - 1)
        else:
            best_len, best_key = self._longest_usable(prompt, len(prompt) - 1, usable)
        if best_key is None or best_len < MIN_REUSE:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_len
        return best_len, self.entries[best_key][0]

    def _longest_usable(self, prompt: list[int], limit: int, usable) -> tuple[int, tuple | None]:
        """The entry the caller can take most of: under one shared prompt, answers stored by rows
        without a head's states (other methods, sampled continuations) must not hide one that
        kept them -- else an MTP row prefills cold behind a warm cache."""
        best_len, best_key = 0, None
        for key, shared in self.tree.candidates(prompt):  # sharing no more than the one before
            reach = min(shared, limit)
            if best_len >= reach:
                break
            length = min(reach, usable(self.entries[key][0]))
            if length > best_len:
                best_len, best_key = length, key
        return best_len, best_key

    def store(self, tokens: list[int], nbytes: int) -> tuple[int | None, list[int]]:
        """Admit `tokens` (their KV takes `nbytes`) -> (new entry id or None, ids to drop)."""
        key = tuple(tokens)
        if len(key) < MIN_REUSE or nbytes > self.max_bytes or key in self.entries:
            return None, []
        dropped = [self._drop(old) for old in self.tree.keys_on_path(key)]  # the new one covers them
        entry = next(self._ids)
        self.entries[key] = (entry, nbytes)
        self.tree.insert(key)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            dropped.append(self._drop(next(iter(self.entries))))
        return entry, dropped

    def evict_oldest(self) -> int | None:
        """Free the least recently used entry (memory pressure) -> its id."""
        return self._drop(next(iter(self.entries))) if self.entries else None

    def add_bytes(self, tokens: list[int], nbytes: int) -> int | None:
        """Count `nbytes` more for the entry of exactly `tokens` (states attached later) -> its
        id, or None when there is no such entry."""
        key = tuple(tokens)
        if key not in self.entries:
            return None
        entry, held = self.entries[key]
        self.entries[key] = (entry, held + nbytes)
        self.nbytes += nbytes
        return entry

    def forget(self, tokens: list[int]) -> int | None:
        """Drop the entry for exactly `tokens` (an entry whose KV could not be loaded) -> its id."""
        return self._drop(tuple(tokens)) if tuple(tokens) in self.entries else None

    def _drop(self, key) -> int:
        entry, nbytes = self.entries.pop(key)
        self.tree.remove(key)
        self.nbytes -= nbytes
        return entry

    def as_dict(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "hits": self.hits,
                "misses": self.misses, "reused_tokens": self.reused_tokens}
