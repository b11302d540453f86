"""built:tiny-moe, the MoE stand-in: the embedded target sparse-upcycled into a 64-expert
glm4_moe, with the dense target's logits, and greedy speculation equal to plain decoding on it
for every model proposer and n-gram, batched."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from macspec.config import load_profile
from macspec.engine.engine import Engine
from macspec.engine.runtime import Runtime
from macspec.models import expert_union
from macspec.models.checkpoint import load_dir, load_mtp_head
from macspec.models.loader import resolve_path
from macspec.models.store import embedded_dir
from macspec.models.view import ModelView
from macspec.paths import CACHE_ENV
from macspec.sampling import SamplingParams
from macspec.models.textconfig import moe_shape

PROMPTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser(",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
           "import os\n\ndef walk(root):\n    for path, dirs, files in os.walk(root):",
           "    def __repr__(self):\n        return f\""]


@pytest.fixture(scope="module")
def moe_cache(tmp_path_factory):
    """One build for the module, in its own cache dir (the build is ~0.9 GB)."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("moe-cache"))
    try:
        yield resolve_path("built:tiny-moe")
    finally:
        os.environ.pop(CACHE_ENV) if before is None else os.environ.__setitem__(CACHE_ENV, before)


@pytest.mark.slow
def test_logits_and_mtp_head_equal_the_dense_targets(moe_cache):
    moe, dense = load_dir(moe_cache, dtype="float32"), load_dir(embedded_dir() / "tiny-target", dtype="float32")
    assert moe.config["model_type"] == "glm4_moe" and moe_shape(moe.config) == (64, 8)
    ids = mx.array([dense.tokenizer.encode(PROMPTS[0] + PROMPTS[1])])
    a, b = moe.model(ids), dense.model(ids)
    assert mx.abs(a - b).max().item() < 1e-3 and mx.array_equal(a.argmax(-1), b.argmax(-1))
    heads = {"moe": load_mtp_head(moe), "dense": load_mtp_head(dense)}
    assert type(heads["moe"].block.mlp).__name__ == "MoE"
    hidden = mx.random.normal((1, ids.shape[1], 256), key=mx.random.key(1))
    wide = mx.pad(hidden, [(0, 0), (0, 0), (0, 512 - 256)])  # the widened stream: zeros beyond 256
    outs = {"moe": heads["moe"](ids, wide, ModelView(moe.model)),
            "dense": heads["dense"](ids, hidden, ModelView(dense.model))}
    logits = {name: out[0] if isinstance(out, tuple) else out for name, out in outs.items()}
    assert mx.abs(logits["moe"] - logits["dense"]).max().item() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "mtp", "ngram"])
def test_greedy_speculation_equals_plain_batched(moe_cache, method):
    profile = load_profile("tiny-moe")
    profile.speculative.method = method
    runtime = Runtime.load(profile)
    prompts = [runtime.tokenizer.encode(p) for p in PROMPTS]
    engine = Engine(runtime, max_batch=4)
    with expert_union.mlx_lm_path():  # the reference: mlx-lm's per-pair gathers
        plain = engine.generate(prompts, SamplingParams(), 32, method="none")
    spec = engine.generate(prompts, SamplingParams(), 32, num_draft=3, adaptive=False)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert sum(c.stats["spec"]["accepted"] for c in spec) > 0, [c.stats["spec"] for c in spec]


@pytest.mark.slow
def test_a_heads_join_skips_its_experts_and_drafts_the_same(moe_cache, monkeypatch):
    """A row's first proposal writes its context into the MTP head's cache through the block's
    attention alone: the experts' pass over the prompt (most of a join: tiny-moe's 16 rows took
    520 ms, 138 without) is skipped, and the head drafts and is accepted exactly as after the
    whole block."""
    from macspec.speculative.mtp import MTPGroup

    profile = load_profile("tiny-moe")
    profile.speculative.method = "mtp"
    runtime = Runtime.load(profile)
    prompts = [runtime.tokenizer.encode(p) for p in PROMPTS]
    joining, experts_in_joins = [False], []
    take_on, moe_call = MTPGroup._take_on, type(runtime.mtp_head.block.mlp).__call__

    def flagged_take_on(self, row, kept):
        joining[0] = True
        try:
            take_on(self, row, kept)
        finally:
            joining[0] = False

    def counted_moe(self, x):
        if joining[0]:
            experts_in_joins.append(x.shape)
        return moe_call(self, x)

    monkeypatch.setattr(MTPGroup, "_take_on", flagged_take_on)
    monkeypatch.setattr(type(runtime.mtp_head.block.mlp), "__call__", counted_moe)

    def run():
        done = Engine(runtime, max_batch=4).generate(prompts, SamplingParams(), 32, num_draft=3, adaptive=False)
        return [(c.tokens, c.stats["spec"]["drafted"], c.stats["spec"]["accepted"]) for c in done]

    def prompts_through_experts():  # a join's whole-block pass runs the experts over a prompt
        return [shape for shape in experts_in_joins if shape[1] >= min(len(p) for p in prompts) - 1]

    alone = run()
    assert prompts_through_experts() == []
    monkeypatch.setattr(MTPGroup, "attention_alone", False)  # every join through the whole block
    assert run() == alone
    assert prompts_through_experts()  # the whole block's joins did read the experts
    assert sum(drafted for _, drafted, _ in alone) > 0
