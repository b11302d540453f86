"""Processed distributions: the one definition of "what the target would sample".

Plain decoding samples from `processed_logprobs`; speculative verification compares the
target's and the proposer's processed distributions built by the very same function with the
very same history, which is what keeps sampling lossless.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

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
    # OpenAI's: subtracted once per token already in the output / once per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self):
        checks = {
            "temperature": 0 <= self.temperature <= 10,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "min_p": 0 <= self.min_p <= 1,
            "repetition_penalty": 0 < self.repetition_penalty <= 10,
            "repetition_context_size": self.repetition_context_size >= 1,
            "presence_penalty": -2 <= self.presence_penalty <= 2,
            "frequency_penalty": -2 <= self.frequency_penalty <= 2,
        }
        for name, ok in checks.items():
            if not ok:
                raise RequestError(f"{name} = {getattr(self, name)!r} is out of range")

    def without_seed(self) -> "SamplingParams":
        """The same distribution whatever the seed: rows with equal ones sample together."""
        return replace(self, seed=None)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_processing(self) -> bool:
        """Anything besides temperature and the filters that changes the logits."""
        return (self.has_penalty or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias))

    @classmethod
    def from_config(cls, cfg) -> "SamplingParams":
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})


@dataclass
class RowContext:
    """What one row's distribution depends on besides its logits."""

    params: SamplingParams
    committed: list[int]  # every token so far, prompt included
    prompt_len: int = 0  # committed[prompt_len:] is the output the presence/frequency penalties see
    # Grammar: the tokens allowed at the row's next positions [m, V] (bool); positions past m
    # are unconstrained (a draft chain beyond the first position is masked only at verification).
    masks: mx.array | None = None

    @property
    def is_plain_greedy(self) -> bool:
        return self.params.is_greedy and not self.params.has_processing and self.masks is None


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


# MLX's CPU exp runs ~10x slower than its power of two (and than NumPy's exp); over a 49k
# vocabulary that was most of a sampled step. exp(x) = 2^(x log2 e), to float32 rounding.
LOG2E = 1.4426950408889634
TOP_P_CANDIDATES = 256  # top-p looks for its cut among the most likely 256 tokens, then 16x more


def fast_exp(x: mx.array) -> mx.array:
    return mx.power(2.0, x * LOG2E)


def log_normalize(x: mx.array) -> mx.array:
    """x - logsumexp(x) over the last axis."""
    top = mx.max(x, axis=-1, keepdims=True)
    return x - top - mx.log(mx.sum(fast_exp(x - top), axis=-1, keepdims=True))


def sample_from_probs(probs: mx.array, key: mx.array) -> mx.array:
    """One id per row of (unnormalized) probabilities by inverse CDF: one uniform per row,
    exact, and far cheaper on CPU than Gumbel-max's V random numbers and 2V logs."""
    return _inverse_cdf(probs, mx.random.uniform(shape=probs.shape[:-1] + (1,), key=key))


def _inverse_cdf(weights: mx.array, uniform: mx.array) -> mx.array:
    cdf = mx.cumsum(weights, axis=-1)
    picked = (cdf <= uniform * cdf[..., -1:]).sum(axis=-1)
    # u rounding up to the total would pick past the end: take the most likely id instead.
    return mx.where(picked < weights.shape[-1], picked, mx.argmax(weights, axis=-1)).astype(mx.int32)


def sample(logprobs: mx.array, key: mx.array) -> mx.array:
    return sample_from_probs(fast_exp(logprobs), key)


def _top_p_floor(logprobs: mx.array, top_p: float) -> mx.array:
    """[N, 1] the smallest log-probability top-p keeps: tokens in order of likelihood while the
    mass before them is under top_p (ties at the cut are all kept). The cut is looked for among
    the most likely candidates first (sorting 49k ids costs ~6 ms a row on CPU); a host check
    widens the search while it lies beyond them (flat rows), so the answer is exact either way."""
    vocab = logprobs.shape[-1]
    count = min(vocab, TOP_P_CANDIDATES)
    while True:
        best = mx.topk(logprobs, count, axis=-1) if count < vocab else logprobs
        best = mx.sort(best, axis=-1)[:, ::-1]
        probs = fast_exp(best)
        kept = ((mx.cumsum(probs, axis=-1) - probs) < top_p).sum(axis=-1, keepdims=True)
        if count == vocab or not mx.any(kept >= count).item():
            return mx.take_along_axis(best, kept - 1, axis=-1)
        count = min(vocab, count * 16)


def _filter(scaled: mx.array, params: SamplingParams) -> mx.array:
    """top-k, top-p, min-p on row-wise logits [N, V] -> log-probabilities, filtered entries -inf."""
    return log_normalize(_filtered(scaled, params))


