"""Under load nothing fails: 32 concurrent streaming clients (the openai package, no retries)
× 5 requests each, mixed proposers, on one process and on two tensor-parallel ranks; every
greedy text equals the same prompt sent alone with plain decoding."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import requests

from macspec.proposers import METHODS

from .conftest import heldout_prompts
from .serverutil import RunningServer, runtime_with
from .tputil import TPServer

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

CLIENTS = 32
REQUESTS_EACH = 5
MAX_TOKENS = 20


def _prompts(tokenizer) -> list[str]:
    return [tokenizer.decode(p) for p in heldout_prompts(tokenizer, 8)]


def _alone(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "speculative": {"method": "none"}}
    reply = requests.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _hammer(url: str, prompts: list[str], methods: list[str]) -> list[tuple[int, str, str | None]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def one_client(c: int):
        out = []
        for r in range(REQUESTS_EACH):
            index = (c + r) % len(prompts)
            try:
                stream = client.completions.create(
                    model="default", prompt=prompts[index], max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"speculative": {"method": methods[(c + 3 * r) % len(methods)]}})
                text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
                out.append((index, text, None))
            except Exception as err:  # counted, reported below
                out.append((index, "", repr(err)))
        return out

    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        return [item for items in pool.map(one_client, range(CLIENTS)) for item in items]


def _check(url: str, prompts: list[str], methods: list[str]) -> dict:
    expected = [_alone(url, p) for p in prompts]
    results = _hammer(url, prompts, methods)
    failures = [err for _, _, err in results if err]
    assert not failures, f"{len(failures)} of {len(results)} failed: {failures[:3]}"
    wrong = [(i, text, expected[i]) for i, text, _ in results if text != expected[i]]
    assert not wrong, f"{len(wrong)} texts differ from the prompt alone: {wrong[:2]}"
    status = requests.get(url + "/v1/status", timeout=10).json()["engine"]
    assert status["totals"]["failed"] == 0 and status["degraded_reason"] is None
    assert requests.get(url + "/health", timeout=10).json() == {"status": "ok"}
    return status


def test_32_clients_one_process():
    runtime = runtime_with("tiny")
    with RunningServer(runtime, max_queue=64) as server:
        status = _check(server.url, _prompts(runtime.tokenizer), METHODS)
    assert max(int(b) for b in status["batch_size_histogram"]) > 1  # they did share batches
    assert sum(s["drafted"] for s in status["speculation"].values()) > 0


def test_32_clients_tensor_parallel(tmp_path):
    tokenizer = runtime_with("tiny").tokenizer
    server = TPServer("tiny-tp2", tmp_path / "home", "--max-queue", "64")
    try:
        _check(server.url, _prompts(tokenizer), [m for m in METHODS if m != "mtp"])  # the target has no MTP head
    finally:
        assert server.stop() == 0
