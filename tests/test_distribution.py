"""Speculative sampling keeps the target's distribution (chi-square against the exact one)."""

from __future__ import annotations


import numpy as np
import pytest
from scipy.stats import chisquare

import mlx.core as mx

from macspec.config import Profile
from macspec.engine.runtime import Runtime
from macspec.grammar import GrammarCompiler
from macspec.sampling import RowContext, SamplingParams, processed_logprobs
from macspec.models.checkpoint import load_mtp_head
from macspec.models.loader import load_model
from macspec.models.dflash import random_drafter
from macspec.models.eagle3 import save_head
from macspec.proposers import SINGLE_NAMES

from .conftest import engine_for
from .modeldirs import (build_model, random_eagle3_head, random_mtp_head, save_model, tiny_llama_config,
                        write_word_tokenizer)

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

VOCAB = 8
# Every pair of tokens occurs in the prompt (a De Bruijn sequence of order 2): a proposer that
# drafts from the request's own context (n-gram, suffix) has a match at every step, even a seeded
# suffix request (which may not draft from other requests' answers).
PROMPT = [0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 1, 1, 2, 1, 3, 1, 4, 1, 5, 1, 6, 1, 7, 2, 2, 3, 2,
          4, 2, 5, 2, 6, 2, 7, 3, 3, 4, 3, 5, 3, 6, 3, 7, 4, 4, 5, 4, 6, 4, 7, 5, 5, 6, 5, 7, 6, 6, 7, 7, 0]
NUM_SAMPLES = 2000
MIN_P_VALUE = 1e-3
SCALE = 4.0  # sharpens the random heads: entropies well between one-hot and uniform


@pytest.fixture(scope="module")
def tiny_vocab_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyvocab")
    # Untied head: with tied embeddings a random model just repeats its input token.
    config = tiny_llama_config(VOCAB, tied=False)
    target = build_model(config, seed=1, scale=SCALE)
    head = random_mtp_head(target, config, seed=3)
    dirs = {"target": save_model(target, config, root / "target", mtp_head=head),
            "draft": save_model(build_model(config, seed=2, scale=SCALE), config, root / "draft")}
    # Shipped beside the target, as SmolLM2's: over 6 of the 8 tokens (q = 0 for the other two).
    save_head(random_eagle3_head(target, config, seed=4, draft_vocab=VOCAB - 2, scale=SCALE),
              dirs["target"] / "eagle3")
    random_drafter(dirs["target"] / "dflash", config, seed=5, layers=1, block_size=4)  # DFlash's, likewise
    for d in dirs.values():
        write_word_tokenizer(d, [chr(ord("a") + i) for i in range(VOCAB)], byte_level=True)
    return dirs


def make_runtime(dirs, method: str) -> Runtime:
    profile = Profile()
    profile.model.path = str(dirs["target"])
    profile.speculative.method = method
    target = load_model(str(dirs["target"]))
    # Both proposer models, whichever the method uses (a hybrid pairs one with suffix decoding).
    runtime = Runtime(profile, target, method, draft=load_model(str(dirs["draft"])),
                      mtp_head=load_mtp_head(target))
    if "eagle3" in method or method == "dflash":  # the proposers whose files ship beside the target
        runtime.ensure_method(method)
    return runtime


def exact_joint(runtime: Runtime, params: SamplingParams, allowed=None) -> np.ndarray:
    """P(t1, t2, t3) for the first three generated tokens, from the target alone;
    `allowed(output)` -> the grammar's mask [1, V] after those output tokens."""
    model = runtime.target.model

    def dist(history):
        logits = model(mx.array(history)[None])[0, -1:]
        masks = allowed(history[len(PROMPT):]) if allowed else None
        ctx = RowContext(params, history, len(PROMPT), masks)
        return np.array(mx.exp(processed_logprobs(logits, ctx))[0])

    joint = np.zeros((VOCAB,) * 3)
    p1 = dist(PROMPT)
    for t1 in range(VOCAB):
        p2 = dist(PROMPT + [t1])
        for t2 in range(VOCAB):
            joint[t1, t2] = p1[t1] * p2[t2] * dist(PROMPT + [t1, t2])
    return joint


