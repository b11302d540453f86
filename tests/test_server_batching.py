"""Concurrency: batched outputs equal one-at-a-time outputs; disconnects free their KV."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import pytest
import requests

from macspec.proposers import METHODS

from .conftest import heldout_prompts
from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process



@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny"), max_batch=16, max_queue=64) as srv:
        yield srv


def _body(i: int, prompt: list[int], sampled: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": 24 + 5 * (i % 5), "temperature": 0,
            "repetition_penalty": 1.1 if i % 3 == 0 else 1.0,
            "speculative": {"method": METHODS[i % len(METHODS)], "num_draft_tokens": 1 + i % 6,
                            "adaptive": i % 2 == 0}}
    if sampled:
        body.update(temperature=0.8, top_p=0.9, seed=1000 + i)
    return body


def _complete(server, body) -> list[int]:
    resp = requests.post(server.url + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["text"], out["macspec"]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_sixteen_concurrent_equal_one_at_a_time(server, sampled):
    prompts = heldout_prompts(server.runtime.tokenizer, 16)
    bodies = [_body(i, p, sampled) for i, p in enumerate(prompts)]
    alone = [_complete(server, b)[0] for b in bodies]
    with cf.ThreadPoolExecutor(16) as pool:
        futures = []
        for b in bodies:  # staggered, so rows join while others decode
            futures.append(pool.submit(_complete, server, b))
            time.sleep(0.01)
        together = [f.result() for f in futures]
    mismatched = [i for i, (a, (t, _)) in enumerate(zip(alone, together)) if a != t]
    assert not mismatched, f"rows {mismatched} differ between batched and alone"
    status = requests.get(server.url + "/v1/status", timeout=5).json()["engine"]
    assert max(int(b) for b in status["batch_size_histogram"]) >= 8  # it really batched
    spec_rows = [s for _, s in together if s["method"] != "none"]
    assert sum(s["spec"]["accepted"] for s in spec_rows) > 0


def _send_then_drop(port: int, stream: bool, chunks: int = 0, wait_s: float = 0.0) -> None:
    body = json.dumps({"prompt": "def main():", "max_tokens": 1500, "stream": stream,
                       "ignore_eos": True, "temperature": 0,
                       "speculative": {"method": "none"}}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data: ") < chunks:
        received += sock.recv(65536)
    time.sleep(wait_s)
    sock.close()


def test_disconnect_cancels_and_frees_kv(server):
    status = lambda: requests.get(server.url + "/v1/status", timeout=5).json()["engine"]  # noqa: E731
    requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    baseline = status()
    _send_then_drop(server.port, stream=True, chunks=5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = status()
        if now["running"] == 0 and now["totals"]["cancelled"] > baseline["totals"]["cancelled"]:
            break
        time.sleep(0.1)
    assert now["running"] == 0 and now["kv_cache_bytes"] == 0
    assert now["totals"]["cancelled"] == baseline["totals"]["cancelled"] + 1
    assert now["totals"]["generated_tokens"] < baseline["totals"]["generated_tokens"] + 1000
    # Active memory returns to the baseline (within 5 MB: the tiny model's KV is a few MB).
    grown = now["memory"]["mlx_active_bytes"] - baseline["memory"]["mlx_active_bytes"]
    assert grown < 5 * 2**20, grown
    assert requests.get(server.url + "/health", timeout=5).json()["status"] == "ok"


def test_non_stream_disconnect_cancels(server):
    status = lambda: requests.get(server.url + "/v1/status", timeout=5).json()["engine"]  # noqa: E731
    before = status()["totals"]["cancelled"]
    _send_then_drop(server.port, stream=False, wait_s=0.5)
    deadline = time.monotonic() + 10
    while status()["totals"]["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status()["totals"]["cancelled"] == before + 1 and status()["running"] == 0
