"""The seed profiles' own architectures end to end, offline: `kimi-tp2-mini` (a kimi_k25 replica
wrapping deepseek_v3 MLA + MoE, 4-bit, with a Moonlight-style deepseek_v3 draft, TP=2 over
ring) and `glm5-mtp-mini` (glm_moe_dsa with its DSA indexer and an unquantized MTP layer),
through the engine and the daemon that users run."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from macspec.config import find_profile
from macspec.errors import IncompatibleDraftError
from macspec.models.compat import check_draft_compatible
from macspec.models.loader import load_model
from macspec.monitor.memory import kv_bytes_per_token
from macspec.sampling import SamplingParams

from .conftest import engine_for, heldout_prompts
from .serverutil import RunningServer, runtime_with
from .tputil import TPServer

pytestmark = pytest.mark.slow

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def kimi():
    return runtime_with("kimi-tp2-mini")


@pytest.fixture(scope="module")
def glm():
    return runtime_with("glm5-mtp-mini")


@pytest.fixture(scope="module")
def texts(kimi):
    return [kimi.tokenizer.decode(p) for p in heldout_prompts(kimi.tokenizer, 8)]


def _plain(engine, prompts, max_tokens):
    return [c.tokens for c in engine.generate(prompts, GREEDY, max_tokens, method="none")]


def test_the_replicas_are_the_seed_architectures(kimi, glm):
    assert kimi.target.config["model_type"] == "kimi_k25" and kimi.target.config["kv_lora_rank"]
    assert kimi.draft.config["model_type"] == "deepseek_v3"
    assert glm.target.config["model_type"] == "glm_moe_dsa" and glm.mtp_head is not None
    assert not any(k.endswith(".scales") for k, _ in _flat(glm.mtp_head.parameters()))


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_kimi_draft_is_lossless_and_partially_accepted(kimi, k):
    engine = engine_for(kimi)
    prompts = heldout_prompts(kimi.tokenizer, 4)
    plain = _plain(engine, prompts, 48)
    done = engine.generate(prompts, GREEDY, 48, num_draft=k, adaptive=False)  # 4 rows batched
    assert [c.tokens for c in done] == plain
    drafted = sum(c.stats["spec"]["drafted"] for c in done)
    accepted = sum(c.stats["spec"]["accepted"] for c in done)
    assert drafted > 0 and 0.3 < accepted / drafted < 0.95, (k, accepted, drafted)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_glm_mtp_acceptance_and_lossless(glm, temperature):
    engine = engine_for(glm)
    prompts = heldout_prompts(glm.tokenizer, 4)
    params = SamplingParams(temperature=temperature, seed=3)
    done = engine.generate(prompts, params, 48, method="mtp", num_draft=3, adaptive=False)
    drafted = sum(c.stats["spec"]["drafted"] for c in done)
    accepted = sum(c.stats["spec"]["accepted"] for c in done)
    assert drafted > 0 and accepted / drafted > 0.3, (accepted, drafted)
    if temperature == 0:
        assert [c.tokens for c in done] == _plain(engine, prompts, 48)
    assert engine.speculator.faults.as_dict()["total"] == 0  # no silent fallback to plain decoding


def test_glm_mtp_after_a_prefix_cache_hit_keeps_its_acceptance(glm):
    """The head needs the target's states for the whole prompt; a prefix-cache hit must not
    cut its context (acceptance fell from 0.26 to 0.01 when it did). The entry carries the
    states, so the repeated prompt is not prefilled again (TTFT was 321 ms against 140 without
    the head on SmolLM2, when MTP rows skipped the prefix cache)."""
    engine = engine_for(glm)
    prompt = heldout_prompts(glm.tokenizer, 1)[0]
    first = engine.generate([prompt], GREEDY, 32, method="mtp", num_draft=3, adaptive=False)[0]
    again = engine.generate([prompt], GREEDY, 32, method="mtp", num_draft=3, adaptive=False)[0]
    assert again.stats["cached_prompt_tokens"] == len(prompt) - 1
    assert again.tokens == first.tokens
    assert again.stats["acceptance_rate"] == pytest.approx(first.stats["acceptance_rate"], abs=0.02)


@pytest.mark.parametrize("runtime_name", ["kimi", "glm"])
def test_kv_estimate_matches_the_bytes_the_caches_hold(request, runtime_name):
    runtime = request.getfixturevalue(runtime_name)
    engine = engine_for(runtime)
    prompt = heldout_prompts(runtime.tokenizer, 1)[0][:64]
    runner = engine.runner
    runner.open_slot(-7, -1, 0)
    try:
        runner.prefill(-7, prompt)
        actual = runner.slot_nbytes(-7, len(prompt)) / len(prompt)
    finally:
        runner.close_slot(-7, -1, 0)
    dtype_bytes = runtime.target.model.model.norm.weight.dtype.size
    estimate = kv_bytes_per_token(runtime.target.config, dtype_bytes)
    assert abs(estimate - actual) <= 0.1 * actual, (estimate, actual)


@pytest.mark.parametrize("profile", ["kimi-tp2-mini", "glm5-mtp-mini"])
def test_doctor_passes_the_mini_profiles(profile):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "macspec", "doctor", "--profile", profile],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout


def test_tokenizer_check_accepts_the_pair_and_names_a_differing_token(kimi, tmp_path):
    check_draft_compatible(kimi.tokenizer, kimi.draft.tokenizer, "kimi", "moonlight")
    from .modeldirs import tiny_llama_config, save_model, build_model, write_word_tokenizer

    other = tmp_path / "other"
    other.mkdir()
    words = [f"w{i}" for i in range(64)]
    write_word_tokenizer(other, words)
    config = tiny_llama_config(len(words))
    save_model(build_model(config, 0), config, other)
    with pytest.raises(IncompatibleDraftError) as err:
        check_draft_compatible(kimi.tokenizer, load_model(str(other)).tokenizer, "kimi", "other")
    message = str(err.value)
    assert "differing entries, e.g." in message and "->0" in message, message  # the first one named


# ---- tensor parallelism through the daemon ---------------------------------------------


@pytest.fixture(scope="module")
def kimi_tp(tmp_path_factory, kimi):
    """kimi-tp2-mini over two ranks, with a DFlash drafter made for it (random weights) beside
    its draft model."""
    from macspec.models.dflash import random_drafter

    home = tmp_path_factory.mktemp("kimi-tp")
    drafter = random_drafter(home / "dflash", kimi.target.config, block_size=4)
    profile = home / "kimi-tp2-mini.toml"
    profile.write_text(Path(find_profile("kimi-tp2-mini")).read_text().replace(
        "[speculative]\n", f'[speculative]\ndflash_drafter = "{drafter}"\n'))
    server = TPServer(str(profile), home)
    yield server
    assert server.stop() == 0, server.log.read_text()[-2000:]
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def kimi_single(kimi):
    with RunningServer(kimi, max_batch=8) as server:
        yield server


def _complete(url: str, prompt: str, method: str, k: int, max_tokens: int = 48) -> tuple[str, float, dict]:
    t0 = time.perf_counter()
    reply = requests.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "speculative": {"method": method, "num_draft_tokens": k, "adaptive": False}})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["text"], time.perf_counter() - t0, data["macspec"]


def test_kimi_tp2_equals_one_process_at_every_k_sequential_and_concurrent(kimi_tp, kimi_single, texts):
    expected = {t: _complete(kimi_single.url, t, "none", 1)[0] for t in texts[:2]}
    cases = [(t, "draft", k) for t in texts[:2] for k in (1, 2, 4, 8)] + [(t, "dflash", 3) for t in texts[:2]]
    sequential = [_complete(kimi_tp.url, *c) for c in cases[:4]]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda c: _complete(kimi_tp.url, *c), cases[4:]))
    for (text, method, k), (got, _, stats) in zip(cases, sequential + concurrent):
        assert got == expected[text], (method, k)
        assert stats["spec"]["drafted"] > 0
    assert kimi_tp.status()["tensor_parallel"]["ranks"] == 2


def test_kimi_tp2_reference_scenario_completes(kimi_tp, texts):
    """1 request, then 3 sequential, then 4 concurrent, 256 tokens each: all complete, none
    over 60 s (the replaced server deadlocked at k >= 2 and timed out after the first)."""
    def one(text):
        got, seconds, stats = _complete(kimi_tp.url, text, "draft", 4, max_tokens=256)
        return seconds, stats

    results = [one(texts[0])] + [one(t) for t in texts[1:4]]
    with ThreadPoolExecutor(4) as pool:
        results += list(pool.map(one, texts[4:8]))
    assert len(results) == 8
    for seconds, stats in results:
        assert stats["finish_reason"] == "length" and seconds < 60, (seconds, stats["finish_reason"])


def test_glm_mtp_and_dflash_under_tp2_are_lossless(tmp_path, glm):
    """Its MTP layer and a DFlash drafter made for it (random weights) over two ranks."""
    from macspec.models.dflash import random_drafter

    drafter = random_drafter(tmp_path / "dflash", glm.target.config, block_size=4)
    profile = tmp_path / "glm5-mtp-mini-tp2.toml"
    profile.write_text(Path(find_profile("glm5-mtp-mini")).read_text().replace(
        "[speculative]\n", f'[speculative]\ndflash_drafter = "{drafter}"\n') +
        '\n[parallel]\ntensor_parallel = 2\nbackend = "ring"\nhosts = ["127.0.0.1", "127.0.0.1"]\n')
    server = TPServer(str(profile), tmp_path / "home")
    try:
        with RunningServer(glm, max_batch=4) as single:
            for text in [glm.tokenizer.decode(p) for p in heldout_prompts(glm.tokenizer, 2)]:
                expected = _complete(single.url, text, "none", 1)[0]
                for method in ("mtp", "dflash"):
                    got, _, stats = _complete(server.url, text, method, 3)
                    assert got == expected, method
                    assert stats["spec"]["drafted"] > 0 and stats["method"] == method
        status = server.status()
        assert status["speculation_faults"]["total"] == 0
        assert status["speculation"]["mtp"]["acceptance_rate"] > 0.3, status["speculation"]
    finally:
        assert server.stop() == 0, server.log.read_text()[-2000:]


def test_macspec_run_kimi_tp2_mini_equals_one_process(tmp_path, kimi):
    """`macspec run` as rank 0 of two (ring over loopback), speculating with the draft."""
    import json
    import os
    import subprocess
    import sys

    prompt = kimi.tokenizer.decode(heldout_prompts(kimi.tokenizer, 1)[0])
    out = subprocess.run([sys.executable, "-m", "macspec", "run", prompt, "--profile", "kimi-tp2-mini",
                          "--temperature", "0", "--max-tokens", "48", "--json", "--fixed-k"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MACSPEC_HOME": str(tmp_path / "home")})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    from macspec.run import encode_prompt

    ids = encode_prompt(kimi.tokenizer, prompt, kimi.profile.model.chat)
    plain = engine_for(kimi).generate([ids], GREEDY, 48, method="none")[0].tokens
    assert result["token_ids"] == plain
    assert result["spec"]["drafted"] > 0 and result["method"] == "draft"
