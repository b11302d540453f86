"""Model loading: embedded dirs open in plain mlx-lm; MTP layouts of DeepSeek-V3 / GLM load."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from macspec.config import Profile
from macspec.kv.cache import make_trimmable_cache
from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec.errors import IncompatibleDraftError, ModelLoadError, UnsupportedModelError
from macspec.models.compat import check_draft_compatible
from macspec.models.checkpoint import load_mtp_head
from macspec.models.loader import load_model, resolve_path

from .conftest import engine_for, generate
from .modeldirs import build_model, random_mtp_head, save_model, write_word_tokenizer

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_shared_experts": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1,
    "topk_group": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
}
GLM_MOE_DSA = {
    **DEEPSEEK_V3, "model_type": "glm_moe_dsa", "index_head_dim": 16, "index_n_heads": 2,
    "index_topk": 8, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "moe_layer_freq": 1,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
}
WORDS = [f"w{i}" for i in range(64)]


def write_mtp_dir(tmp_path, config, name):
    model = build_model(config, seed=0)
    head = random_mtp_head(model, config, seed=1)
    out = save_model(model, config, tmp_path / name, mtp_head=head, mtp_inline=True)
    write_word_tokenizer(out, WORDS)
    return out


def test_embedded_dirs_open_in_plain_mlx_lm():
    for name in ("tiny-target", "tiny-draft"):
        model, tokenizer = mlx_load(str(resolve_path(f"embedded:{name}")))
        assert tokenizer.chat_template
        assert model(mx.array([[1, 2, 3]])).shape[-1] == len(tokenizer.vocab)


def test_embedded_target_has_mtp_in_deepseek_layout():
    path = resolve_path("embedded:tiny-target")
    config = json.loads((path / "config.json").read_text())
    keys = mx.load(str(path / "mtp.safetensors")).keys()
    layer = config["num_hidden_layers"]
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.q_proj", "mlp.gate_proj"):
        assert any(k.startswith(f"model.layers.{layer}.{part}") for k in keys), part
    assert config["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("config", [DEEPSEEK_V3], ids=["deepseek_v3"])
def test_mtp_on_mla_moe_target_is_lossless(tmp_path, config):
    """The Kimi/DeepSeek code path: MLA attention, MoE MTP block stripped by mlx-lm's sanitize."""
    path = write_mtp_dir(tmp_path, config, config["model_type"])
    target = load_model(str(path))  # mlx-lm's sanitize drops layer N; we keep it
    head = load_mtp_head(target)
    assert type(head.block).__name__ == type(target.model.layers[-1]).__name__
    profile = Profile()
    runtime_plain = Runtime(profile, target, "none")
    runtime_mtp = Runtime(profile, target, "mtp", mtp_head=head)
    prompt = [3, 5, 7, 9, 11]
    expected, _ = generate(runtime_plain, prompt, 24, SamplingParams())
    for k in (1, 3):
        tokens, gen = generate(runtime_mtp, prompt, 24, SamplingParams(), k=k)
        assert tokens == expected
        assert gen.stats["spec"]["drafted"] > 0


def test_glm_moe_dsa_mtp_runs_losslessly_through_the_engine(tmp_path):
    """GLM-5's architecture (DSA indexer, MoE, MTP layer): its caches roll back and MTP
    speculation through the engine equals plain decoding."""
    path = write_mtp_dir(tmp_path, GLM_MOE_DSA, "glm")
    target = load_model(str(path))
    head = load_mtp_head(target)
    cache = make_trimmable_cache(target.model)
    assert len(cache) == GLM_MOE_DSA["num_hidden_layers"]
    expected, _ = generate(Runtime(Profile(), target, "none"), [1, 2, 3], 8, SamplingParams())
    tokens, done = generate(Runtime(Profile(), target, "mtp", mtp_head=head), [1, 2, 3], 8,
                            SamplingParams(), k=2)
    assert tokens == expected and len(tokens) == 8
    assert done.stats["spec"]["drafted"] > 0
    # Batched rows of different lengths (the indexer's cache is batched beside the latent's).
    plain = Runtime(Profile(), target, "none")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    alone = [generate(plain, p, 12, SamplingParams())[0] for p in prompts]
    batch = engine_for(Runtime(Profile(), target, "mtp", mtp_head=head)).generate(
        prompts, SamplingParams(), 12, num_draft=2)
    assert [c.tokens for c in batch] == alone


def test_missing_mtp_weights_are_a_clear_error(tmp_path):
    config = {**DEEPSEEK_V3, "num_nextn_predict_layers": 1}
    out = save_model(build_model(DEEPSEEK_V3, seed=0), config, tmp_path / "stripped")
    write_word_tokenizer(out, WORDS)
    with pytest.raises(UnsupportedModelError, match="mlx_lm.convert strips them"):
        load_mtp_head(load_model(str(out)))


