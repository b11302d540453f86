"""Suffix decoding: the longest match's most frequent continuation, from the request's own context
and from recent answers; drafts as long as the match earns; through the engine, lossless."""

from __future__ import annotations

import pytest

from macspec.sampling import Rng, RowContext, SamplingParams
from macspec.speculative.base import ChainRow
from macspec.speculative.suffix import MAX_MATCH, SuffixGroup, SuffixIndex, scored_walk

from .conftest import engine_for, tiny_runtime


def _propose(group: SuffixGroup, key: int, committed: list[int], k: int) -> list[int]:
    drafts = group.propose([ChainRow(key, RowContext(SamplingParams(), committed), k, Rng(0))])
    return drafts[key].tokens if key in drafts else []


def test_a_repeated_passage_is_drafted_to_its_end():
    passage = list(range(100, 130))
    context = [1, 2] + passage + [7, 8] + passage[:10]
    group = SuffixGroup()
    group.join(1, context, None)
    # A 10-token match: up to 10 tokens (factor 1), all of them the passage's continuation.
    assert _propose(group, 1, context, 16) == passage[10:20]
    assert _propose(group, 1, context, 4) == passage[10:14]  # never more than k


def test_the_most_frequent_continuation_wins_and_doubt_stops_the_draft():
    a, b = [5, 6, 7, 8], [5, 6, 7, 9]
    tokens = a + [50, 51] + a + [52, 53] + b + [54, 55]
    index = SuffixIndex(tokens)
    found = index.occurrences([5, 6, 7], skip_last=False)
    candidates = [(index.tokens, at) for _, at in found]
    # 2 of 3 occurrences continue with 8 (p 2/3); those two then part (50 | 52: p 1/3, a tie
    # the most recent occurrence wins).
    assert scored_walk(candidates, 3, 8, 1.0, 0.1)[0] == [8, 52, 53]
    assert scored_walk(candidates, 3, 8, 1.0, 0.4)[0] == [8]
    assert scored_walk(candidates, 3, 8, 1.0, 0.7)[0] == []


def test_a_short_match_earns_a_short_draft():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    index = SuffixIndex(tokens)
    [(match, at)] = index.occurrences([40, 41, 3, 4], skip_last=False)
    assert match == 2 and scored_walk([(index.tokens, at)], match, 16, 1.0, 0.1)[0] == [5, 6]


def test_match_length_is_measured_up_to_its_cap():
    run = list(range(200, 200 + MAX_MATCH + 20))
    index = SuffixIndex(run + [0])
    [(match, at)] = index.occurrences(run, skip_last=False)
    assert match == MAX_MATCH and at == len(run)


def test_recent_answers_are_drafted_from_and_bounded():
    group = SuffixGroup(cache_requests=2)
    answer = list(range(300, 340))
    group.join(1, [9, 9, 9], None)
    _propose(group, 1, [9, 9, 9] + answer, 0)  # the row's output so far is indexed on propose
    group.leave(1)
    assert list(group.recent) == [1]
    # Another request whose context ends like the start of that answer drafts its rest.
    context = [4, 4] + answer[:12]
    group.join(2, context, None)
    assert _propose(group, 2, context, 16) == answer[12:24]
    for key in (3, 4):
        group.join(key, [key] * 3, None)
        _propose(group, key, [key] * 3 + [key + 500] * 3, 0)
        group.leave(key)
    assert list(group.recent) == [3, 4]  # LRU by request: the oldest answer went


def test_no_match_no_draft():
    group = SuffixGroup()
    group.join(1, [1, 2, 3, 4], None)
    assert _propose(group, 1, [1, 2, 3, 4], 8) == []


@pytest.mark.slow
def test_an_answer_given_before_is_drafted_whole_from_recent_answers_losslessly():
    """An agent resending a request (a retry, the same tool call turn after turn): the second
    time, suffix decoding drafts the earlier answer from its recent answers, up to 16 tokens a
    step, and the output still equals plain decoding token for token."""
    plain, first, second, _ = _sent_twice("suffix")
    assert first.tokens == plain.tokens and second.tokens == plain.tokens
    stats = second.stats["spec"]
    assert stats["accepted"] >= 48 and second.stats["tokens_per_forward"] > 4.0, second.stats
    assert stats["mean_draft_length"] > 8, stats


def test_a_seeded_sampling_request_drafts_from_its_own_context_only():
    """Its drafts decide its sample, so they must not depend on other requests: it replays."""
    group = SuffixGroup()
    answer = list(range(300, 340))
    group.join(1, [9, 9, 9], None)
    _propose(group, 1, [9, 9, 9] + answer, 0)
    group.leave(1)
    context = [4, 4] + answer[:12]
    group.join(2, context, None)
    seeded = SamplingParams(temperature=0.7, seed=5)
    rows = [ChainRow(2, RowContext(seeded, context), 16, Rng(5))]
    assert group.propose(rows) == {}
    assert _propose(group, 2, context, 16) == answer[12:24]  # greedy (or unseeded): lossless anyway


@pytest.mark.slow
def test_the_hybrid_drafts_a_restated_answer_from_its_index_and_the_rest_from_its_model():
    """`mtp+suffix`: where the answer restates an earlier one the suffix draft is expected to
    yield more and is verified (many tokens a step); elsewhere the MTP head drafts. Each kind's
    acceptance is measured on the request; the output equals plain decoding, adaptive or not."""
    plain, first, second, again = _sent_twice("mtp+suffix")
    assert first.tokens == plain.tokens and second.tokens == plain.tokens
    assert "drafts" in first.stats["spec"]["acceptance_estimate"], first.stats["spec"]  # the head's
    kinds = second.stats["spec"]["acceptance_estimate"]
    assert {"own", "recent"} & set(kinds) and second.stats["tokens_per_forward"] > 4.0, second.stats
    assert again(adaptive=True).tokens == plain.tokens


def _sent_twice(method: str):
    """One prompt decoded plainly, then twice at a fixed k with `method` -> (plain, first,
    second, a function sending it once more)."""
    runtime = tiny_runtime(method)
    prompt = runtime.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n", add_special_tokens=False)
    engine = engine_for(runtime)

    def send(method: str = method, adaptive: bool = False):
        return engine.generate([prompt], SamplingParams(), 64, method=method, adaptive=adaptive,
                               ignore_eos=True)[0]

    return send("none"), send(), send(), send
