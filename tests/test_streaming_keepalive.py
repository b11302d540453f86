"""Streams stay alive while a prompt prefills (SSE comment lines on all three APIs), and a
stream its client left is logged as 499, not 200."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import requests

from macspec import faults
from macspec.server import state

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # starts a server

STREAMS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}
DONE = {"/v1/chat/completions": "data: [DONE]", "/v1/messages": "event: message_stop",
        "/v1/responses": "event: response.incomplete"}  # 4 tokens: cut short


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny")) as srv:
        yield srv


@pytest.fixture
def held_prefill(monkeypatch):
    """Prefill waits until the test lets it go: the stream has nothing to send meanwhile."""
    gate = threading.Event()
    check = faults.check

    def held(point: str) -> None:
        if point == "prefill":
            gate.wait(60)
        check(point)

    monkeypatch.setattr(faults, "check", held)
    monkeypatch.setattr(state, "KEEPALIVE_S", 0.05)
    yield gate
    gate.set()


@pytest.mark.parametrize("path", list(STREAMS))
def test_comment_lines_flow_while_the_prompt_prefills(server, held_prefill, path):
    body = {"model": "default", "stream": True, "temperature": 0, **STREAMS[path]}
    with requests.post(server.url + path, json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines(decode_unicode=True)
        assert ": keep-alive" in lines  # stops at the first, while the prompt is still held
        held_prefill.set()
        rest = list(lines)
    assert DONE[path] in rest


def test_a_stream_its_client_left_is_logged_499(server, held_prefill, caplog):
    caplog.set_level(logging.INFO, logger="macspec.access")
    body = {"model": "default", "stream": True, **STREAMS["/v1/chat/completions"]}
    reply = requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60)
    ident = reply.headers["X-Request-Id"]
    assert b": keep-alive" in reply.iter_lines()
    reply.close()  # the client goes away while its prompt prefills
    held_prefill.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if r.name == "macspec.access"]
        mine = [line for line in lines if line.startswith(ident)]
        if mine:
            break
        time.sleep(0.05)
    assert mine and " 499 " in mine[0], lines