def _filtered(scaled: mx.array, params: SamplingParams, normalized: bool = False) -> mx.array:
    """The filters on logits [N, V], left unnormalized (filtered entries -inf). top-p's mass is
    of the distribution before top-k, as it always was here."""
    logprobs = log_normalize(scaled) if params.top_p < 1.0 and not normalized else scaled
    if params.top_k and params.top_k < logprobs.shape[-1]:
        cut = logprobs.shape[-1] - params.top_k  # O(V) selection, not a sort
        kth = mx.partition(logprobs, cut, axis=-1)[:, cut:cut + 1]
        logprobs = mx.where(logprobs < kth, NEG_INF, logprobs)
    if params.top_p < 1.0:
        logprobs = mx.where(logprobs < _top_p_floor(logprobs, params.top_p), NEG_INF, logprobs)
    if params.min_p > 0.0:
        floor = logprobs.max(axis=-1, keepdims=True) + mx.log(mx.array(params.min_p))
        logprobs = mx.where(logprobs < floor, NEG_INF, logprobs)
    return logprobs


def sample_plain_rows(logits: mx.array, params: SamplingParams, keys: list[mx.array]) -> mx.array:
    """One token for each of G rows [G, V] that share `params` and have nothing besides
    temperature and the filters (no penalties, bias or grammar): the same distribution as
    `processed_logprobs`, drawn from its unnormalized weights, one exp pass for the batch.
    Row r uses keys[r], the uniform a lone row would draw, so batching changes no draw."""
    scaled = logits.astype(mx.float32) / params.temperature
    top = scaled.max(axis=-1, keepdims=True)
    weights = fast_exp(scaled - top)  # the one exp pass: normalizing and drawing both use it
    logprobs = scaled - top - mx.log(weights.sum(axis=-1, keepdims=True))
    weights = mx.where(_filtered(logprobs, params, normalized=True) > NEG_INF, weights, 0.0)
    return _inverse_cdf(weights, mx.concatenate([mx.random.uniform(shape=(1,), key=key) for key in keys])[:, None])


def processed_logits(logits: mx.array, ctx: RowContext, drafts=(), first: int = 0) -> mx.array:
    """Rows [n, V] -> processed float32 logits. Row r is the position after the committed tokens
    and drafts[:first + r] (ids or a lazy array): the same function for the target's window and
    for a proposer's chain is what keeps speculation lossless."""
    logits = logits.astype(mx.float32)
    n, vocab = logits.shape
    params = ctx.params
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits = logits + mx.zeros(vocab).at[mx.array(ids)].add(mx.array(bias, dtype=mx.float32))
    if params.has_penalty:
        logits = mx.stack([penalize(logits[r], history_row(ctx.committed, drafts[:first + r], params),
                                    params) for r in range(n)])
    if params.presence_penalty or params.frequency_penalty:
        counts = _output_counts(ctx, drafts, first, n, vocab)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if ctx.masks is not None and first < ctx.masks.shape[0]:
        allowed = ctx.masks[first:first + n]
        if allowed.shape[0] < n:  # rows past the masks' reach are unconstrained
            allowed = mx.concatenate([allowed, mx.ones((n - allowed.shape[0], vocab), dtype=mx.bool_)])
        logits = mx.where(allowed, logits, NEG_INF)
    return logits


def _output_counts(ctx: RowContext, drafts, first: int, n: int, vocab: int) -> mx.array:
    """[n, V] how often each id occurs in the output before each row (drafts included)."""
    output = ctx.committed[ctx.prompt_len:]
    base = mx.zeros(vocab, dtype=mx.float32)
    if output:
        base = base.at[mx.array(output)].add(1.0)
    used = first + n - 1  # drafts the last row sees
    if used <= 0:
        return mx.broadcast_to(base, (n, vocab))
    ids = mx.array(drafts[:used]) if isinstance(drafts, (list, tuple)) else drafts[:used]
    onehot = (ids.astype(mx.int32)[:, None] == mx.arange(vocab)[None]).astype(mx.float32)
    before = mx.concatenate([mx.zeros((1, vocab)), mx.cumsum(onehot, axis=0)])  # [used + 1, V]
    return base + before[first:first + n]


def processed_logprobs(logits: mx.array, ctx: RowContext, drafts=(), first: int = 0) -> mx.array:
    """Rows [n, V] -> log of the distribution the target samples from (temperature > 0)."""
    params = ctx.params
    return _filter(processed_logits(logits, ctx, drafts, first) / params.temperature, params)


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
    if isinstance(drafts, (list, tuple)):
        return (committed[-size:] + list(drafts))[-size:]
    return mx.concatenate([mx.array(committed[-size:], dtype=mx.int32),
                           drafts.astype(mx.int32)])[-size:]
