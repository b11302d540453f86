"""Speculative greedy output equals plain greedy output, token for token, through the engine
that `serve` uses: one request alone and inside mixed batches; plain equals mlx-lm's."""

from __future__ import annotations

import pytest
from mlx_lm.generate import generate_step

import mlx.core as mx

from macspec.models.cpu_prefill import mlx_only
from macspec.sampling import SamplingParams
from macspec.proposers import PROPOSER_NAMES

from macspec.engine.engine import Engine

from .conftest import engine_for, generate

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

MAX_TOKENS = 40
PLAIN = SamplingParams()
PENALIZED = SamplingParams(repetition_penalty=1.3)

_reference: dict = {}


def stop_ids(runtime, index: int) -> tuple[int, ...]:
    """Every other prompt also stops at the token " =": the small code model almost never
    chooses EOS greedily, and a frequent stop token exercises the same end-of-sequence path
    (a stop token accepted among the drafts, the rest discarded)."""
    if index % 2:
        return ()
    return tuple(runtime.tokenizer.encode(" =", add_special_tokens=False)[-1:])


def plain_outputs(runtime_for, prompts, params):
    key = params
    if key not in _reference:
        runtime = runtime_for("none")
        runs = [generate(runtime, p, MAX_TOKENS, params, stop_token_ids=stop_ids(runtime, i))
                for i, p in enumerate(prompts)]
        _reference[key] = [(tokens, gen.finish_reason) for tokens, gen in runs]
    return _reference[key]


def test_prompts_cover_eos_and_max_tokens(runtime_for, prompts):
    reasons = [reason for _, reason in plain_outputs(runtime_for, prompts, PLAIN)]
    assert len(prompts) >= 20
    assert "stop" in reasons and "length" in reasons


def test_plain_matches_mlx_lm_greedy(runtime_for, prompts):
    runtime = runtime_for("none")
    for prompt, (ours, _) in zip(prompts[:6], plain_outputs(runtime_for, prompts, PLAIN)):
        theirs = []
        with mlx_only():  # mlx-lm's own attention and SiLU, not macspec's CPU prefill
            for token, _ in generate_step(mx.array(prompt), runtime.target.model, max_tokens=len(ours)):
                theirs.append(int(token))
        assert ours == theirs[: len(ours)]


# The shortest window, one with partial acceptance inside the chain, one past most answers' ends;
# a penalty (each window position processed with the drafts before it) at the middle one, as
# the OpenAI penalties below.
@pytest.mark.parametrize("k,params", [(1, PLAIN), (3, PLAIN), (8, PLAIN), (3, PENALIZED)],
                         ids=["1-plain", "3-plain", "8-plain", "3-repetition-penalty"])
@pytest.mark.parametrize("method", PROPOSER_NAMES)
def test_speculative_greedy_equals_plain(runtime_for, prompts, method, k, params):
    runtime = runtime_for(method)
    reference = plain_outputs(runtime_for, prompts, params)
    drafted = 0
    for i, (prompt, (expected, reason)) in enumerate(zip(prompts, reference)):
        tokens, gen = generate(runtime, prompt, MAX_TOKENS, params, k=k,
                               stop_token_ids=stop_ids(runtime, i))
        assert tokens == expected, f"{method} k={k} diverged on prompt {prompt[:8]}"
        assert gen.finish_reason == reason
        drafted += gen.stats["spec"]["drafted"]
    assert drafted > 0, "the proposer never proposed: the test would prove nothing"


def openai_penalties(runtime) -> SamplingParams:
    """Presence and frequency penalties over the output, and a logit_bias pushing one common
    token up and another down (OpenAI's processing, applied to target and proposer alike)."""
    up, down = (runtime.tokenizer.encode(text, add_special_tokens=False)[-1] for text in (" self", ":"))
    return SamplingParams(presence_penalty=0.6, frequency_penalty=0.4,
                          logit_bias=((min(up, down), 2.5 if up < down else -2.5),
                                      (max(up, down), -2.5 if up < down else 2.5)))


