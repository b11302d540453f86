"""Processed distributions: the one definition of "what the target would sample".

Plain decoding samples from `processed_logprobs`; speculative verification compares the
target's and the proposer's processed distributions built by the very same function with the
very same history, which is what keeps sampling lossless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import mlx.core as mx

from .errors import RequestError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    seed: int | None = None

    def __post_init__(self):
        checks = {
            "temperature": 0 <= self.temperature <= 10,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "min_p": 0 <= self.min_p <= 1,
            "repetition_penalty": 0 < self.repetition_penalty <= 10,
            "repetition_context_size": self.repetition_context_size >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise RequestError(f"{name} = {getattr(self, name)!r} is out of range")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @classmethod
    def from_config(cls, cfg) -> "SamplingParams":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


def penalize(logits: mx.array, history, params: SamplingParams) -> mx.array:
    """Repetition penalty (CTRL-style, as mlx-lm) over the last `repetition_context_size` tokens.
    `history` is a list of ids or an int array (lazy draft tokens included): each distinct id
    is penalized once, so both spellings of the same history give the same logits."""
    if not params.has_penalty or len(history) == 0:
        return logits
    ids = mx.array(history) if isinstance(history, list) else history
    ids = ids[-params.repetition_context_size:]
    seen = mx.zeros(logits.shape[-1], dtype=mx.int32).at[ids].add(1) > 0
    pen = params.repetition_penalty
    factor = mx.where(logits < 0, pen, 1.0 / pen)
    return mx.where(seen, logits * factor, logits)


def _filter(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """top-k, top-p, min-p on row-wise log-probabilities [N, V]; filtered entries get -inf."""
    if params.top_k and params.top_k < logprobs.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[:, -params.top_k][:, None]
        logprobs = mx.where(logprobs < kth, NEG_INF, logprobs)
    if params.top_p < 1.0:
        order = mx.argsort(-logprobs, axis=-1)
        sorted_probs = mx.exp(mx.take_along_axis(logprobs, order, axis=-1))
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p  # always keeps the most likely token
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        logprobs = mx.where(keep, logprobs, NEG_INF)
    if params.min_p > 0.0:
        floor = logprobs.max(axis=-1, keepdims=True) + mx.log(mx.array(params.min_p))
        logprobs = mx.where(logprobs < floor, NEG_INF, logprobs)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def processed_logits(logits: mx.array, histories: list[list[int]], params: SamplingParams) -> mx.array:
    """Rows [N, V] -> penalized float32 logits; row j sees exactly `histories[j]`."""
    logits = logits.astype(mx.float32)
    if not params.has_penalty:
        return logits
    return mx.stack([penalize(logits[j], histories[j], params) for j in range(logits.shape[0])])


def processed_logprobs(logits: mx.array, histories: list[list[int]], params: SamplingParams) -> mx.array:
    """Rows [N, V] -> log of the distribution the target samples from (temperature > 0)."""
    scaled = processed_logits(logits, histories, params) / params.temperature
    return _filter(scaled - mx.logsumexp(scaled, axis=-1, keepdims=True), params)


def greedy_tokens(logits: mx.array, histories: list[list[int]], params: SamplingParams) -> mx.array:
    return mx.argmax(processed_logits(logits, histories, params), axis=-1)


class Rng:
    """Explicit PRNG key stream so a seeded request replays exactly."""

    def __init__(self, seed: int | None):
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(self.seed)

    def next(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def history_row(committed: list[int], drafts, params: SamplingParams):
    """What the penalty sees at the position after `committed + drafts` (only its tail);
    `drafts` is a list of ids or an int array (a lazy draft chain)."""
    if not params.has_penalty:
        return []
    size = params.repetition_context_size
    if isinstance(drafts, list):
        return (committed[-size:] + drafts)[-size:]
    return mx.concatenate([mx.array(committed[-size:], dtype=mx.int32),
                           drafts.astype(mx.int32)])[-size:]


def histories_for(committed: list[int], drafts, rows: int,
                  params: SamplingParams) -> list:
    """Row j of a verify window sees the committed tokens plus the first j drafts."""
    return [history_row(committed, drafts[:j], params) for j in range(rows)]
