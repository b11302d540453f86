"""Acceptance: greedy longest-prefix match, or rejection sampling that keeps p exact.

Both take the target's logits for the window [last_committed, d_1 .. d_k] (k+1 rows) and
return (num_accepted, next_token): the accepted drafts plus one token from the target (the
correction at the first rejection, or the bonus after all k).
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import (Rng, SamplingParams, greedy_tokens, histories_for,
                               processed_logprobs)


def _first_false(flags: list[bool]) -> int:
    for i, ok in enumerate(flags):
        if not ok:
            return i
    return len(flags)


def verify_greedy(logits: mx.array, drafts: list[int], committed: list[int],
                  params: SamplingParams) -> tuple[int, int]:
    rows = len(drafts) + 1
    choice = greedy_tokens(logits, histories_for(committed, drafts, rows, params), params).tolist()
    return accept_greedy_choices(choice, drafts)


def accept_greedy_choices(choice: list[int], drafts: list[int]) -> tuple[int, int]:
    """Given the target's greedy token at each window row, the accepted count and next token."""
    n = _first_false([c == d for c, d in zip(choice, drafts)])
    return n, choice[n]


def verify_sampling(logits: mx.array, drafts: list[int], q: mx.array | None,
                    committed: list[int], params: SamplingParams, rng: Rng) -> tuple[int, int]:
    """q: the proposer's processed probabilities [k, V], or None for a deterministic proposal."""
    k = len(drafts)
    logp = processed_logprobs(logits, histories_for(committed, drafts, k + 1, params), params)
    bonus = mx.random.categorical(logp[k], key=rng.next())
    if k == 0:
        return 0, bonus.item()
    p = mx.exp(logp[:k])
    d = mx.array(drafts)[:, None]
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
    accept_list, corrections_list, bonus_tok = accept.tolist(), corrections.tolist(), bonus.item()
    n = _first_false(accept_list)
    return n, (corrections_list[n] if n < k else bonus_tok)


def _match_vocab(q: mx.array, vocab: int) -> mx.array:
    """Align a draft's vocabulary (padded rows may differ) to the target's, leaving p untouched."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        q = q[:, :vocab]
        return q / q.sum(-1, keepdims=True)
    return mx.pad(q, [(0, 0), (0, vocab - q.shape[-1])])
