"""EAGLE-3 heads: the published layout loads through a profile as a downloaded head would, a head
that does not fit the target is refused naming what does not match, the target's layers are
captured in the verifying forward, and training's unrolled steps are inference's chain."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from macspec.config import load_profile
from macspec.engine.runtime import Runtime
from macspec.errors import ModelLoadError
from macspec.forge import eagle3 as forge_eagle3
from macspec.models.eagle3 import Eagle3Config, Eagle3Head, save_head
from macspec.models.view import ModelView, tap_layers
from macspec.sampling import SamplingParams

from .conftest import generate, tiny_runtime

pytestmark = pytest.mark.slow  # loads a model

PUBLISHED_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d"}


def tiny_head(target, draft_vocab: int = 1024, layers=(0, 2, 5), seed: int = 0) -> Eagle3Head:
    args = target.args
    config = Eagle3Config(
        hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        head_dim=args.hidden_size // args.num_attention_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=2048, vocab_size=args.vocab_size,
        draft_vocab_size=draft_vocab, target_hidden_size=args.hidden_size, aux_outputs=layers)
    mx.random.seed(seed)
    head = Eagle3Head(config)
    ids = np.sort(np.random.default_rng(seed).choice(args.vocab_size, draft_vocab, replace=False))
    head.set_vocab_map(mx.array(ids), args.vocab_size)
    return head


def profile_with(head_dir, method: str = "eagle3"):
    profile = load_profile("tiny")
    profile.speculative.method = method
    profile.speculative.eagle3_head = str(head_dir)
    return profile


def test_a_head_in_the_published_layout_loads_through_the_profile(tmp_path):
    target = tiny_runtime("none").target.model
    save_head(tiny_head(target), tmp_path)
    assert set(mx.load(str(tmp_path / "model.safetensors"))) == PUBLISHED_KEYS
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 1024
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]

    runtime = Runtime.load(profile_with(tmp_path))
    head = runtime.eagle3_head
    assert head.target_ids.shape == (1024,) and not head.identity_vocab
    prompt = runtime.tokenizer.encode("def parse(text):\n    ")
    plain, _ = generate(tiny_runtime("none"), prompt, 24, SamplingParams())
    for k in (1, 3):
        tokens, gen = generate(runtime, prompt, 24, SamplingParams(), k=k)
        assert tokens == plain
        assert gen.stats["spec"]["drafted"] > 0


def test_vllm_layer_ids_name_inputs_and_sglang_ids_name_outputs():
    base = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8, "intermediate_size": 16,
            "num_attention_heads": 2, "vocab_size": 32}
    sglang = Eagle3Config.from_dict({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}, "x")
    vllm = Eagle3Config.from_dict({**base, "eagle_aux_hidden_state_layer_ids": [2, 6, 10]}, "x")
    default = Eagle3Config.from_dict(base, "x")
    assert sglang.target_layers(32) == vllm.target_layers(32) == (1, 5, 9)
    assert default.target_layers(32) == (1, 15, 28)  # the inputs of layers 2, 16, 29
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 head"):
        Eagle3Config.from_dict({**base, "architectures": ["LlamaForCausalLM"]}, "x")


def _broken(tmp_path, target, edit):
    head = tiny_head(target)
    save_head(head, tmp_path)
    weights = dict(mx.load(str(tmp_path / "model.safetensors")))
    config = json.loads((tmp_path / "config.json").read_text())
    edit(weights, config)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return profile_with(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda w, c: c.update(target_hidden_size=512), "hidden states of width 512"),
    (lambda w, c: c.update(vocab_size=50000), "vocab_size is 50000"),
    (lambda w, c: w.update(d2t=w["d2t"] + 4000), "outside the target's vocabulary"),
    (lambda w, c: w.update({"fc.weight": w["fc.weight"][:, :100]}), "wrong shapes: fc.weight"),
    (lambda w, c: w.pop("midlayer.mlp.up_proj.weight"), "missing weights midlayer.mlp.up_proj.weight"),
    (lambda w, c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 40]), "target layers"),
], ids=["another-target", "vocabulary", "d2t-range", "shape", "missing", "layers"])
def test_a_head_that_does_not_fit_is_refused_naming_the_mismatch(tmp_path, edit, message):
    target = tiny_runtime("none").target.model
    profile = _broken(tmp_path, target, edit)
    with pytest.raises(ModelLoadError, match=message):
        Runtime.load(profile)


def test_no_head_named_and_none_shipped_says_what_to_set(tmp_path):
    from macspec.models.store import embedded_dir
    for file in (embedded_dir() / "tiny-target").iterdir():  # the target without its shipped head
        if file.is_file():
            (tmp_path / file.name).symlink_to(file)
    profile = profile_with("", method="eagle3")
    profile.model.path = str(tmp_path)
    with pytest.raises(ModelLoadError, match="speculative.eagle3_head"):
        Runtime.load(profile)


def test_a_request_loading_eagle3_mid_flight_keeps_other_rows_lossless():
    """Its taps widen the target's states while an MTP row is decoding: that row keeps its width."""
    from macspec.engine.engine import Engine
    from macspec.engine.request import GenerationRequest, Tokens
    engine = Engine(Runtime.load(load_profile("tiny")), max_batch=4)  # MTP; EAGLE-3 on demand
    prompt = [814, 3367, 202, 814, 3093, 202, 17, 99, 240]
    out = {}

    def submit(method):
        tokens = out.setdefault(method, [])
        sink = lambda e: tokens.extend(e.ids) if isinstance(e, Tokens) else None  # noqa: E731
        engine.add_request(GenerationRequest(prompt=list(prompt), params=SamplingParams(), max_tokens=40,
                                             sink=sink, method=method, num_draft=3, adaptive=False))

    submit("mtp")
    for _ in range(3):
        engine.step()
    submit("eagle3")
    submit("none")
    while engine.has_work:
        engine.step()
    assert len(out["none"]) == 40
    assert out["mtp"] == out["none"] == out["eagle3"]


