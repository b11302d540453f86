"""Acceptance: greedy longest-prefix match, or rejection sampling that keeps p exact.

Everything here is lazy: the engine verifies every row of a batch, then reads all verdicts
back in one host sync. A row's window is the target's logits for [last_committed, d_1 .. d_k]
(k+1 rows); its verdict is (num_accepted, next_token): the accepted drafts plus one token from
the target (the correction at the first rejection, or the bonus after all k).
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import Rng, RowContext, fast_exp, processed_logits, processed_logprobs, sample, sample_from_probs


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


def verify_greedy(logits: mx.array, drafts: mx.array, ctx: RowContext) -> tuple[mx.array, mx.array]:
    """One row with processing (penalties, bias, a grammar): logits [k+1, V], drafts [k] ->
    (verdict [2], the processed logits [k+1, V])."""
    k = drafts.shape[0]
    processed = processed_logits(logits, ctx, drafts)
    choice = mx.argmax(processed, axis=-1)
    return verify_greedy_batch(choice[None], drafts[None], mx.array([k]))[0], processed


def verify_sampling(logits: mx.array, drafts: mx.array, q: mx.array | None,
                    ctx: RowContext, rng: Rng) -> tuple[mx.array, mx.array]:
    """q: the proposer's processed probabilities [k, V], or None for a deterministic proposal.
    -> (verdict [2], the target's processed log-probabilities [k+1, V]), lazy."""
    k = drafts.shape[0]
    logp = processed_logprobs(logits, ctx, drafts)
    bonus = sample(logp[k], rng.next())
    if k == 0:
        return mx.stack([mx.array(0), bonus]).astype(mx.int32), logp
    p = fast_exp(logp[:k])
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
    corrections = sample_from_probs(residual, rng.next())
    n = accepted_prefix(accept)
    token = mx.where(n < k, corrections[mx.minimum(n, k - 1)], bonus)
    return mx.stack([n, token]).astype(mx.int32), logp


def committed_logprobs(logp: mx.array, drafts: mx.array, verdict: mx.array, top: int) -> mx.array:
    """[W, 1 + 2·top] for one row (lazy): the log-probability of the token committed at each
    window position (the accepted drafts, then the verdict's token), then the `top` most likely
    ids and their log-probabilities. Rows past the verdict are padding."""
    width = logp.shape[0]
    padded = mx.concatenate([drafts.astype(mx.int32), mx.zeros((width - drafts.shape[0],), mx.int32)])
    ids = mx.where(mx.arange(width) < verdict[0], padded, verdict[1])
    chosen = mx.take_along_axis(logp, ids[:, None], axis=-1)
    if not top:
        return chosen
    best = mx.argsort(-logp, axis=-1)[:, :top]
    values = mx.take_along_axis(logp, best, axis=-1)
    return mx.concatenate([chosen, best.astype(mx.float32), values], axis=1)


def _match_vocab(q: mx.array, vocab: int) -> mx.array:
    """Align a draft's vocabulary (padded rows may differ) to the target's, leaving p untouched."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        q = q[:, :vocab]
        return q / q.sum(-1, keepdims=True)
    return mx.pad(q, [(0, 0), (0, vocab - q.shape[-1])])
