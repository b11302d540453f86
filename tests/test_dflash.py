"""DFlash block drafters (models/dflash.py, speculative/dflash.py): the published layout read as
SGLang and vLLM read it, a drafter for another target refused with the reason, and one loaded
through the profile (the published key names, random weights) verified losslessly. Greedy
equality and the distribution at T > 0 for the shipped drafter are in test_lossless.py and
test_distribution.py, with every proposer."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from macspec.config import load_profile
from macspec.engine.launch import calibrated_engine
from macspec.engine.runtime import Runtime
from macspec.errors import MacspecError, ModelLoadError
from macspec.models.dflash import DFlashConfig, build_drafter, default_target_layers, random_drafter, read_drafter
from macspec.models.store import embedded_dir
from macspec.sampling import SamplingParams

from .conftest import tiny_runtime

# z-lab/Qwen3-8B-DFlash-b16's config.json (its keys and values; SpecForge's qwen3-8b-dflash).
QWEN3_8B_B16 = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "rope_scaling": None, "max_position_embeddings": 40960, "vocab_size": 151936, "attention_bias": False,
    "layer_types": ["full_attention"] * 5, "dtype": "bfloat16"}


def test_the_published_config_reads_as_the_reference_reads_it():
    config = DFlashConfig.from_dict(QWEN3_8B_B16, "qwen3-8b")
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (5, 8, 128)
    # Without target_layer_ids the reference spreads them from layer 1 to L - 3: the same here.
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    nested = {**QWEN3_8B_B16, "dflash_config": {"mask_token_id": 7, "block_size": 8}}
    del nested["block_size"]
    assert DFlashConfig.from_dict(nested, "nested").block_size == 8


def test_a_draft_vocabulary_that_does_not_fit_is_refused_with_the_reason(tmp_path):
    target_config = json.loads((embedded_dir() / "tiny-target" / "config.json").read_text())
    vocab = target_config["vocab_size"]
    path = random_drafter(tmp_path / "d", target_config, layers=1, block_size=3, mask_token_id=0,
                          vocab_ids=[0, 5, vocab - 1])
    config, weights = read_drafter(path)
    hidden, layers = target_config["hidden_size"], target_config["num_hidden_layers"]
    assert build_drafter(config, weights, hidden, layers, vocab, mx.float32, "d").vocab_ids.tolist() == [0, 5, vocab - 1]
    with pytest.raises(ModelLoadError, match="target ids 0..%d, outside the target's vocabulary of %d" % (vocab - 1, vocab - 1)):
        build_drafter(config, weights, hidden, layers, vocab - 1, mx.float32, "d")
    with pytest.raises(ModelLoadError, match="draft_vocab_size 3 < vocab_size .* no d2t"):
        build_drafter(config, {k: v for k, v in weights.items() if k != "d2t"}, hidden, layers, vocab, mx.float32, "d")


def test_not_a_drafter_is_refused_by_name():
    with pytest.raises(ModelLoadError, match="not a DFlash drafter"):
        DFlashConfig.from_dict({**QWEN3_8B_B16, "architectures": ["Qwen3ForCausalLM"]}, "x")


@pytest.mark.slow
def test_a_drafter_for_another_target_is_refused_with_the_reason(tmp_path):
    other = {**json.loads((embedded_dir() / "tiny-target" / "config.json").read_text()), "hidden_size": 512,
             "num_hidden_layers": 12}
    profile = load_profile("tiny")
    profile.override("speculative.method", "dflash", "test")
    profile.override("speculative.dflash_drafter", str(random_drafter(tmp_path / "d", other)), "test")
    with pytest.raises(MacspecError, match="hidden size 512.*256.*12 layers, this one has 6"):
        Runtime.load(profile)


@pytest.mark.slow
@pytest.mark.parametrize("vocabulary", [None, "odd ids"])
def test_a_drafter_in_the_published_layout_loads_from_the_profile_and_stays_lossless(tmp_path, prompts, vocabulary):
    """z-lab's layout, and macspec's forged one with a draft vocabulary (EAGLE-3's d2t)."""
    target_config = json.loads((embedded_dir() / "tiny-target" / "config.json").read_text())
    profile = load_profile("tiny")
    profile.override("speculative.method", "dflash", "test")
    vocab_ids = None if vocabulary is None else list(range(1, target_config["vocab_size"], 2))
    # a block of 3 (2 drafts) under the profile's num_draft_tokens: calibration times what fits
    path = random_drafter(tmp_path / "dflash", target_config, layers=3, block_size=3, seed=4, vocab_ids=vocab_ids)
    profile.override("speculative.dflash_drafter", str(path), "test")
    runtime = Runtime.load(profile)
    assert runtime.dflash_drafter.config.target_layer_ids == (1, 2, 3)
    engine = calibrated_engine(runtime, max_batch=4)
    plain = [c.tokens for c in engine.generate(prompts[:4], SamplingParams(), 24, method="none")]
    for k in (1, 2, 9):  # 9: more than the block holds (2 drafts), capped by the drafter's offer
        out = engine.generate(prompts[:4], SamplingParams(), 24, num_draft=k, adaptive=False)
        assert [c.tokens for c in out] == plain
        assert all(c.stats["spec"]["drafted"] > 0 for c in out)
        assert max(max(c.stats["spec"]["k_histogram"], key=int) for c in out) == str(min(k, 2))
    assert engine.status()["speculation_faults"]["total"] == 0


@pytest.mark.slow
def test_the_shipped_drafter_drafts_accepted_tokens(prompts):
    """Trained on the target's corpus, its first draft is mostly right (0.7-0.8 held out)."""
    engine = calibrated_engine(tiny_runtime("dflash"), max_batch=4)
    out = engine.generate(prompts[:4], SamplingParams(), 40, num_draft=1, adaptive=False, method="dflash")
    accepted = sum(c.stats["spec"]["accepted"] for c in out)
    drafted = sum(c.stats["spec"]["drafted"] for c in out)
    assert accepted / drafted > 0.5, (accepted, drafted)


@pytest.mark.slow
def test_the_forge_smoke_recipe_writes_a_drafter_the_profile_loads(tmp_path, prompts):
    from macspec.forge.dflash import RECIPES, forge_drafter

    report = forge_drafter(tmp_path / "dflash", RECIPES["smoke"])
    assert len(report["heldout_top1_agreement_by_position"]) == RECIPES["smoke"].block_size - 1
    profile = load_profile("tiny")
    profile.override("speculative.method", "dflash", "test")
    profile.override("speculative.dflash_drafter", str(tmp_path / "dflash"), "test")
    engine = calibrated_engine(Runtime.load(profile), max_batch=1)
    [plain] = engine.generate(prompts[:1], SamplingParams(), 16, method="none")
    [spec] = engine.generate(prompts[:1], SamplingParams(), 16, num_draft=3, adaptive=False)
    assert spec.tokens == plain.tokens and spec.stats["spec"]["drafted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("profile_name, target", [
    ("kimi-tp2-mini", None), ("kimi-tp2-mini", "built:moonlight-mini"), ("glm5-mtp-mini", None)],
    ids=["kimi_k25", "deepseek_v3", "glm_moe_dsa"])
def test_seed_architectures_take_a_drafter_losslessly(tmp_path, profile_name, target):
    """The seed replicas (MLA + MoE, a kimi_k25 wrapper, GLM-5's DSA indexer) with a drafter
    made for them (random weights): batched greedy output equals plain at k = 1 and 3."""
    base = load_profile(profile_name)
    if target:
        base.model.path = target
    base.speculative.method = "none"
    plain_runtime = Runtime.load(base)
    base.speculative.method = "dflash"
    base.speculative.dflash_drafter = str(random_drafter(tmp_path / "d", plain_runtime.target.config,
                                                         block_size=4))
    runtime = Runtime.load(base)
    tok = runtime.tokenizer
    prompts = [tok.encode(text) for text in ("The history of", "def main():\n", "Once upon a time")]
    plain = [c.tokens for c in calibrated_engine(plain_runtime, 4).generate(prompts, SamplingParams(), 16,
                                                                             method="none")]
    engine = calibrated_engine(runtime, 4)
    for k in (1, 3):
        done = engine.generate(prompts, SamplingParams(), 16, num_draft=k, adaptive=False)
        assert [c.tokens for c in done] == plain
        assert sum(c.stats["spec"]["drafted"] for c in done) > 0
