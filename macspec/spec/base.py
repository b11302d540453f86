"""The proposer interface: something that guesses the target's next k tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import mlx.core as mx

from typing import Callable

from ..sampling import (Rng, SamplingParams, history_row, processed_logits,
                               processed_logprobs)


@dataclass
class Proposal:
    tokens: list[int]
    # Processed draft probabilities [k, V] for rejection sampling; None = deterministic proposal.
    q: mx.array | None = None


class Proposer(ABC):
    name: str = "base"
    needs_hidden: bool = False  # wants the target's hidden states after every forward

    @abstractmethod
    def start(self, prompt: list[int], prompt_hidden: mx.array | None,
              hidden_start: int = 0) -> None:
        """A new sequence whose prompt the target has just prefilled; `prompt_hidden` holds the
        target's states from position `hidden_start` on (earlier ones came from a prefix cache)."""

    @abstractmethod
    def propose(self, committed: list[int], k: int, params: SamplingParams, rng: Rng) -> Proposal:
        """Up to k tokens that follow `committed` (all tokens so far, prompt included)."""

    def observe(self, hidden: mx.array) -> None:
        """After a target forward (only when `needs_hidden`): the target's states [n, H] for the
        positions just before each of the n tokens that step committed."""




def decode_chain(logits: mx.array, k: int, committed: list[int], params: SamplingParams,
                 rng: Rng, advance: Callable[[int], mx.array]) -> Proposal:
    """Pick k tokens autoregressively from a proposer's logits [V]; `advance(token)` returns the
    proposer's logits for the position after `token`. At T > 0 the tokens are sampled from the
    proposer's processed distribution q, which rejection sampling needs alongside them."""
    tokens: list[int] = []
    q_rows = []
    for j in range(k):
        history = [history_row(committed, tokens, params)]
        if params.is_greedy:
            token = mx.argmax(processed_logits(logits[None], history, params)[0])
        else:
            logq = processed_logprobs(logits[None], history, params)[0]
            token = mx.random.categorical(logq, key=rng.next())
            q_rows.append(mx.exp(logq))
        tokens.append(token.item())
        if j + 1 < k:
            logits = advance(tokens[-1])
    return Proposal(tokens, mx.stack(q_rows) if q_rows else None)
