"""Miniature replicas of the seed models (models/replicas.py): built deterministically, real mlx-lm
dirs with the real checkpoints' model_type, config keys, layout and quantization, one tokenizer
for the Kimi/Moonlight pair, an unquantized GLM MTP layer, and partial agreement by design.

Building is fast (well under a second each) and reads only safetensors headers; the tests that
load a model are marked slow."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from click.testing import CliRunner

from macspec.cli import main
from macspec.models.replicas import REPLICAS
from macspec.models import built
from macspec.models.loader import find_local_model, resolve_path
from macspec.models.store import safetensors_header

# The keys of the real checkpoints' config.json (values aside). Kimi K2.5 (moonshotai/Kimi-K2.5,
# as mlx-community converts it) without its vision tower (vision_config, video_placeholder) and
# remote-code map (auto_map), which the replica does not carry.
KIMI_KEYS = {
    "architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "ignore_index", "media_placeholder_token_id", "tie_word_embeddings", "torch_dtype",
    "use_unified_vision_chunk", "text_config", "quantization", "quantization_config",
}
DEEPSEEK_V3_KEYS = {  # Kimi K2.5's text_config, Moonlight-16B-A3B: DeepSeek-V3's config.json
    "architectures", "model_type", "attention_bias", "attention_dropout", "aux_loss_alpha",
    "bos_token_id", "eos_token_id", "ep_size", "first_k_dense_replace", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank",
    "max_position_embeddings", "moe_intermediate_size", "moe_layer_freq", "n_group",
    "n_routed_experts", "n_shared_experts", "norm_topk_prob", "num_attention_heads",
    "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads",
    "num_nextn_predict_layers", "pretraining_tp", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "rms_norm_eps", "rope_scaling", "rope_theta", "routed_scaling_factor",
    "scoring_func", "seq_aux", "tie_word_embeddings", "topk_group", "topk_method", "torch_dtype",
    "use_cache", "v_head_dim", "vocab_size",
}
GLM5_KEYS = {  # zai-org/GLM-5 (mlx-community/GLM-5-4bit adds the quantization entries)
    "architectures", "model_type", "attention_bias", "attention_dropout", "dtype", "eos_token_id",
    "ep_size", "first_k_dense_replace", "head_dim", "hidden_act", "hidden_size",
    "index_head_dim", "index_n_heads", "index_topk", "indexer_rope_interleave",
    "initializer_range", "intermediate_size", "kv_lora_rank", "max_position_embeddings",
    "moe_intermediate_size", "moe_layer_freq", "n_group", "n_routed_experts", "n_shared_experts",
    "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
    "num_key_value_heads", "num_nextn_predict_layers", "pad_token_id", "pretraining_tp",
    "q_lora_rank", "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps",
    "rope_interleave", "rope_parameters", "routed_scaling_factor", "scoring_func",
    "tie_word_embeddings", "topk_group", "topk_method", "use_cache", "v_head_dim", "vocab_size",
    "quantization", "quantization_config",
}
# Derived by mlx-lm's glm_moe_dsa ModelArgs.__post_init__ from rope_parameters, not config keys.
GLM5_DERIVED = {"rope_scaling", "rope_theta"}
# The projections mlx-community quantizes (Linear, Embedding, SwitchLinear, MultiLinear).
QUANTIZED = ("embed_tokens", "lm_head", "q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
             "embed_q", "unembed_out", "o_proj", "gate_proj", "up_proj", "down_proj", "wq_b",
             "wk", "weights_proj")
PROMPTS = ["def parse(text):\n    return", "import os\n\nclass Config:\n    def __init__(self",
           "for i, line in enumerate(lines):\n    if", "The quick brown fox jumps over"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replicas")
    return {name: built.build_replica(name, root / name) for name in REPLICAS}


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def header(path: Path, file: str = "model.safetensors") -> dict:
    return {k: v for k, v in safetensors_header(path / file).items() if k != "__metadata__"}


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.is_file()}


def mlx_lm_fields(config: dict) -> set[str]:
    from mlx_lm.utils import _get_classes

    return {f.name for f in dataclasses.fields(_get_classes(config)[1])}


def test_configs_have_the_real_checkpoints_keys(replicas):
    kimi, moon, glm = (config_of(replicas[n]) for n in ("kimi-k25-mini", "moonlight-mini", "glm5-mini"))
    assert kimi["model_type"] == "kimi_k25" and kimi.keys() >= KIMI_KEYS
    assert kimi["text_config"]["model_type"] == "deepseek_v3"
    assert kimi["text_config"].keys() >= DEEPSEEK_V3_KEYS
    assert moon["model_type"] == "deepseek_v3" and moon.keys() >= DEEPSEEK_V3_KEYS
    assert glm["model_type"] == "glm_moe_dsa" and glm.keys() >= GLM5_KEYS
    # Every field mlx-lm's model reads is set, none left to a silent default.
    from mlx_lm.models.deepseek_v3 import ModelArgs as DeepseekV3Args

    deepseek_fields = {f.name for f in dataclasses.fields(DeepseekV3Args)}
    assert kimi["text_config"].keys() >= deepseek_fields and moon.keys() >= deepseek_fields
    assert glm.keys() >= mlx_lm_fields(glm) - GLM5_DERIVED
    assert mlx_lm_fields(kimi) <= kimi.keys()


def test_architectures_as_the_seed_models(replicas):
    text = config_of(replicas["kimi-k25-mini"])["text_config"]
    assert text["q_lora_rank"] and text["kv_lora_rank"] and text["rope_scaling"]["type"] == "yarn"
    assert (text["scoring_func"], text["topk_method"]) == ("sigmoid", "noaux_tc")
    assert 0 < text["first_k_dense_replace"] < text["num_hidden_layers"]
    assert text["n_shared_experts"] >= 1 and text["num_experts_per_tok"] < text["n_routed_experts"]
    moon = config_of(replicas["moonlight-mini"])
    assert moon["q_lora_rank"] is None  # Moonlight: a plain q_proj
    assert moon["num_hidden_layers"] < text["num_hidden_layers"]
    glm = config_of(replicas["glm5-mini"])
    assert glm["num_nextn_predict_layers"] == 1
    assert glm["index_topk"] < 64  # the DSA indexer selects within a short prompt


def test_weights_laid_out_and_quantized_as_mlx_community_ships_them(replicas):
    for name, group in (("kimi-k25-mini", 32), ("moonlight-mini", 32), ("glm5-mini", 64)):
        path = replicas[name]
        config = config_of(path)
        assert config["quantization"] == {"group_size": group, "bits": 4, "mode": "affine"}
        assert config["quantization_config"] == config["quantization"]
        tensors = header(path)
        weights = [k for k in tensors if k.endswith(".weight") and k.rsplit(".", 2)[-2] in QUANTIZED]
        assert weights
        for key in weights:
            assert tensors[key]["dtype"] == "U32", key
            assert key[: -len("weight")] + "scales" in tensors, key
        # Router weights and the correction bias stay unquantized, as in the real checkpoints.
        gates = [k for k in tensors if k.endswith("mlp.gate.weight")]
        assert gates and all(tensors[k]["dtype"] in ("F32", "BF16") for k in gates)
        assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in tensors)
        assert any(".switch_mlp." in k for k in tensors) and any(".shared_experts." in k for k in tensors)
    kimi = header(replicas["kimi-k25-mini"])
    assert all(k.startswith("language_model.") for k in kimi)  # the nested layout
    assert "language_model.model.layers.0.mlp.down_proj.weight" in kimi  # first_k_dense_replace
    assert "language_model.model.layers.1.mlp.switch_mlp.down_proj.weight" in kimi
    assert "language_model.model.layers.0.self_attn.q_a_proj.weight" in kimi
    moon = header(replicas["moonlight-mini"])
    assert "model.layers.0.self_attn.q_proj.weight" in moon
    assert not any(".q_a_proj." in k for k in moon)
    glm = header(replicas["glm5-mini"])
    assert "model.layers.1.self_attn.indexer.wq_b.weight" in glm


def test_glm_mtp_layer_is_separate_and_unquantized(replicas):
    path = replicas["glm5-mini"]
    layer = config_of(path)["num_hidden_layers"]
    assert not any(k.startswith(f"model.layers.{layer}.") for k in header(path))
    mtp = header(path, "mtp.safetensors")
    assert mtp and all(k.startswith(f"model.layers.{layer}.") for k in mtp)
    assert {f"model.layers.{layer}.{k}.weight" for k in ("enorm", "hnorm", "eh_proj",
                                                         "shared_head.norm")} <= mtp.keys()
    assert f"model.layers.{layer}.self_attn.indexer.wq_b.weight" in mtp
    assert f"model.layers.{layer}.mlp.switch_mlp.down_proj.weight" in mtp
    assert not any(k.endswith((".scales", ".biases")) for k in mtp)
    assert {info["dtype"] for info in mtp.values()} == {"BF16"}


def test_one_tokenizer_for_every_replica_and_vocab_matches_the_embeddings(replicas):
    files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    kimi, moon = replicas["kimi-k25-mini"], replicas["moonlight-mini"]
    for file in files:
        assert (kimi / file).read_bytes() == (moon / file).read_bytes()
        assert (kimi / file).read_bytes() == (replicas["glm5-mini"] / file).read_bytes()
    vocab = len(json.loads((kimi / "tokenizer.json").read_text())["model"]["vocab"])
    for name, path in replicas.items():
        config = config_of(path)
        config = config.get("text_config", config)
        prefix = "language_model." if name == "kimi-k25-mini" else ""
        tensors = header(path)
        assert config["vocab_size"] == vocab
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            assert tensors[prefix + key]["shape"][0] == vocab


def test_built_names_build_once_into_the_cache(isolated_home):
    assert find_local_model("built:moonlight-mini") is None
    path = resolve_path("built:moonlight-mini")
    assert path == isolated_home / "cache" / "models" / "moonlight-mini"
    stamp = json.loads((path / built.STAMP).read_text())
    assert stamp["recipe"] == "moonlight-mini"
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_path("built:moonlight-mini") == path == find_local_model("built:moonlight-mini")
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    result = CliRunner().invoke(main, ["forge", "nope-mini"])
    assert result.exit_code == 2 and "glm5-mini" in result.output  # a usage error, listing targets


def test_forge_cli_writes_a_replica(tmp_path):
    out = tmp_path / "glm"
    result = CliRunner().invoke(main, ["forge", "glm5-mini", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0 and f"in {out}" in result.output
    assert {"config.json", "model.safetensors", "mtp.safetensors", "tokenizer.json",
            built.STAMP} <= {p.name for p in out.iterdir()}


@pytest.mark.slow
def test_builds_are_deterministic(replicas, tmp_path):
    for name in REPLICAS:
        again = built.build_replica(name, tmp_path / name)
        assert digest(again) == digest(replicas[name]), name


@pytest.mark.slow
def test_replicas_load_in_plain_mlx_lm_with_finite_logits(replicas):
    from mlx_lm import load as mlx_load

    for name, path in replicas.items():
        model, tokenizer = mlx_load(str(path))
        tokens = mx.array([tokenizer.encode(PROMPTS[0])])
        logits = model(tokens)
        assert logits.shape == (1, tokens.shape[1], 4096), name
        assert mx.isfinite(logits).all().item(), name
        # A prompt longer than the GLM indexer's top-k: the sparse attention path.
        long = mx.array([tokenizer.encode(" ".join(PROMPTS) * 3)])
        assert mx.isfinite(model(long)).all().item(), name


@pytest.mark.slow
def test_draft_and_target_share_the_tokenizer_as_macspec_checks_it(replicas):
    from mlx_lm.utils import load_tokenizer

    from macspec.models.compat import tokenizer_mismatch

    target = load_tokenizer(replicas["kimi-k25-mini"])
    assert tokenizer_mismatch(target, load_tokenizer(replicas["moonlight-mini"])) is None
    assert target.chat_template  # the seed profiles apply the chat template


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache, x, out = make_prompt_cache(model), mx.array([prompt]), []
    for _ in range(steps):
        x = model(x, cache=cache)[:, -1].argmax(-1)[None]
        out.append(x.item())
    return out


@pytest.mark.slow
def test_draft_and_mtp_agree_with_their_target_partially(replicas):
    """Top-1 agreement on the target's own greedy continuations (the per-token chance a greedy
    proposal is accepted): neither ~0 (a useless proposer) nor ~1 (the reject path never runs)."""
    from macspec.models.checkpoint import load_mtp_head
    from macspec.models.loader import load_model
    from macspec.models.view import ModelView

    target = load_model(str(replicas["kimi-k25-mini"]))
    draft = load_model(str(replicas["moonlight-mini"]))
    glm = load_model(str(replicas["glm5-mini"]))
    head, view = load_mtp_head(glm), ModelView(glm.model)
    assert not any(k.endswith(".scales") for k, _ in tree_flatten(head.parameters()))  # not quantized
    draft_agree, mtp_agree, distinct = [], [], []
    for text in PROMPTS:
        prompt = target.tokenizer.encode(text)
        seq = mx.array([prompt + _greedy(target.model, prompt, 24)])
        same = target.model(seq).argmax(-1) == draft.model(seq).argmax(-1)
        draft_agree.append(same[0, len(prompt):].astype(mx.float32).mean().item())
        distinct.append(len(set(seq[0, len(prompt):].tolist())))

        seq = mx.array([prompt + _greedy(glm.model, prompt, 24)])
        logits, hidden = view.forward(seq)
        mtp_logits, _ = head(seq[:, 1:], hidden[:, :-1], view)  # position t predicts t+2
        same = mtp_logits.argmax(-1)[0, len(prompt) - 1:] == logits.argmax(-1)[0, len(prompt):]
        mtp_agree.append(same.astype(mx.float32).mean().item())
    draft_mean, mtp_mean = sum(draft_agree) / len(PROMPTS), sum(mtp_agree) / len(PROMPTS)
    assert 0.5 <= draft_mean <= 0.97, draft_agree
    assert 0.4 <= mtp_mean <= 0.95, mtp_agree
    assert min(distinct) >= 12, distinct  # the target does not loop on one token
