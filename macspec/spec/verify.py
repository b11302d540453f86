"""Acceptance: greedy longest-prefix match, or rejection sampling that keeps p exact.

Everything here is lazy: the engine verifies every row of a batch, then reads all verdicts
back in one host sync. A row's window is the target's logits for [last_committed, d_1 .. d_k]
(k+1 rows); its verdict is (num_accepted, next_token): the accepted drafts plus one token from
the target (the correction at the first rejection, or the bonus after all k).
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import Rng, SamplingParams, greedy_tokens, histories_for, processed_logprobs


def accepted_prefix(accept: mx.array, limit: mx.array | None = None) -> mx.array:
    """Per row of `accept` [..., K] (bool): how many leading entries hold, at most `limit`."""
    if limit is not None:
        accept = accept & (mx.arange(accept.shape[-1]) < limit[..., None])
    return mx.cumprod(accept.astype(mx.int32), axis=-1).sum(axis=-1)


def verify_greedy_batch(choice: mx.array, drafts: mx.array, ks: mx.array) -> mx.array:
    """choice [B, W] the target's greedy tokens, drafts [B, W-1], ks [B] -> verdicts [B, 2]."""
    n = accepted_prefix(choice[:, :-1] == drafts, ks) if drafts.shape[1] else mx.zeros(
        choice.shape[:1], dtype=mx.int32)
    token = mx.take_along_axis(choice, n[:, None], axis=1)[:, 0]
    return mx.stack([n, token], axis=1).astype(mx.int32)


def verify_greedy(logits: mx.array, drafts: mx.array, committed: list[int],
                  params: SamplingParams) -> mx.array:
    """One row with processing (penalties): logits [k+1, V], drafts [k] -> verdict [2]."""
    k = drafts.shape[0]
    choice = greedy_tokens(logits, histories_for(committed, drafts, k + 1, params), params)
    return verify_greedy_batch(choice[None], drafts[None], mx.array([k]))[0]


def verify_sampling(logits: mx.array, drafts: mx.array, q: mx.array | None,
                    committed: list[int], params: SamplingParams, rng: Rng) -> mx.array:
    """q: the proposer's processed probabilities [k, V], or None for a deterministic proposal.
    -> verdict [2] (lazy)."""
    k = drafts.shape[0]
    logp = processed_logprobs(logits, histories_for(committed, drafts, k + 1, params), params)
    bonus = mx.random.categorical(logp[k], key=rng.next())
    if k == 0:
        return mx.stack([mx.array(0), bonus]).astype(mx.int32)
    p = mx.exp(logp[:k])
    d = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p, d, axis=-1)[:, 0]
    if q is None:  # one-hot proposal: accept with p(d); residual is p without d
        q_d = mx.ones_like(p_d)
        residual = mx.put_along_axis(p, d, mx.zeros_like(d, dtype=p.dtype), axis=-1)
    else:
        q = _match_vocab(q, p.shape[-1])
        q_d = mx.take_along_axis(q, d, axis=-1)[:, 0]
        residual = mx.maximum(p - q, 0.0)
    accept = mx.random.uniform(shape=(k,), key=rng.next()) * q_d < p_d
    # A zero residual only arises where p <= q everywhere, i.e. the draft is always accepted.
    residual = mx.where(residual.sum(-1, keepdims=True) > 0, residual, p)
    corrections = mx.random.categorical(mx.log(residual), key=rng.next())
    n = accepted_prefix(accept)
    token = mx.where(n < k, corrections[mx.minimum(n, k - 1)], bonus)
    return mx.stack([n, token]).astype(mx.int32)


def _match_vocab(q: mx.array, vocab: int) -> mx.array:
    """Align a draft's vocabulary (padded rows may differ) to the target's, leaving p untouched."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        q = q[:, :vocab]
        return q / q.sum(-1, keepdims=True)
    return mx.pad(q, [(0, 0), (0, vocab - q.shape[-1])])
