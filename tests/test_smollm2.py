"""SmolLM2's shipped heads (`macspec forge smollm2-mtp`, `smollm2-eagle3`, `smollm2-dflash`): small,
attached by the pull, lossless.

The head predicts over a subset of the vocabulary (shared_head.vocab_ids) and takes those output
rows from the target; a tiny random llama checks that path exactly, the real model (through the
same pull path as test_gguf.py, in the user's cache) checks speculation equals plain decoding.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import pytest

from macspec.config import Profile, load_profile
from macspec.engine.runtime import Runtime
from macspec.models import pulled
from macspec.models.checkpoint import load_mtp_head
from macspec.models.loader import load_model
from macspec.models.store import safetensors_header
from macspec.models.mtp import MTPHead, make_block_like
from macspec.sampling import SamplingParams

from .conftest import generate
from .modeldirs import build_model, save_model, tiny_llama_config, write_word_tokenizer
from .test_eagle3 import PUBLISHED_KEYS
from .test_gguf import PROMPTS, smollm2  # noqa: F401  (the session fixture: the pulled dir)

MAX_HEAD_BYTES = 20 * 2**20
LAYER = 30  # SmolLM2-135M's num_hidden_layers: the MTP layer's index


def test_shipped_head_is_small_and_is_what_the_pull_attaches():
    path = pulled.head_file("smollm2")
    assert path.is_file() and path.stat().st_size <= MAX_HEAD_BYTES
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert pulled._stamp("smollm2")["head"] == digest
    header = {k: v for k, v in safetensors_header(path).items() if k != "__metadata__"}
    prefix = f"model.layers.{LAYER}."
    assert all(k.startswith(prefix) for k in header)
    assert header[f"{prefix}shared_head.vocab_ids"]["dtype"] == "I32"
    assert f"{prefix}shared_head.head.weight" not in header  # the target's rows, not stored
    assert {f"{prefix}eh_proj.weight", f"{prefix}self_attn.q_proj.weight", f"{prefix}mlp.up_proj.weight"} <= set(header)
    assert {v["dtype"] for k, v in header.items() if "vocab_ids" not in k} == {"BF16"}


@pytest.mark.slow
def test_a_subset_head_takes_the_targets_rows_and_stays_lossless(tmp_path):
    config = tiny_llama_config(vocab=64, hidden=32)
    model = build_model(config, seed=0)
    ids = mx.array(list(range(0, 64, 2)), dtype=mx.int32)  # even ids only
    head = MTPHead(make_block_like(model, 2), 32, 1e-5, vocab_ids=ids, target_vocab=64)
    weights = {k: v for k, v in head.layout_weights(2).items() if ".shared_head.head." not in k}
    out = save_model(model, config, tmp_path / "m")
    mx.save_safetensors(str(out / "mtp.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    write_word_tokenizer(out, [f"w{i}" for i in range(64)])

    target = load_model(str(out))
    loaded = load_mtp_head(target)
    embed = target.model.model.embed_tokens.weight
    assert mx.array_equal(loaded.shared_head.head.weight, embed[ids])
    tokens, hidden = mx.array([[1, 2, 3]]), mx.random.normal((1, 3, 32))
    from macspec.models.view import ModelView

    logits, _ = loaded(tokens, hidden, ModelView(target.model))
    assert logits.shape == (1, 3, 64)
    assert mx.all(mx.isinf(logits[..., 1::2])).item() and not mx.any(mx.isinf(logits[..., ::2])).item()

    runtime_plain = Runtime(Profile(), target, "none")
    runtime_mtp = Runtime(Profile(), target, "mtp", mtp_head=loaded)
    for params in (SamplingParams(), SamplingParams(repetition_penalty=1.3)):
        plain, _ = generate(runtime_plain, [5, 6, 7], 20, params)
        spec, done = generate(runtime_mtp, [5, 6, 7], 20, params, k=3)
        assert spec == plain and done.stats["spec"]["drafted"] > 0


@pytest.fixture(scope="module")
def smollm2_runtimes(smollm2):  # noqa: F811
    """method -> the profile with that head (the pull attached both) and plain on the same target."""
    made = {}

    def make(method: str) -> tuple[Runtime, Runtime]:
        if method not in made:
            profile = load_profile("smollm2")
            profile.speculative.method = method
            profile.model.path = str(smollm2[0])  # the user's cache, not the per-test home
            runtime = Runtime.load(profile)
            made[method] = runtime, Runtime(profile, runtime.target, "none")
        return made[method]

    return make


@pytest.mark.slow
def test_the_pulled_dir_carries_the_shipped_head(smollm2):  # noqa: F811
    model_dir = smollm2[0]
    assert json.loads((model_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert (model_dir / "mtp.safetensors").read_bytes() == pulled.head_file("smollm2").read_bytes()


MIN_ACCEPTED_PER_STEP = {"mtp": 0.1, "eagle3": 0.2, "dflash": 0.1}


@pytest.mark.slow
@pytest.mark.parametrize("method, k", [("mtp", 1), ("mtp", 3), ("eagle3", 1), ("eagle3", 3), ("dflash", 3)])
def test_greedy_equals_plain_on_smollm2(smollm2_runtimes, method, k):
    runtime, plain_runtime = smollm2_runtimes(method)
    params = SamplingParams.from_config(runtime.profile.sampling)  # repetition penalty 1.1
    accepted = drafted = steps = 0
    for prompt in PROMPTS[:3]:
        ids = list(runtime.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                         add_generation_prompt=True))
        plain, _ = generate(plain_runtime, ids, 48, params)
        spec, done = generate(runtime, ids, 48, params, k=k)
        assert spec == plain, prompt
        accepted += done.stats["spec"]["accepted"]
        drafted += done.stats["spec"]["drafted"]
        steps += done.stats["spec"]["speculative_steps"]
    # Trained heads draft real tokens (a random one accepts ~0): held out, ~0.4 per step at k = 1
    # (benchmarks/smollm2_head.py); these 3 prompts alone are lower (MTP at k = 1: 0.19).
    assert drafted and accepted >= 5 and accepted / drafted > 0.05
    assert accepted / steps > MIN_ACCEPTED_PER_STEP[method]


def test_shipped_eagle3_head_is_small_published_and_what_the_pull_attaches():
    path = pulled.beside_dir("smollm2", "eagle3")
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= MAX_HEAD_BYTES
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 8192 and config["vocab_size"] == 49152
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    header = {k: v for k, v in safetensors_header(weights).items() if k != "__metadata__"}
    assert set(header) == PUBLISHED_KEYS
    assert header["d2t"]["dtype"] == "I64" and header["d2t"]["shape"] == [8192]
    assert {v["dtype"] for k, v in header.items() if k not in ("d2t", "t2d")} == {"BF16"}
    assert pulled._stamp("smollm2")["eagle3_head"] == pulled.beside_digest("smollm2", "eagle3")


@pytest.mark.slow
def test_the_pulled_dir_carries_the_eagle3_head(smollm2):  # noqa: F811
    attached = smollm2[0] / "eagle3" / "model.safetensors"
    assert attached.read_bytes() == (pulled.beside_dir("smollm2", "eagle3") / "model.safetensors").read_bytes()




def test_shipped_dflash_drafter_is_small_over_a_draft_vocabulary_and_what_the_pull_attaches():
    path = pulled.beside_dir("smollm2", "dflash")
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= MAX_HEAD_BYTES
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["vocab_size"] == 49152
    assert config["draft_vocab_size"] == 8192 and config["dflash_config"]["target_layer_ids"] == [1, 14, 26]
    header = safetensors_header(weights)
    assert header["d2t"]["shape"] == [8192]
    ids = (mx.arange(8192) + mx.load(str(weights))["d2t"]).tolist()  # picked as the EAGLE-3 head's are
    assert len(set(ids)) == 8192 and 0 <= min(ids) and max(ids) < 49152
    assert pulled._stamp("smollm2")["dflash_head"] == pulled.beside_digest("smollm2", "dflash")
