"""One decode step's window and its verdicts: every row's last token and drafts in one [B, W]
array, a grammar's masks over it, and (accepted, next token) per row, all lazy so the step reads
everything back in one host sync. `seqs[i]` is row i of the batch."""

from __future__ import annotations

import mlx.core as mx

from ..sampling import RowContext, SamplingParams, log_normalize, sample_plain_rows
from ..speculative.base import Drafts
from ..speculative.verify import committed_logprobs, verify_greedy, verify_greedy_batch, verify_sampling
from .sequence import Sequence


def draft_length(drafts: Drafts | None) -> int:
    if drafts is None:
        return 0
    return len(drafts.tokens) if isinstance(drafts.tokens, list) else drafts.tokens.shape[0]


def window_tokens(seqs: list[Sequence], ks: list[int], drafts: list, width: int) -> mx.array:
    """[B, width]: each row's last token, then its drafts, padded (padding is never kept)."""
    host = [[seq.committed[-1]] + [0] * (width - 1) for seq in seqs]
    lazy: dict[int, list[tuple[int, mx.array]]] = {}  # draft width -> (row index, tokens)
    for i, d in enumerate(drafts):
        if d is None or not ks[i]:
            continue
        if isinstance(d.tokens, list):
            host[i][1:1 + ks[i]] = d.tokens[:ks[i]]
        else:
            lazy.setdefault(d.tokens.shape[0], []).append((i, d.tokens))
    tokens = mx.array(host, dtype=mx.int32)
    for draft_width, items in lazy.items():
        index = mx.array([i for i, _ in items])
        tokens[index, 1:1 + draft_width] = mx.stack([t for _, t in items]).astype(mx.int32)
    return tokens


def grammar_masks(seqs: list[Sequence], ks: list[int],
                  host_tokens: list[list[int]] | None) -> dict[int, mx.array]:
    """Row index -> allowed ids at each window position under its grammar; a row's k is cut just
    past its first draft the grammar refuses (that draft is then rejected, losslessly)."""
    masks = {}
    for i, seq in enumerate(seqs):
        if seq.constraint is None:
            continue
        drafted = host_tokens[i][1:1 + ks[i]] if ks[i] else []
        masks[i], valid = seq.constraint.masks(drafted)
        ks[i] = min(ks[i], valid + 1)
    return masks


def verdicts(seqs: list[Sequence], ks: list[int], drafts: list, tokens: mx.array, logits: mx.array,
             masks: dict[int, mx.array]) -> tuple[mx.array, dict[int, mx.array]]:
    """[B, 2] (accepted, next token) for every row, lazily: plain greedy rows by one batched
    argmax, plain sampling rows without drafts together per shared params, the others
    (penalties, grammars, logprobs, sampled drafts) one by one; and for rows that asked for
    logprobs, their report (see committed_logprobs)."""
    proposed = tokens[:, 1:]
    special = [i for i, seq in enumerate(seqs)
               if i in masks or seq.request.logprobs is not None or not seq.context().is_plain_greedy]
    if len(special) < len(seqs):
        out = verify_greedy_batch(mx.argmax(logits, axis=-1), proposed, mx.array(ks))
    else:
        out = mx.zeros((len(seqs), 2), dtype=mx.int32)
    reports: dict[int, mx.array] = {}
    special = _sample_plain_rows(seqs, ks, logits, out, special, masks)
    if special:
        rows = []
        for i in special:
            q = drafts[i].q if drafts[i] is not None and ks[i] else None
            verdict, report = row_verdict(seqs[i], logits[i, :ks[i] + 1], proposed[i, :ks[i]], q,
                                          seqs[i].context(masks.get(i)))
            rows.append(verdict)
            if report is not None:
                reports[i] = report
        out[mx.array(special)] = mx.stack(rows)
    return out, reports


def _sample_plain_rows(seqs: list[Sequence], ks: list[int], logits: mx.array, out: mx.array,
                       special: list[int], masks: dict) -> list[int]:
    """Rows that sample with nothing but temperature and filters and draft nothing this step
    are drawn together, per shared params (sampling.sample_plain_rows); -> the rest."""
    groups: dict[SamplingParams, list[int]] = {}
    for i in special:
        seq = seqs[i]
        if (not ks[i] and not seq.params.is_greedy and not seq.params.has_processing
                and i not in masks and seq.request.logprobs is None):
            groups.setdefault(seq.params.without_seed(), []).append(i)
    for params, members in groups.items():
        tokens = sample_plain_rows(logits[mx.array(members), 0], params, [seqs[i].rng.next() for i in members])
        out[mx.array(members)] = mx.stack([mx.zeros_like(tokens), tokens], axis=1)
    grouped = {i for members in groups.values() for i in members}
    return [i for i in special if i not in grouped]


def row_verdict(seq: Sequence, logits: mx.array, proposed: mx.array, q,
                ctx: RowContext) -> tuple[mx.array, mx.array | None]:
    """(verdict [2], the logprob report or None) for one row, lazily. A greedy row reports the
    processed logits at temperature 1 (temperature 0 has no distribution)."""
    if seq.params.is_greedy:
        verdict, processed = verify_greedy(logits, proposed, ctx)
        logp = log_normalize(processed)
    else:
        verdict, logp = verify_sampling(logits, proposed, None if q is None else q[:proposed.shape[0]],
                                        ctx, seq.rng)
    top = seq.request.logprobs
    return verdict, (None if top is None else committed_logprobs(logp, proposed, verdict, top))


def logprob_entries(report: mx.array | None, count: int, top: int | None) -> list | None:
    """A row's evaluated logprob report -> Tokens.logprobs for its first `count` positions."""
    if report is None:
        return None
    out = []
    for row in report[:count].tolist():
        ids, values = row[1:1 + top], row[1 + top:]
        out.append((row[0], [(int(t), v) for t, v in zip(ids, values)]))
    return out
