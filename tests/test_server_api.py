"""The HTTP API through real clients: openai, anthropic, requests; errors, auth, 429, status."""

from __future__ import annotations

import concurrent.futures as cf

import anthropic
import openai
import pytest
import requests

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny"), api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body=None, data=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None:  # raw bytes: still declared as JSON (anything else is a 415)
        headers["Content-Type"] = "application/json"
    return requests.post(server.url + path, json=body, data=data, headers=headers, timeout=60, **kw)


def test_chat_non_stream_and_stream_agree(client):
    args = dict(model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}],
                max_tokens=24, temperature=0)
    full = client.chat.completions.create(**args)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(**args, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_completions_prompt_forms_and_max_completion_tokens(client, server):
    text = client.completions.create(model="tiny", prompt="import os\n", max_tokens=10, temperature=0)
    assert text.usage.completion_tokens == 10 and text.choices[0].finish_reason == "length"
    ids = server.runtime.tokenizer.encode("import os\n", add_special_tokens=False)
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert same.choices[0].text == text.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=3)
    assert chat.usage.completion_tokens <= 3


def test_stop_strings_cut_the_text(client):
    base = client.completions.create(model="tiny", prompt="class Foo:\n    def", max_tokens=40,
                                     temperature=0).choices[0].text
    stop = base[5:8]
    assert stop.strip(), base
    cut = client.completions.create(model="tiny", prompt="class Foo:\n    def", max_tokens=40,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].text == base[:base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="class Foo:\n    def", max_tokens=40,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == base[:base.index(stop)]


def test_seeded_sampling_replays(client):
    args = dict(model="tiny", prompt="def main():\n", max_tokens=20, temperature=0.9, top_p=0.95,
                seed=7, extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.05})
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first


def test_models_lists_profile_and_path(client):
    ids = [m.id for m in client.models.list().data]
    assert "tiny" in ids and "embedded:tiny-target" in ids


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    msg = client.messages.create(model="tiny", max_tokens=16, system="You write Python.",
                                 messages=[{"role": "user", "content": "def f():"}])
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1
    with client.messages.stream(model="tiny", max_tokens=16, system="You write Python.",
                                messages=[{"role": "user", "content": "def f():"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])


BAD_REQUESTS = [
    ("/v1/chat/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", None, b"\xff\xfe\x00bad", 400, "UTF-8"),
    ("/v1/chat/completions", None, b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "non-empty"),
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 9}, None, 400, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 5}}, None, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 101}}, None, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, None, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, None, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, None, 400, "not among the tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, None, 400, "not valid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "("}}, None, 400, "regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, None, 400, "integer"),
    ("/v1/completions", {"prompt": [5] * 2100}, None, 400, "maximum context length is 2048"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, None, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, None, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "speculative": {"method": "eagle"}}, None, 400, "eagle"),
    ("/v1/completions", {"prompt": [10**9]}, None, 400, "token ids"),
    ("/v1/completions", {"prompt": ""}, None, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, None, 400, "stop"),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, None, 400, "max_tokens"),
    ("/v1/nope", {}, None, 404, "no route"),
]


@pytest.mark.parametrize("path,body,data,code,text", BAD_REQUESTS)
def test_bad_requests_get_json_4xx(server, path, body, data, code, text):
    resp = post(server, path, body, data)
    assert resp.status_code == code, resp.text
    payload = resp.json()
    message = payload["error"]["message"]
    assert text in message
    if path == "/v1/messages":
        assert payload["type"] == "error"


def test_body_size_limit(server):
    resp = post(server, "/v1/completions", data=b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}')
    assert resp.status_code == 413 and "too large" in resp.json()["error"]["message"]


def test_auth(server):
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=None).status_code == 401
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="sk-wrong").status_code == 401
    ok = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"x-api-key": KEY}, timeout=30)
    assert ok.status_code == 200
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    assert requests.get(server.url + "/metrics", timeout=5).status_code == 401


def test_status_and_metrics_report_speculation(server, client):
    client.completions.create(model="tiny", prompt="import sys\n", max_tokens=30, temperature=0,
                              extra_body={"speculative": {"method": "ngram", "num_draft_tokens": 3,
                                                          "adaptive": False}})
    headers = {"Authorization": f"Bearer {KEY}"}
    status = requests.get(server.url + "/v1/status", headers=headers, timeout=5).json()
    engine = status["engine"]
    assert engine["state"] == "running" and engine["running"] == 0
    ngram = engine["speculation"]["ngram"]
    assert ngram["drafted"] > 0 and len(ngram["acceptance_by_position"]) == 3
    assert ngram["tokens_per_forward"] >= 1.0
    assert engine["memory"]["mlx_active_bytes"] > 0
    metrics = requests.get(server.url + "/metrics", headers=headers, timeout=5).text
    assert 'macspec_spec_drafted_tokens_total{method="ngram"}' in metrics
    assert "macspec_requests_running 0.0" in metrics


def test_full_queue_answers_429():
    runtime = runtime_with("tiny")
    with RunningServer(runtime, max_batch=1, max_queue=1) as srv:
        body = {"prompt": "def f():", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "speculative": {"method": "none"}}
        with cf.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: requests.post(srv.url + "/v1/completions", json=body,
                                                            timeout=120), range(6)))
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 2 and 429 in codes, codes
        limited = next(r for r in results if r.status_code == 429)
        assert limited.headers["Retry-After"] and limited.json()["error"]["type"] == "rate_limit_error"
        assert requests.get(srv.url + "/health", timeout=5).json()["status"] == "ok"
