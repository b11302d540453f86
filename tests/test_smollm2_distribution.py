"""Speculative sampling on the real SmolLM2 with its shipped MTP head keeps the target's
distribution: chi-square of the first three sampled tokens against the exact joint, computed
from the target alone (top-k 3 keeps the joint to 27 cells; repetition penalty as the profile)."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from macspec.config import load_profile
from macspec.engine.runtime import Runtime
from macspec.sampling import RowContext, SamplingParams, processed_logprobs

from .conftest import engine_for
from .test_distribution import chi_square_p
from .test_gguf import smollm2  # noqa: F401  (the pull-path fixture)

pytestmark = pytest.mark.slow

TOP = 3
SAMPLES = 960
MIN_P_VALUE = 1e-3
PARAMS = SamplingParams(temperature=0.7, top_k=TOP, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def runtime(smollm2):  # noqa: F811
    profile = load_profile("smollm2")
    profile.model.path = str(smollm2[0])  # the user's cache, not the per-test home
    return Runtime.load(profile)


def exact_joint(runtime: Runtime, prompt: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """P over the top-3 paths: joint [3, 3, 3] and, per level, the ids those cells stand for."""
    model = runtime.target.model

    def top(history):
        logits = model(mx.array(history)[None])[0, -1:]
        p = np.array(mx.exp(processed_logprobs(logits, RowContext(PARAMS, history, len(prompt))))[0])
        ids = np.argsort(-p)[:TOP]
        return [int(i) for i in ids], p[ids]

    ids1, p1 = top(prompt)
    joint = np.zeros((TOP,) * 3)
    tree = {}
    for a, t1 in enumerate(ids1):
        ids2, p2 = top(prompt + [t1])
        for b, t2 in enumerate(ids2):
            ids3, p3 = top(prompt + [t1, t2])
            joint[a, b] = p1[a] * p2[b] * p3
            tree[(t1, t2)] = ids3
        tree[t1] = ids2
    return joint, [ids1, tree]


def test_mtp_sampling_on_smollm2_matches_the_target(runtime):
    assert runtime.method == "mtp"
    messages = [{"role": "user", "content": "Name a color."}]
    prompt = list(runtime.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    joint, (ids1, tree) = exact_joint(runtime, prompt)
    assert abs(joint.sum() - 1) < 1e-3  # top-k 3 leaves exactly these paths
    engine = engine_for(runtime)
    counts = np.zeros((TOP,) * 3)
    drafted = accepted = 0
    batch = 16
    for start in range(0, SAMPLES, batch):
        params = [SamplingParams(**{**PARAMS.__dict__, "seed": 5_000 + start + i}) for i in range(batch)]
        for done in engine.generate([prompt] * batch, params, 3, num_draft=2, adaptive=False,
                                    ignore_eos=True):
            t1, t2, t3 = done.tokens
            a = ids1.index(t1)
            b = tree[t1].index(t2)
            counts[a, b, tree[(t1, t2)].index(t3)] += 1
            drafted += done.stats["spec"]["drafted"]
            accepted += done.stats["spec"]["accepted"]
    assert drafted >= SAMPLES and 0 < accepted < drafted  # the rejection path runs
    assert chi_square_p(counts.sum(2), joint.sum(2)) > MIN_P_VALUE  # (t1, t2)
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > MIN_P_VALUE  # t3 by rank
    assert chi_square_p(counts.reshape(-1), joint.reshape(-1)) > MIN_P_VALUE  # the joint