def test_tapped_layers_are_the_layer_outputs_of_the_same_forward():
    runtime = Runtime.load(load_profile("tiny"))  # its own target: tapping changes the model
    model = runtime.target.model
    tap_layers(model, (0, 2, 5))
    view = ModelView(model)
    tokens = mx.array([[5, 17, 99, 240, 31, 7]])
    logits, states = view.forward(tokens)
    x = view.inner.embed_tokens(tokens)
    mask = create_attention_mask(x, None)
    outputs = []
    for index, layer in enumerate(view.inner.layers):
        x = layer(x, mask, None)
        outputs.append(x)
    width = x.shape[-1]
    assert states.shape[-1] == 4 * width == view.states_width
    assert mx.allclose(states[..., width:], mx.concatenate([outputs[i] for i in (0, 2, 5)], -1), atol=1e-5)
    assert mx.allclose(logits, model(tokens), atol=1e-4)


def test_training_time_test_unrolls_the_chain_inference_runs():
    """Step j of the unrolled training forward at origin t equals inference: the true states up
    to t fed to the head's cache, then j chained steps on its own output state."""
    runtime = Runtime.load(load_profile("tiny"))
    model = runtime.target.model
    layers = (1, 3, 4)
    tap_layers(model, layers)
    view = ModelView(model)
    head = forge_eagle3.init_head(model, np.arange(0, 4096, 3), layers, seed=0)
    tokens = mx.array([[5, 17, 99, 240, 31, 7, 64, 12, 300, 45, 11, 8]])
    hidden = view.hidden(tokens)
    fused = view.states(hidden)[..., hidden.shape[-1]:]
    unroll, origin = 3, 4
    trained = forge_eagle3.unrolled(head, view, tokens, fused, unroll)
    cache = KVCache()
    logits, out = head.forward(tokens[:, 1:origin + 2], fused[:, :origin + 1], view, cache)
    assert mx.allclose(logits[0, origin], trained[0][0, origin], atol=1e-4)
    state = out[:, -1:]
    for j in range(1, unroll):
        logits, state = head.forward(tokens[:, origin + 1 + j:origin + 2 + j], state, view, cache)
        assert mx.allclose(logits[0, 0], trained[j][0, origin], atol=1e-4)