def test_no_mtp_layer_in_config_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="no MTP layer"):
        load_mtp_head(load_model("embedded:tiny-draft"))


def test_a_quantized_moe_mtp_head_runs_quantized_and_losslessly(tmp_path):
    """Its routed experts stay packed (QuantizedSwitchLinear), as the target's would; unpacking
    is opt-in and proposes the same tokens."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model = build_model(DEEPSEEK_V3, seed=0)
    head = random_mtp_head(model, DEEPSEEK_V3, seed=1)
    nn.quantize(head.block, group_size=32, bits=8,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0)
    config = {**DEEPSEEK_V3, "quantization": {"group_size": 32, "bits": 8}}
    # Only the MTP layer carries scales: mlx-lm leaves the target's unpacked modules as they are.
    out = save_model(model, config, tmp_path / "q", mtp_head=head, mtp_inline=True)
    write_word_tokenizer(out, WORDS)
    target = load_model(str(out))
    loaded = load_mtp_head(target)
    experts = loaded.block.mlp.switch_mlp.gate_proj
    assert type(experts).__name__ == "QuantizedSwitchLinear" and experts.bits == 8
    unpacked = load_mtp_head(target, dequantize=True)
    assert not any(k.endswith(".scales") for k, _ in tree_flatten(unpacked.parameters()))
    plain = generate(Runtime(Profile(), target, "none"), [3, 5, 7, 9], 16, SamplingParams())[0]
    for each in (loaded, unpacked):
        tokens, done = generate(Runtime(Profile(), target, "mtp", mtp_head=each), [3, 5, 7, 9], 16,
                                SamplingParams(), k=2)
        assert tokens == plain and done.stats["spec"]["drafted"] > 0


def test_sliding_window_caches_become_full_and_recurrent_ones_are_refused():
    class Sliding:
        layers = [0, 1]

        def make_cache(self):
            return [RotatingKVCache(max_size=4), RotatingKVCache(max_size=4)]

    class Recurrent(Sliding):
        def make_cache(self):
            return [ArraysCache(size=2), RotatingKVCache(max_size=4)]

    assert all(type(c).__name__ == "KVCache" for c in make_trimmable_cache(Sliding()))
    with pytest.raises(UnsupportedModelError, match="layer 0 uses ArraysCache"):
        make_trimmable_cache(Recurrent())


def test_draft_with_other_tokenizer_is_diagnosed(tmp_path):
    target = load_model("embedded:tiny-target")
    other = tmp_path / "other"
    save_model(build_model(DEEPSEEK_V3, seed=0), DEEPSEEK_V3, other)
    write_word_tokenizer(other, WORDS)
    draft = load_model(str(other))
    with pytest.raises(IncompatibleDraftError, match="vocabularies differ"):
        check_draft_compatible(target.tokenizer, draft.tokenizer, "t", "d")
    check_draft_compatible(target.tokenizer, load_model("embedded:tiny-draft").tokenizer, "t", "d")


@pytest.mark.parametrize("spec, message", [
    ("embedded:nope", "no embedded model 'nope'"),
    ("/definitely/not/here", "no such directory"),
    ("./relative/missing", "no such directory"),
])
def test_bad_model_paths(spec, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_path(spec)


def test_dir_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_path(str(tmp_path))


def test_widened_stand_in_preserves_logits_and_mtp():
    from macspec.models.widen import widen_mtp_head, widen_target
    from macspec.models.view import ModelView

    target = load_model("embedded:tiny-target")
    head = load_mtp_head(target)
    cfg = target.config
    hidden = 2 * cfg["hidden_size"]
    wide, wide_cfg = widen_target(target.model, cfg, hidden=hidden)
    assert wide_cfg["num_attention_heads"] == 2 * cfg["num_attention_heads"]
    assert wide_cfg["intermediate_size"] == 2 * cfg["intermediate_size"]
    tokens = mx.array([[5, 17, 300, 42, 7, 99, 100, 3]])
    small_logits, small_h = ModelView(target.model).forward(tokens)
    wide_logits, wide_h = ModelView(wide).forward(tokens)
    assert mx.allclose(small_logits, wide_logits, atol=1e-3).item()
    wide_head = widen_mtp_head(head, wide, target.config, wide_cfg)
    small_mtp, _ = head(tokens[:, 1:], small_h[:, :-1], ModelView(target.model))
    wide_mtp, _ = wide_head(tokens[:, 1:], wide_h[:, :-1], ModelView(wide))
    assert mx.allclose(small_mtp, wide_mtp, atol=1e-3).item()
