"""1000+ malformed or hostile requests: never a 5xx, the server healthy and correct after."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "application/vnd.x+json"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "stop_sequences",
          "stream", "stream_options", "n", "system", "speculative", "logprobs", "ignore_eos"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x", ""]),
                                 "content": st.one_of(st.text(max_size=40), values)})
plausible = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["tiny", "nope", "", "embedded:tiny-target"]) | values,
    "messages": st.lists(message, max_size=3) | values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 5000), max_size=8) | values,
    "max_tokens": st.integers(-3, 40) | values,
    "temperature": st.floats(-1, 3) | values,
    "top_p": st.floats(-0.5, 1.5) | values, "top_k": st.integers(-2, 100) | values,
    "stop": st.lists(st.text(max_size=4), max_size=3) | values,
    "stream": st.booleans() | values,
    "speculative": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["draft", "mtp", "ngram", "none", "eagle"]),
        "num_draft_tokens": st.integers(-1, 40), "adaptive": st.booleans()}) | values,
    "seed": st.integers(-2**65, 2**65) | values,
})
bodies = st.one_of(
    st.binary(max_size=200),
    values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).map(lambda d: json.dumps(d).encode()),
    plausible.map(lambda d: json.dumps(d).encode()),
)


@pytest.fixture(scope="module")
def server():
    # A small context keeps every accidentally valid request short.
    with RunningServer(runtime_with("tiny", kv__max_context=64), max_batch=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def test_fuzz_never_5xx_and_the_server_stays_healthy(server, session):
    """1100 hostile requests, then the same server still answers correctly."""

    @settings(max_examples=1100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(path=st.sampled_from(PATHS), body=bodies, content_type=st.sampled_from(
        [*JSON_TYPES, *JSON_TYPES, "text/plain", "application/x-www-form-urlencoded"]))
    def fuzz(path, body, content_type):
        resp = session.post(server.url + path, data=body, headers={"Content-Type": content_type}, timeout=60)
        assert resp.status_code < 500, (body[:300], resp.status_code, resp.text[:300])
        if content_type not in JSON_TYPES:  # what a web page may post cross-origin: never parsed
            assert resp.status_code == 415, (content_type, resp.status_code, resp.text[:300])
        if resp.status_code >= 400:
            payload = resp.json()
            assert "error" in payload

    fuzz()
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    resp = requests.post(server.url + "/v1/completions", timeout=60,
                         json={"prompt": "import os", "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    engine = requests.get(server.url + "/v1/status", timeout=5).json()["engine"]
    assert engine["running"] == 0 and engine["waiting"] == 0 and engine["degraded_reason"] is None
