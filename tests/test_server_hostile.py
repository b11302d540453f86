"""Inputs that broke the daemon: each gets a 4xx naming the field (or a defined meaning), and
the first generated token's leading space survives streaming, in the server and in `run`."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest
import requests

from macspec.config import load_profile
from macspec.run import RunOptions, run_once

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

SPACE_PROMPT = "x = [i * i for i in"  # the greedy continuation starts with " _name"


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny"), max_batch=4) as srv:
        yield srv


def post(server, path, body):
    return requests.post(server.url + path, data=json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=60)


def _error(resp) -> dict:
    body = resp.json()
    return body["error"]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x", "seed": -1, "temperature": 0.5}, "seed"),
    ("/v1/completions", {"prompt": "bad \ud800 text", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}, "messages"),
    ("/v1/messages", {"system": "sys \udfff", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]}, "system"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_fields_get_a_4xx_naming_them(server, path, body, field):
    resp = post(server, path, body)
    assert 400 <= resp.status_code < 500, resp.text
    error = _error(resp)
    if path == "/v1/messages":
        assert field in error["message"]
    else:
        assert error["param"] == field, error


def test_deeply_nested_json_is_a_400(server):
    deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    resp = requests.post(server.url + "/v1/completions", data=deep,
                         headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == 400 and "nested too deeply" in resp.text
    moderately = {"prompt": "x", "max_tokens": 1, "extra": json.loads("[" * 80 + "]" * 80)}
    assert post(server, "/v1/completions", moderately).status_code == 400


@pytest.mark.parametrize("override", [{"temperature": 1e-45}, {"temperature": 5e-324},
                                      {"top_p": 0, "temperature": 0.9}, {"top_p": 1e-45, "temperature": 0.9}])
def test_vanishing_temperature_or_top_p_is_greedy(server, override):
    base = {"prompt": "def parse(self, text):", "max_tokens": 12}
    greedy = post(server, "/v1/completions", {**base, "temperature": 0}).json()["choices"][0]
    reply = post(server, "/v1/completions", {**base, **override})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] and choice["text"] == greedy["text"]
    assert choice["finish_reason"] == greedy["finish_reason"]


def test_server_healthy_after_hostile_inputs(server):
    post(server, "/v1/completions", {"prompt": "x", "seed": -1, "temperature": 0.5})
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}


def test_stop_string_requests_count_as_completed(server):
    before = requests.get(server.url + "/v1/status", timeout=5).json()["engine"]["totals"]
    base = post(server, "/v1/completions", {"prompt": "class Foo:\n    def", "max_tokens": 40,
                                            "temperature": 0}).json()["choices"][0]["text"]
    stop = base[len(base) // 2:len(base) // 2 + 3]
    for _ in range(4):
        reply = post(server, "/v1/completions", {"prompt": "class Foo:\n    def", "max_tokens": 40,
                                                 "temperature": 0, "stop": [stop]})
        assert reply.json()["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 10  # the engine ends a request just after its client has the text
    while True:
        after = requests.get(server.url + "/v1/status", timeout=5).json()["engine"]["totals"]
        if after["completed"] >= before["completed"] + 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after["cancelled"] == before["cancelled"]
    assert after["completed"] == before["completed"] + 5
    metrics = requests.get(server.url + "/metrics", timeout=5).text
    cancelled = [line for line in metrics.splitlines()
                 if line.startswith("macspec_requests_total") and "cancelled" in line]
    assert all(line.rstrip().endswith(" 0.0") or line.rstrip().endswith(" 0") for line in cancelled), cancelled


def test_first_token_keeps_its_leading_space_in_server_and_run(server, capsys):
    reply = post(server, "/v1/completions", {"prompt": SPACE_PROMPT, "max_tokens": 8, "temperature": 0,
                                             "speculative": {"method": "none"}})
    served = reply.json()["choices"][0]["text"]
    profile = load_profile("tiny")
    result = run_once(profile, SPACE_PROMPT, RunOptions(method="none", max_tokens=8, temperature=0.0))
    streamed = capsys.readouterr().out
    tokenizer = server.runtime.tokenizer
    expected = tokenizer.decode(result["token_ids"])
    assert expected.startswith(" ")  # the case that was broken
    assert result["text"] == expected
    assert streamed == expected + "\n"
    assert served == expected


def test_streamed_text_equals_decode_of_all_tokens(server):
    """Over many prompts, streamed SSE pieces join to exactly decode(tokens) (= non-stream)."""
    from .conftest import heldout_prompts

    prompts = heldout_prompts(server.runtime.tokenizer, 12)
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
        pieces = []
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        whole = post(server, "/v1/completions", {**body, "stream": False}).json()["choices"][0]["text"]
        assert "".join(pieces) == whole


def test_a_header_over_the_limit_is_a_431_in_json_and_the_server_keeps_serving(server):
    resp = requests.get(server.url + "/health", headers={"X-Big": "a" * 100_000}, timeout=30)
    assert resp.status_code == 431
    assert resp.json()["error"]["type"] == "request_header_fields_too_large"
    assert requests.get(server.url + "/health", timeout=30).status_code == 200


def _post_oversized(port: int, size: int, within_s: float = 10.0) -> tuple[bytes, bool]:
    """POST a `size`-byte body on a keep-alive connection, reading while sending; -> (what came
    back, whether the server closed the connection within `within_s`)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Connection: keep-alive\r\nContent-Length: {size}\r\n\r\n").encode()
    reply, sent, chunk = b"", 0, b" " * 65536
    deadline = time.monotonic() + within_s
    with socket.create_connection(("127.0.0.1", port), timeout=within_s) as sock:
        sock.sendall(head)
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock] if sent < size else [], [], 0.2)
            try:
                if readable:
                    data = sock.recv(65536)
                    if not data:
                        return reply, True
                    reply += data
                elif writable:
                    sent += sock.send(chunk)
            except (BrokenPipeError, ConnectionResetError):
                if not readable:  # the answer may still wait to be read
                    sent = size
                    continue
                return reply, True
    return reply, False


def test_an_oversized_body_gets_a_413_and_the_connection_closes(server):
    limit = server.runtime.profile.server.max_body_kb * 1024
    reply, closed = _post_oversized(server.port, 64 * limit)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"Connection: close" in reply and b"too large" in reply, reply[:400]
    assert closed, "the server kept reading the body instead of closing the connection"
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