@pytest.mark.parametrize("method", PROPOSER_NAMES)
def test_openai_penalties_and_logit_bias_are_lossless(runtime_for, prompts, method):
    runtime = runtime_for(method)
    params = openai_penalties(runtime)
    reference = plain_outputs(runtime_for, prompts[:10], params)
    unpenalized = plain_outputs(runtime_for, prompts, PLAIN)[:10]
    assert reference != unpenalized, "the penalties changed nothing: the test would prove nothing"
    drafted = 0
    for i, (prompt, (expected, reason)) in enumerate(zip(prompts, reference)):
        tokens, gen = generate(runtime, prompt, MAX_TOKENS, params, k=3,
                               stop_token_ids=stop_ids(runtime, i))
        assert tokens == expected, f"{method} diverged on prompt {prompt[:8]}"
        assert gen.finish_reason == reason
        drafted += gen.stats["spec"]["drafted"]
    assert drafted > 0


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "args", "pure"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "args": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
                         "pure": {"type": "boolean"}}}


@pytest.mark.parametrize("method", PROPOSER_NAMES)
def test_greedy_under_a_json_schema_is_lossless(runtime_for, prompts, method):
    """Structured output keeps speculating: each window position masked by the grammar state
    after the drafts before it; the output equals plain decoding under the same schema."""
    import json

    from macspec.grammar import GrammarCompiler

    runtime = runtime_for(method)
    compiler = GrammarCompiler(runtime.tokenizer, runtime.vocab_size)
    grammar = compiler.compile("json_schema", SCHEMA)
    engine = engine_for(runtime)
    batch = prompts[:8]

    def run(**options):
        done = engine.generate(batch, PLAIN, 64, adaptive=False,
                               constraint=[compiler.constraint(grammar) for _ in batch], **options)
        assert all(c.error is None for c in done)
        return done

    plain = run(method="none")
    spec = run(num_draft=3)
    for a, b in zip(spec, plain):
        assert a.tokens == b.tokens
        if b.finish_reason == "stop":
            assert set(json.loads(runtime.tokenizer.decode(b.tokens))) == {"name", "args", "pure"}
    assert sum(c.finish_reason == "stop" for c in plain) >= 4
    assert sum(c.stats["spec"]["accepted"] for c in spec) > 0


def test_mixed_batches_equal_plain(runtime_for, prompts):
    """All prompts at once (8 rows at a time, so rows join and leave mid-stream), each row with
    its own method, k, adaptivity and sampling; every greedy row equals plain decoding. The
    second round starts from the first round's KV (prefix-cache hits)."""
    runtime = runtime_for("draft")  # mtp and ngram load on demand, as in serve
    engine = engine_for(runtime)
    reference = plain_outputs(runtime_for, prompts, PLAIN)
    n = len(prompts)
    greedy = [i % 3 != 0 for i in range(n)]
    params = [PLAIN if greedy[i] else SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(n)]
    options = {"method": [("draft", "mtp", "ngram", "none")[i % 4] for i in range(n)],
               "num_draft": [(1, 2, 3, 4, 8)[i % 5] for i in range(n)],
               "adaptive": [i % 2 == 0 for i in range(n)],
               "stop_token_ids": [stop_ids(runtime, i) for i in range(n)]}
    hits_before = engine.scheduler.prefix_cache.as_dict()["hits"]
    for _ in range(2):
        steps_before = dict(engine.stats.batch_histogram)
        done = engine.generate(prompts, params, MAX_TOKENS, **options)
        for i, (completion, (expected, reason)) in enumerate(zip(done, reference)):
            assert completion.error is None, completion.error
            if greedy[i]:
                assert completion.tokens == expected, f"row {i} ({options['method'][i]}) diverged"
                assert completion.finish_reason == reason
        batched = {b: c - steps_before.get(b, 0) for b, c in engine.stats.batch_histogram.items()}
        assert max(b for b, c in batched.items() if c) == 8  # the batch was full at times
        assert sum(c.stats["spec"]["drafted"] for c in done) > 0
    assert engine.scheduler.prefix_cache.as_dict()["hits"] > hits_before


