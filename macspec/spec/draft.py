"""A smaller model with the target's tokenizer proposes by decoding k tokens ahead."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kv.cache import eval_cache, make_trimmable_cache, trim
from ..kv.cache import first_divergence
from .base import Proposal, Proposer, decode_chain


class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, model: nn.Module, prefill_chunk: int = 512):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.cache: list = []
        self.cached_tokens: list[int] = []
        self.num_synced = 0  # cached tokens known to be committed (committed only grows)

    def start(self, prompt, prompt_hidden, hidden_start=0) -> None:
        # The prompt is fed lazily by the first propose(), after the first token is out (TTFT).
        self.cache = make_trimmable_cache(self.model)
        self.cached_tokens = []
        self.num_synced = 0

    def _sync(self, committed: list[int]) -> mx.array:
        """Roll the cache back to its agreement with `committed`, feed the rest; last logits."""
        start = self.num_synced
        agree = start + first_divergence(self.cached_tokens[start:], committed[start:])
        keep = min(agree, len(committed) - 1)
        trim(self.cache, len(self.cached_tokens) - keep)
        del self.cached_tokens[keep:]
        pending = committed[keep:]
        for start in range(0, len(pending) - 1, self.prefill_chunk):
            chunk = pending[start:min(start + self.prefill_chunk, len(pending) - 1)]
            self.model(mx.array(chunk)[None], cache=self.cache)
            eval_cache(self.cache)
        logits = self.model(mx.array(pending[-1:])[None], cache=self.cache)
        self.cached_tokens.extend(pending)
        self.num_synced = len(committed)
        return logits[0, -1]

    def propose(self, committed, k, params, rng) -> Proposal:
        def advance(token: int) -> mx.array:
            self.cached_tokens.append(token)
            return self.model(mx.array([[token]]), cache=self.cache)[0, -1]

        return decode_chain(self._sync(committed), k, committed, params, rng, advance)
