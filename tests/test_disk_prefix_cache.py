"""The prefix cache on disk through a real `macspec serve` and the openai client: a restarted
server starts from a long prompt's KV on disk with identical greedy output, with an MTP head
(whose entry keeps the target's states) and under TP=2 (each rank its own shard); a damaged
entry means a warning and a cold prefill, and a damaged shard on one rank means none loads."""

from __future__ import annotations

import mlx.core as mx
import openai
import pytest

from macspec.config import find_profile

from .tputil import TPServer

PROMPT = "You are a careful assistant who answers in short sentences. " * 130 + "\nQ: say hi\nA:"


def _profile(tmp_path, name: str) -> str:
    """The shipped profile with the disk cache on and room for the long prompt."""
    text = find_profile(name).read_text().replace("[kv]\nmax_context = 2048",
                                                  "[kv]\nmax_context = 4096\nprefix_cache_disk_gb = 0.5")
    path = tmp_path / f"{name}-disk.toml"
    path.write_text(text)
    return str(path)


def _ask(server: TPServer) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=0)
    return reply.choices[0].text, server.status()["prefix_cache"]


def _run(profile: str, home) -> tuple[str, dict, str]:
    server = TPServer(profile, home)
    try:
        text, cache = _ask(server)
    finally:
        assert server.stop() == 0
    return text, cache, server.log.read_text()


def _shards(home) -> dict[str, list]:
    found: dict[str, list] = {}
    for path in (home / "cache" / "prefix-kv").rglob("*.safetensors"):
        found.setdefault(mx.load(str(path), return_metadata=True)[1]["shard"], []).append(path)
    return found


def _damage(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-mtp", "tiny-tp2"])
def test_restart_starts_from_disk_and_damage_means_cold_prefill(tmp_path, name):
    profile, home = _profile(tmp_path, name), tmp_path / "home"
    cold, cache, _ = _run(profile, home)
    assert cache["disk"]["loads"] == 0 and cache["reused_tokens"] == 0
    world = 2 if name.endswith("tp2") else 1
    assert sorted(_shards(home)) == [f"{rank}/{world}" for rank in range(world)]

    warm, cache, _ = _run(profile, home)  # a restart: empty RAM cache, the same cache dir
    assert warm == cold
    assert cache["disk"]["loads"] == 1 and cache["reused_tokens"] > 1000, cache

    damaged = _shards(home)[f"{world - 1}/{world}"]  # under TP: rank 1's shard only
    for path in damaged:
        _damage(path)
    again, cache, log = _run(profile, home)
    assert again == cold and cache["reused_tokens"] == 0, cache
    if world == 1:
        assert cache["disk"]["corrupt"] == 1 and "prefix cache on disk: dropping" in log
    for path in damaged:  # dropped, then written again from the cold prefill
        assert mx.load(str(path))["tokens"].size > 1000


@pytest.mark.slow
def test_mla_cache_with_indexer_and_mtp_states_survives_a_restart(tmp_path):
    """GLM-5's replica: MLA latents and the DSA indexer's keys (a CacheList) plus the MTP
    head's states go to disk and come back in a new engine, with identical greedy output."""
    from macspec.engine.engine import Engine
    from macspec.sampling import SamplingParams

    from .serverutil import runtime_with

    runtime = runtime_with("glm5-mtp-mini", kv__prefix_cache_disk_gb=0.5,
                           kv__prefix_cache_disk_dir=str(tmp_path))
    prompt = runtime.tokenizer.encode(PROMPT)[:600]
    outputs, caches = [], []
    for _ in range(2):  # the second engine is the restart
        engine = Engine(runtime)
        [done] = engine.generate([prompt], SamplingParams(), 12, adaptive=False)
        engine.idle(0.0)  # the entry goes to disk
        outputs.append(done.tokens)
        caches.append(engine.status()["prefix_cache"])
    assert outputs[0] == outputs[1]
    assert caches[1]["disk"]["loads"] == 1 and caches[1]["reused_tokens"] == len(prompt) - 1, caches


def test_a_disk_that_cannot_be_written_costs_the_cache_never_a_request(tmp_path, caplog):
    """The cache directory vanished (here: a file where it was): every later write fails. Each
    request still completes with the same output, the entry stays in RAM, and the failure is
    one warning and a count in /v1/status, not a failed step that fails every request."""
    from macspec.engine.engine import Engine
    from macspec.sampling import SamplingParams

    from .serverutil import runtime_with

    runtime = runtime_with("tiny", kv__prefix_cache_disk_gb=0.1, kv__prefix_cache_disk_dir=str(tmp_path / "kv"))
    engine = Engine(runtime)
    prompts = [runtime.tokenizer.encode(f"{i} " + PROMPT)[:300] for i in range(3)]
    [first] = engine.generate([prompts[0]], SamplingParams(), 8)
    engine.idle(0.0)
    assert engine.status()["prefix_cache"]["disk"]["entries"] == 1
    root = engine.runner.disk.root
    for path in root.iterdir():
        path.unlink()
    root.rmdir()
    root.write_text("not a directory")
    with caplog.at_level("WARNING"):
        done = engine.generate(prompts[1:], SamplingParams(), 8)  # admission persists the last one
        engine.idle(0.0)
        again = engine.generate([prompts[1]], SamplingParams(), 8)[0]
    assert all(c.error is None for c in [*done, again])
    assert again.tokens == done[0].tokens and again.stats["cached_prompt_tokens"] == len(prompts[1]) - 1
    disk = engine.status()["prefix_cache"]["disk"]
    assert disk["write_errors"] >= 1, disk
    assert sum("could not write" in r.message for r in caplog.records) == 1
