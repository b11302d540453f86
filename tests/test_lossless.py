"""Speculative greedy output equals plain greedy output, token for token."""

from __future__ import annotations

import pytest
from mlx_lm.generate import generate_step

import mlx.core as mx

from macspec.sampling import SamplingParams

from .conftest import generate

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
    key = params.repetition_penalty
    if key not in _reference:
        runtime = runtime_for("none")
        runs = [generate(runtime, p, MAX_TOKENS, params, stop_token_ids=stop_ids(runtime, i))
                for i, p in enumerate(prompts)]
        _reference[key] = [(tokens, gen.stats.finish_reason) for tokens, gen in runs]
    return _reference[key]


def test_prompts_cover_eos_and_max_tokens(runtime_for, prompts):
    reasons = [reason for _, reason in plain_outputs(runtime_for, prompts, PLAIN)]
    assert len(prompts) >= 20
    assert "stop" in reasons and "length" in reasons


def test_plain_matches_mlx_lm_greedy(runtime_for, prompts):
    runtime = runtime_for("none")
    for prompt, (ours, _) in zip(prompts[:6], plain_outputs(runtime_for, prompts, PLAIN)):
        theirs = []
        for token, _ in generate_step(mx.array(prompt), runtime.target.model, max_tokens=len(ours)):
            theirs.append(int(token))
        assert ours == theirs[: len(ours)]


@pytest.mark.parametrize("params", [PLAIN, PENALIZED], ids=["plain", "repetition-penalty"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("method", ["draft", "mtp", "ngram"])
def test_speculative_greedy_equals_plain(runtime_for, prompts, method, k, params):
    runtime = runtime_for(method)
    reference = plain_outputs(runtime_for, prompts, params)
    drafted = 0
    for i, (prompt, (expected, reason)) in enumerate(zip(prompts, reference)):
        tokens, gen = generate(runtime, prompt, MAX_TOKENS, params, k=k,
                               stop_token_ids=stop_ids(runtime, i))
        assert tokens == expected, f"{method} k={k} diverged on prompt {prompt[:8]}"
        assert gen.stats.finish_reason == reason
        drafted += gen.stats.spec.num_drafted
    assert drafted > 0, "the proposer never proposed: the test would prove nothing"
