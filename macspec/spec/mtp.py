"""The target's own MTP head proposes from the target's last hidden state.

Position t's MTP input is (h_t, token t+1) and it predicts token t+2. Rows with the target's
true h_t are kept in the head's cache; for k > 1 the head chains on its own output state, and
those chained rows are trimmed before the next proposal, once the true states are known.
"""

from __future__ import annotations

import mlx.core as mx

from ..kv.cache import make_trimmable_cache, trim
from ..models.mtp import MTPHead
from ..models.view import ModelView
from .base import Proposal, Proposer, decode_chain

MAX_PENDING_ROWS = 2048  # hidden rows buffered while speculation is off


class MTPProposer(Proposer):
    name = "mtp"
    needs_hidden = True

    def __init__(self, head: MTPHead, view: ModelView):
        self.head = head
        self.view = view
        self.cache: list = []
        self.pending: list[mx.array] = []  # [n, H] blocks of true hidden states, oldest first
        self.num_pending = 0
        self.next_position = 0  # absolute position of the first pending row
        self.num_chained = 0

    def start(self, prompt, prompt_hidden, hidden_start=0) -> None:
        self.cache = make_trimmable_cache(self.view.model)[-1:]
        self.pending, self.num_pending, self.num_chained = [], 0, 0
        self.next_position = hidden_start
        self._add(prompt_hidden)

    def observe(self, hidden) -> None:
        self._add(hidden)

    def _add(self, rows: mx.array) -> None:
        self.pending.append(rows)
        self.num_pending += rows.shape[0]
        excess = self.num_pending - MAX_PENDING_ROWS
        if excess > 0:  # keep the most recent context; RoPE is relative, so a gap is tolerable
            merged = mx.concatenate(self.pending)[excess:]
            self.pending, self.num_pending = [merged], merged.shape[0]
            self.next_position += excess

    def _feed_pending(self, committed: list[int]) -> tuple[mx.array, mx.array]:
        trim(self.cache, self.num_chained)
        self.num_chained = 0
        hidden = mx.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        start = self.next_position
        followers = mx.array(committed[start + 1:start + 1 + hidden.shape[0]])
        hidden = hidden.astype(self.head.eh_proj.weight.dtype)
        logits, out = self.head(followers[None], hidden[None], self.view, self.cache[0])
        self.next_position += hidden.shape[0]
        self.pending, self.num_pending = [], 0
        return logits[0, -1], out[:, -1:]

    def propose(self, committed, k, params, rng) -> Proposal:
        if not self.num_pending:
            return Proposal([])
        logits, state = self._feed_pending(committed)

        def advance(token: int) -> mx.array:
            nonlocal state
            chained, out = self.head(mx.array([[token]]), state, self.view, self.cache[0])
            state = out[:, -1:]
            self.num_chained += 1
            return chained[0, -1]

        return decode_chain(logits, k, committed, params, rng, advance)