def test_stop_strings_cut_speculative_text_where_plain_stops(prompts, runtime_for):
    """Stop strings (text, matched by the server) end speculative and plain decoding at the same
    place, even when the stop lands inside a step's accepted drafts."""
    import requests

    from .serverutil import RunningServer

    runtime = runtime_for("draft")
    texts = [runtime.tokenizer.decode(p) for p in prompts[:6]]
    with RunningServer(runtime, max_batch=8) as server:
        def complete(prompt, method, k, stop=None):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop,
                    "speculative": {"method": method, "num_draft_tokens": k, "adaptive": False}}
            reply = requests.post(server.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]

        for prompt in texts:
            plain = complete(prompt, "none", 0)["text"]
            stop = plain[len(plain) // 2:len(plain) // 2 + 2]
            if not stop.strip():
                continue
            expected = complete(prompt, "none", 0, [stop])
            assert expected["finish_reason"] == "stop"
            for method in ("draft", "mtp", "ngram"):
                for k in (1, 4, 8):
                    assert complete(prompt, method, k, [stop]) == expected, (method, k)


def test_mtp_rows_keep_their_prefix_states_when_other_rows_extend_the_entry(runtime_for, prompts):
    """A conversation's turns alternate between an MTP row and a row without a head: the head's
    states stay with the prefix (a draft or plain row's longer entry inherits them), so the next
    MTP turn reuses the cache instead of prefilling from scratch; its output equals plain's."""
    runtime = runtime_for("mtp")
    engine = Engine(runtime, max_batch=4)
    first = engine.generate([prompts[0]], PLAIN, 16, method="mtp")[0]
    turn2 = prompts[0] + first.tokens + prompts[1][:8]
    second = engine.generate([turn2], PLAIN, 16, method="none")[0]
    turn3 = turn2 + second.tokens + prompts[2][:8]
    third = engine.generate([turn3], PLAIN, 16, method="mtp")[0]
    assert third.stats["cached_prompt_tokens"] >= len(prompts[0]) + len(first.tokens) - 1, third.stats
    assert third.tokens == engine.generate([turn3], PLAIN, 16, method="none")[0].tokens


def test_an_mtp_row_reuses_the_prompt_a_plain_row_stored(runtime_for, prompts):
    """With a head loaded, a row without one keeps its prompt's states for the entry it stores:
    an MTP row sent after it starts from the cache (it prefilled the whole prompt again, so a
    plain warm-up cost every head's row the shared chat-template prefix), and one continuing the
    plain row's conversation reuses its prompt (a plain row keeps no states for its answer)."""
    runtime = runtime_for("mtp")
    engine = Engine(runtime, max_batch=4)
    outputs = [engine.generate([prompts[3]], PLAIN, 1, method=m)[0] for m in ("none", "mtp", "mtp")]
    assert [c.stats["cached_prompt_tokens"] for c in outputs] == [0] + [len(prompts[3]) - 1] * 2
    assert len({tuple(c.tokens) for c in outputs}) == 1
    first = engine.generate([prompts[6]], PLAIN, 8, method="none")[0]
    turn = prompts[6] + first.tokens + prompts[7][:8]
    continued = engine.generate([turn], PLAIN, 8, method="mtp")[0]
    assert continued.stats["cached_prompt_tokens"] == len(prompts[6]), continued.stats
    assert continued.tokens == engine.generate([turn], PLAIN, 8, method="none")[0].tokens


def test_prefix_states_kept_before_a_head_tapped_more_layers_are_replaced(prompts):
    """An MTP row kept a prompt's states; then an EAGLE-3 head tapped more of the target's
    layers (a wider state). The next head row with that prompt computes the wide states once and
    they replace the narrow ones: every later head row, of either method, reuses the prefix."""
    from macspec.config import load_profile
    from macspec.engine.runtime import Runtime

    profile = load_profile("tiny-eagle3")
    profile.speculative.method = "mtp"
    engine = Engine(Runtime.load(profile), max_batch=4)  # its own target: the tap stays here
    prompt = prompts[4]
    cached = [engine.generate([prompt], PLAIN, 4, method=m)[0].stats["cached_prompt_tokens"]
              for m in ("mtp", "mtp", "eagle3", "eagle3", "mtp")]
    assert cached == [0, len(prompt) - 1, 0, len(prompt) - 1, len(prompt) - 1]


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash"])
def test_a_head_runs_only_for_rows_that_draft(runtime_for, prompts, monkeypatch, method):
    """A head reading the target's states is fed a row's context at its first proposal (as a
    draft model is): a request that never drafts costs its head nothing; one that drafts later
    gets every state so far, and its output equals plain's."""
    from macspec.models.dflash import DFlashDrafter
    from macspec.models.eagle3 import Eagle3Head
    from macspec.models.mtp import MTPHead

    module = {"mtp": MTPHead, "eagle3": Eagle3Head, "dflash": DFlashDrafter}[method]
    calls = []
    original = module.__call__
    monkeypatch.setattr(module, "__call__", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    engine = Engine(runtime_for(method), max_batch=4)
    plain = engine.generate([prompts[5]], PLAIN, 24, method="none")[0].tokens
    idle = engine.generate([prompts[5]], PLAIN, 24, method=method, num_draft=0, adaptive=False)[0]
    assert idle.tokens == plain and calls == []
    drafting = engine.generate([prompts[5]], PLAIN, 24, method=method, num_draft=3, adaptive=False)[0]
    assert drafting.tokens == plain and calls and drafting.stats["spec"]["accepted"] > 0


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash"])
def test_a_head_joins_a_long_prompt_with_its_newest_positions(runtime_for, prompts, monkeypatch, method):
    """A head takes a request's context at its first draft from its newest
    speculative.head_context positions (the target's states there carry the rest): a prompt many
    times that long feeds it no more, its drafts land about as often as with the whole prompt
    joined (head_context = 0), and the output is plain decoding's."""
    runtime = runtime_for(method)
    prompt = [t for p in prompts[:8] for t in p]
    plain = Engine(runtime, max_batch=2).generate([prompt], PLAIN, 32, method="none")[0].tokens
    runs = {}
    for context in (16, 0):
        monkeypatch.setattr(runtime.profile.speculative, "head_context", context)
        engine = Engine(runtime, max_batch=2)
        done = engine.generate([prompt], PLAIN, 32, method=method, num_draft=2, adaptive=False)[0]
        assert done.tokens == plain
        runs[context] = (done.stats["spec"], engine.status()["proposers"][method])
    (bounded, joins), (whole, all_joins) = runs[16], runs[0]
    assert len(prompt) > 8 * 16 and joins["joins"] == all_joins["joins"] == 1
    assert joins["joined_positions"] <= 16 < len(prompt) - 2 <= all_joins["joined_positions"]
    rate = lambda spec: spec["accepted"] / spec["drafted"]
    assert rate(bounded) >= 0.8 * rate(whole), (rate(bounded), rate(whole))


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle3", "dflash"])
def test_a_proposer_idle_for_stretches_drafts_as_well(runtime_for, prompts, method):
    """A row that decodes plainly for its first steps (adaptive k at 0), drafts, decodes plainly
    again and drafts again gets its whole context at each proposal: its drafts are accepted as
    often as a row's that drafted every step. (The states kept while it waited were cut to the
    head's columns twice: EAGLE-3's and DFlash's heads started from no context, SmolLM2's
    EAGLE-3 head accepted 0.13 at position 1 against 0.41, and adaptive k found no gain in them.
    A backlog after idleness is fed before the step, apart from its first forward.)"""
    engine = Engine(runtime_for(method), max_batch=4)
    plain = engine.generate(prompts[:4], PLAIN, 32, method="none")
    planned, steps = engine.speculator.plan, {"count": 0}

    def late(seqs, max_context):  # the first 6 steps draft nothing, then 5 in every 9
        steps["count"] += 1
        idle = steps["count"] <= 6 or steps["count"] % 9 < 5
        return [0] * len(seqs) if idle else planned(seqs, max_context)

    def acceptance(results) -> float:
        spec = [r.stats["spec"] for r in results]
        return sum(s["accepted"] for s in spec) / max(1, sum(s["drafted"] for s in spec))

    early = engine.generate(prompts[:4], PLAIN, 32, method=method, num_draft=2, adaptive=False)
    engine.speculator.plan = late
    later = engine.generate(prompts[:4], PLAIN, 32, method=method, num_draft=2, adaptive=False)
    assert [r.tokens for r in early] == [r.tokens for r in later] == [r.tokens for r in plain]
    assert acceptance(later) >= 0.8 * acceptance(early), (acceptance(later), acceptance(early))


@pytest.mark.parametrize("method", ["mtp", "eagle3", "dflash", "mtp+suffix"])
def test_the_next_turn_of_a_conversation_feeds_a_head_its_new_positions(runtime_for, prompts, method):
    """A head keeps the KV of rows that left, by the tokens that made it: the next turn (the
    prompt, its answer and a new message) feeds the head its new positions only, not the whole
    conversation again (SmolLM2's EAGLE-3 head re-joined 892 positions in 118 ms, now 24 in 7); its
    drafts land as a fresh server's do, and its output is plain's."""
    engine = Engine(runtime_for(method), max_batch=4)
    first = engine.generate([prompts[6]], PLAIN, 24, method=method, num_draft=2, adaptive=False)[0]
    turn = prompts[6] + first.tokens + prompts[7][:12]
    plain = engine.generate([turn], PLAIN, 24, method="none")[0].tokens
    joined = engine.status()["proposers"][method]["joined_positions"]
    again = engine.generate([turn], PLAIN, 24, method=method, num_draft=2, adaptive=False)[0]
    head = engine.status()["proposers"][method]
    fresh = Engine(runtime_for(method), max_batch=4).generate([turn], PLAIN, 24, method=method, num_draft=2,
                                                              adaptive=False)[0]
    assert again.tokens == fresh.tokens == plain
    # the new message's 12 positions and the answer's last few, which its head had not fed yet
    assert head["kept_prefixes"]["hits"] == 1 and head["joined_positions"] - joined <= 12 + 6 < len(turn) // 4, head
    assert again.stats["spec"]["accepted"] >= 0.8 * fresh.stats["spec"]["accepted"] > 0


def test_the_next_turn_of_a_conversation_reuses_the_drafts_kv(runtime_for, prompts):
    """A draft model keeps the KV of rows that left by their tokens: the next turn (the prompt,
    its answer and a new message) prefills only the new tokens in the draft, and its output
    still equals plain decoding's."""
    engine = Engine(runtime_for("draft"), max_batch=4)
    first = engine.generate([prompts[6]], PLAIN, 24, method="draft", num_draft=2, adaptive=False)[0]
    turn = prompts[6] + first.tokens + prompts[7][:12]
    plain = engine.generate([turn], PLAIN, 24, method="none")[0].tokens
    again = engine.generate([turn], PLAIN, 24, method="draft", num_draft=2, adaptive=False)[0]
    kept = engine.status()["proposers"]["draft"]["kept_prefixes"]
    assert again.tokens == plain and again.stats["spec"]["accepted"] > 0
    assert kept["hits"] == 1 and kept["reused_tokens"] > len(prompts[6]), kept
