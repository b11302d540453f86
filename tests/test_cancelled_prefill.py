"""A cancelled request leaves what it computed in the prefix cache: the prompt chunks it finished
prefilling (or its prompt and answer, once decoding), so a client's retry of the same prompt
prefills only the rest -- with the same greedy output as a run that was never cancelled.

The engine is stepped by hand: each step prefills at most one chunk's worth of tokens (one chunk
of this file's long prompt), so "cancelled after two chunks" holds on any machine, however slow.
Short prompts queued together start in one step."""

from __future__ import annotations

import pytest

from macspec.distributed.plan import decode_header, decode_ops, encode_plan
from macspec.engine.engine import Engine
from macspec.engine.request import Finished, GenerationRequest
from macspec.engine.runner import TargetRunner
from macspec.sampling import SamplingParams

from .serverutil import runtime_with

pytestmark = pytest.mark.slow  # loads a model

CHUNK = 16  # tokens per prefill forward: the prompt below is 6 chunks and a bit
MAX_TOKENS = 8
TEXT = "def parse(line):\n    fields = line.split(',')\n    return [f.strip() for f in fields]\n" * 6


@pytest.fixture(scope="module", params=["tiny", "tiny-mtp"])
def runtime(request):
    """A draft-model target, and an MTP one (its cache entries carry the target's states)."""
    return runtime_with(request.param, kv__prefill_chunk=CHUNK)


@pytest.fixture(scope="module")
def prompt(runtime):
    tokens = runtime.tokenizer.encode(TEXT)[:6 * CHUNK + 5]
    assert len(tokens) == 6 * CHUNK + 5
    return tokens


@pytest.fixture(scope="module")
def uncancelled(runtime, prompt):
    """The reference: a fresh engine, nothing cancelled, nothing cached."""
    [done] = Engine(runtime).generate([prompt], SamplingParams(), MAX_TOKENS, adaptive=False)
    assert done.stats["cached_prompt_tokens"] == 0
    return done.tokens


def _submit(engine: Engine, prompt: list[int]):
    events = []
    seq = engine.add_request(GenerationRequest(list(prompt), SamplingParams(), MAX_TOKENS, events.append,
                                               adaptive=False))
    return seq, events


def _retry(engine: Engine, prompt: list[int]):
    computed = engine.stats.totals["prompt_tokens"]
    [done] = engine.generate([prompt], SamplingParams(), MAX_TOKENS, adaptive=False)
    return done, engine.stats.totals["prompt_tokens"] - computed


def test_a_retry_resumes_after_the_chunks_a_cancelled_prefill_finished(runtime, prompt, uncancelled):
    engine = Engine(runtime)
    seq, events = _submit(engine, prompt)
    engine.step()
    engine.step()
    assert seq.prefill_done == 2 * CHUNK  # one chunk per step
    engine.cancel(seq.request.id)
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"

    done, prefilled = _retry(engine, prompt)
    assert done.stats["cached_prompt_tokens"] == 2 * CHUNK
    assert prefilled == len(prompt) - 2 * CHUNK
    assert done.tokens == uncancelled


def test_a_retry_queued_behind_the_cancelled_prefill_resumes_too(runtime, prompt, uncancelled):
    """The client's retry may arrive before the server notices the first connection is gone."""
    engine = Engine(runtime, max_batch=2)
    first, _ = _submit(engine, prompt)
    engine.step()
    retry, events = _submit(engine, prompt)
    engine.step()  # admits the retry (behind the first), prefills the first's second chunk
    assert first.prefill_done == 2 * CHUNK and retry.prefill_done == 0
    engine.cancel(first.request.id)
    engine.run_until_done()
    assert events[-1].stats["cached_prompt_tokens"] == 2 * CHUNK
    assert [t for e in events if hasattr(e, "ids") for t in e.ids] == uncancelled


def test_a_request_cancelled_while_decoding_keeps_its_prompt_and_answer(runtime, prompt, uncancelled):
    engine = Engine(runtime)
    seq, events = _submit(engine, prompt)
    while seq.stats.generated_tokens < 3:
        engine.step()
    engine.cancel(seq.request.id)
    answer = [t for e in events if hasattr(e, "ids") for t in e.ids]
    assert events[-1].reason == "cancelled" and answer == uncancelled[:len(answer)]

    follow_up = prompt + seq.committed[len(prompt):]  # the next turn starts with the answer so far
    [done] = engine.generate([follow_up], SamplingParams(), MAX_TOKENS, adaptive=False)
    assert done.stats["cached_prompt_tokens"] == len(follow_up) - 1
    done, _ = _retry(engine, prompt)
    assert done.stats["cached_prompt_tokens"] == len(prompt) - 1 and done.tokens == uncancelled


class _Replica:
    """A second rank in this process: applies rank 0's step plans to its own TargetRunner."""

    def __init__(self, runner: TargetRunner):
        self.runner = runner
        self.sequence = 0

    def send(self, ops: list[list[int]]) -> None:
        plan = encode_plan(self.sequence, ops)
        num_ops, length = decode_header(plan, self.sequence)
        for op, args in decode_ops(plan[5:5 + length], num_ops):
            getattr(self.runner, op.name)(*args)
        self.sequence += 1


def test_every_rank_keeps_the_same_cancelled_prefix(runtime, prompt):
    """Under TP the insert is ops in rank 0's step plan (close_slot, remove_row, drop_prefixes):
    a replica replaying the plan holds the same entries with the same KV."""
    from macspec.distributed.channel import MirroredRunner

    import mlx.core as mx

    engine = Engine(runtime)
    replica = _Replica(TargetRunner(runtime.view))
    engine.runner = engine.scheduler.runner = MirroredRunner(engine.runner, replica)
    seq, _ = _submit(engine, prompt)
    engine.step()
    engine.step()
    engine.cancel(seq.request.id)
    [done] = engine.generate([prompt[:3 * CHUNK + 2]], SamplingParams(), MAX_TOKENS, adaptive=False)
    assert done.stats["cached_prompt_tokens"] == 2 * CHUNK  # the replica opened its slot there too
    engine.runner.heartbeat()  # flushes the ops still pending
    local = engine.runner.state.prefixes
    assert sorted(local) == sorted(replica.runner.prefixes) and local
    for entry, layers in local.items():
        for ours, theirs in zip(layers, replica.runner.prefixes[entry]):
            assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))


def test_short_prompts_queued_together_start_in_one_step(runtime):
    """A step prefills up to one chunk's worth of tokens, in whole chunks: prompts that fit
    together all get their first token in the first step (one prompt a step held the last of
    16 arrivals back 15 steps), and a prompt longer than what is left waits for the next step.
    Each answer is the one it gets alone."""
    tokens = runtime.tokenizer.encode(TEXT)
    size = CHUNK // 4
    short = [tokens[i * size:(i + 1) * size] for i in range(4)]  # four prompts: one chunk's worth
    waiting = tokens[:CHUNK + 3]
    engine = Engine(runtime, max_batch=8)
    submitted = [_submit(engine, p) for p in short + [waiting]]
    engine.step()
    started = [any(getattr(e, "ids", None) for e in events) for _, events in submitted]
    assert started == [True] * 4 + [False]
    engine.run_until_done()
    alone = [Engine(runtime).generate([p], SamplingParams(), MAX_TOKENS, adaptive=False)[0].tokens
             for p in short + [waiting]]
    assert [[t for e in events if hasattr(e, "ids") for t in e.ids] for _, events in submitted] == alone