def chi_square_p(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    expected = expected_probs.ravel() * counts.sum()
    observed = counts.ravel()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


CONFIGS = {
    "t1": SamplingParams(temperature=1.0),
    "processed": SamplingParams(temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3),
}


# Every single proposer batched with penalties and filters (the hardest regime; a batched row
# also runs alone once the others finish). Alone at T = 1, once for each kind of q the shared
# verify sees: a model's distribution (the draft) and a lookup's point mass (n-gram). One
# composite (its choice between kinds; its parts are covered above, and the composites share
# their code). Each case proves behaviour no other case does: ~30-55 s each on 2 cores.
ALONE = ("draft", "ngram")
COMPOSITE = "draft+suffix"
CASES = [(m, "t1", 1) for m in ALONE] + [(m, "processed", 4) for m in SINGLE_NAMES] + \
        [(COMPOSITE, "processed", 4)]


@pytest.mark.parametrize("method,config,batch", CASES)
def test_speculative_sampling_matches_target_distribution(tiny_vocab_dirs, method, config, batch):
    """Through the engine `serve` uses, alone and with `batch` requests sharing each step."""
    runtime = make_runtime(tiny_vocab_dirs, method)
    engine = engine_for(runtime)
    base = CONFIGS[config]
    joint = exact_joint(runtime, base)
    counts = np.zeros((VOCAB,) * 3)
    drafted = accepted = 0
    for start in range(0, NUM_SAMPLES, batch):
        params = [SamplingParams(**{**base.__dict__, "seed": 10_000 + start + i}) for i in range(batch)]
        # Longer than the 3 tokens counted when batched, so the rows overlap in decode steps.
        max_tokens = 4 if batch == 1 else 8
        for done in engine.generate([PROMPT] * batch, params, max_tokens, num_draft=2, adaptive=False,
                                    ignore_eos=True):
            counts[tuple(done.tokens[:3])] += 1  # t2, t3 come from one verify (k = 2)
            drafted += done.stats["spec"]["drafted"]
            accepted += done.stats["spec"]["accepted"]
    if batch > 1:
        assert max(engine.stats.batch_histogram) >= batch - 1  # the requests really shared steps
    assert drafted > NUM_SAMPLES // 2, "speculation must actually run"
    assert 0 < accepted < drafted, "a partial-acceptance regime exercises the rejection path"
    assert chi_square_p(counts.sum(2), joint.sum(2)) > MIN_P_VALUE  # (t1, t2)
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > MIN_P_VALUE  # t3
    assert chi_square_p(counts.sum((0, 2)), joint.sum((0, 2))) > MIN_P_VALUE  # t2


GRAMMAR = "[a-d][b-f][a-g]"  # three letters, then EOS ("h"): masks that differ by position


# The masks are the engine's and the chain base's (base.ChainGroup), which every model proposer shares.
@pytest.mark.parametrize("method", ["draft"])
def test_speculative_sampling_under_a_grammar_matches_the_masked_target(tiny_vocab_dirs, method):
    """Structured output with speculation on: each window position is masked by the grammar
    state after the drafts before it, and rejection sampling keeps the masked distribution."""
    runtime = make_runtime(tiny_vocab_dirs, method)
    engine = engine_for(runtime)
    compiler = GrammarCompiler(runtime.tokenizer, VOCAB)
    grammar = compiler.compile("regex", GRAMMAR)

    def allowed(output):
        constraint = compiler.constraint(grammar)
        if constraint.matcher.validate_tokens(list(output)) < len(output):
            return None  # a prefix the grammar never produces: its probability is 0 anyway
        constraint.commit(list(output))
        return constraint.masks([])[0]

    base = CONFIGS["t1"]
    joint = exact_joint(runtime, base, allowed)
    counts = np.zeros((VOCAB,) * 3)
    drafted = accepted = 0
    batch = 4
    for start in range(0, NUM_SAMPLES, batch):
        params = [SamplingParams(**{**base.__dict__, "seed": 20_000 + start + i}) for i in range(batch)]
        done = engine.generate([PROMPT] * batch, params, 8, num_draft=2, adaptive=False,
                               constraint=[compiler.constraint(grammar) for _ in range(batch)])
        for completion in done:
            assert completion.finish_reason == "stop" and len(completion.tokens) == 3
            counts[tuple(completion.tokens)] += 1
            drafted += completion.stats["spec"]["drafted"]
            accepted += completion.stats["spec"]["accepted"]
    assert drafted > NUM_SAMPLES // 2 and 0 < accepted < drafted
    assert joint[0, 0].sum() == 0 and joint[4:].sum() == 0 and joint[0, 1].sum() > 0  # masks bite
    assert chi_square_p(counts.sum(2), joint.sum(2)) > MIN_P_VALUE  # (t1, t2)
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > MIN_P_VALUE  # t3
    assert chi_square_p(counts.sum((0, 2)), joint.sum((0, 2))) > MIN_P_VALUE  # t2


def test_exact_match_acceptance_would_be_caught(tiny_vocab_dirs):
    """Power check: sampling the draft's argmax instead of the target fails the same test."""
    runtime = make_runtime(tiny_vocab_dirs, "none")
    joint = exact_joint(runtime, CONFIGS["t1"])
    draft = load_model(str(tiny_vocab_dirs["draft"])).model
    counts = np.zeros((VOCAB, VOCAB))
    rng = np.random.default_rng(0)
    p1 = joint.sum((1, 2)).astype(np.float64)
    p1 /= p1.sum()
    for _ in range(NUM_SAMPLES):
        t1 = rng.choice(VOCAB, p=p1)
        t2 = int(mx.argmax(draft(mx.array(PROMPT + [t1])[None])[0, -1]).item())
        counts[t1, t2] += 1
    assert chi_square_p(counts, joint.sum(2)) < MIN_P_VALUE
