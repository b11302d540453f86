"""KV of finished requests, reused when a new prompt starts with the same tokens."""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from ..spec.base import first_divergence

MIN_REUSE = 4  # shorter shared prefixes are not worth a copy


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], list[tuple[mx.array, ...]]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def lookup(self, prompt: list[int]) -> tuple[int, list[tuple[mx.array, ...]] | None]:
        """(m, per-layer arrays for the first m tokens); m <= len(prompt) - 1 so the last prompt
        token is always computed (its logits start the generation)."""
        best_len, best_key = 0, None
        for key in self.entries:
            n = min(first_divergence(key, prompt), len(prompt) - 1)
            if n > best_len:
                best_len, best_key = n, key
        if best_key is None or best_len < MIN_REUSE:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best_len
        layers = [tuple(a[:, :, :best_len] for a in arrays) for arrays in self.entries[best_key]]
        return best_len, layers

    def store(self, tokens: list[int], layers: list[tuple[mx.array, ...]]) -> None:
        key = tuple(tokens)
        size = _nbytes(layers)
        if len(key) < MIN_REUSE or size > self.max_bytes:
            return
        for old in [k for k in self.entries if key[:len(k)] == k]:  # superseded by a longer one
            self._drop(old)
        if key in self.entries:
            return
        self.entries[key] = layers
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def _drop(self, key) -> None:
        self.nbytes -= _nbytes(self.entries.pop(key))

    def as_dict(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "hits": self.hits,
                "misses": self.misses, "reused_tokens": self.reused_tokens}


def _nbytes(layers) -> int:
    return sum(a.nbytes for arrays in layers for a in arrays)