def head_for(view, draft_vocab: int, seed: int = 0) -> Eagle3Head:
    """A random head shaped for any target view (its hidden width, vocabulary and layers)."""
    hidden = int(view.inner.norm.weight.shape[0])
    vocab = int(view.inner.embed_tokens.weight.shape[0])
    layers = len(view.inner.layers)
    config = Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=4096, vocab_size=vocab,
        draft_vocab_size=draft_vocab, target_hidden_size=hidden,
        aux_outputs=(0, layers // 2, layers - 1))
    mx.random.seed(seed)
    head = Eagle3Head(config)
    ids = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
    head.set_vocab_map(mx.array(ids), vocab)
    return head


@pytest.mark.parametrize("profile_name, target", [
    ("kimi-tp2-mini", None), ("kimi-tp2-mini", "built:moonlight-mini"), ("glm5-mtp-mini", None)],
    ids=["kimi_k25", "deepseek_v3", "glm_moe_dsa"])
def test_seed_architectures_take_an_eagle3_head_losslessly(tmp_path, profile_name, target):
    """The layers are tapped on MLA + MoE targets too (a kimi_k25 wrapper, deepseek_v3, GLM-5's
    DSA indexer): batched greedy output with the head equals plain, at k = 1 and 3."""
    base = load_profile(profile_name)
    if target:
        base.model.path = target
    base.speculative.method = "none"
    plain_runtime = Runtime.load(base)
    save_head(head_for(plain_runtime.view, 512), tmp_path)
    base.speculative.method = "eagle3"
    base.speculative.eagle3_head = str(tmp_path)
    runtime = Runtime.load(base)
    assert runtime.view.states_width == 4 * int(runtime.view.inner.norm.weight.shape[0])
    tok = runtime.tokenizer
    prompts = [tok.encode(text) for text in ("The history of", "def main():\n", "Once upon a time")]
    from .conftest import engine_for

    plain = [c.tokens for c in engine_for(plain_runtime).generate(prompts, SamplingParams(), 16, method="none")]
    for k in (1, 3):
        done = engine_for(runtime).generate(prompts, SamplingParams(), 16, method="eagle3", num_draft=k,
                                            adaptive=False)
        assert [c.tokens for c in done] == plain
        assert sum(c.stats["spec"]["drafted"] for c in done) > 0


def test_doctor_checks_the_head_without_loading_it(tmp_path):
    """OK with the head the tiny target ships; a head for another target fails, naming why."""
    import subprocess
    import sys

    def doctor(profile_text: str) -> dict:
        path = tmp_path / "p.toml"
        path.write_text(profile_text)
        out = subprocess.run([sys.executable, "-m", "macspec", "doctor", "--profile", str(path), "--json"],
                             capture_output=True, text=True, timeout=120)
        return {c["name"]: c for c in json.loads(out.stdout)["checks"]}

    base = 'name = "p"\n[model]\npath = "embedded:tiny-target"\n[speculative]\nmethod = "eagle3"\n'
    shipped = doctor(base)["EAGLE-3 head"]
    assert shipped["status"] == "ok" and "reads layers [1, 3, 4] of 6" in shipped["detail"]
    other = tmp_path / "other"
    save_head(tiny_head(tiny_runtime("none").target.model), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "target_hidden_size": 512}))
    wrong = doctor(base + f'eagle3_head = "{other}"\n')["EAGLE-3 head"]
    assert wrong["status"] == "fail" and "hidden states of width 512" in wrong["detail"]
