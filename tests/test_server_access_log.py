"""One access-log line per request (logger "macspec.access"): id, route, status, tokens, ms,
speculation method and acceptance; the id is also the response's X-Request-Id."""

from __future__ import annotations

import logging
import re
import time

import pytest
import requests

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

LINE = re.compile(r"^(?P<id>[0-9a-f]{16}) (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) "
                  r"prompt_tokens=(?P<prompt>\S+) completion_tokens=(?P<completion>\S+) "
                  r"ms=(?P<ms>\d+\.\d) method=(?P<spec>\S+) acceptance=(?P<acceptance>\S+)$")


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny")) as srv:
        yield srv


def _access_lines(caplog, count: int, timeout_s: float = 5.0) -> list[re.Match]:
    """Streams are logged when the handler returns, just after the client saw the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [r for r in caplog.records if r.name == "macspec.access"]
        if len(records) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(r.levelno == logging.INFO for r in records)
    lines = [LINE.match(r.getMessage()) for r in records]
    assert all(lines), [r.getMessage() for r in records]
    return lines


def test_one_line_per_request_with_route_and_status(server, caplog):
    caplog.set_level(logging.INFO, logger="macspec.access")
    url = server.url
    body = {"prompt": "import os\n", "max_tokens": 4}
    replies = [
        requests.get(url + "/health", timeout=10),
        requests.post(url + "/v1/completions", json=body, timeout=60),
        requests.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60),
        requests.post(url + "/v1/chat/completions", json={"messages": "hi"}, timeout=60),
        requests.post(url + "/v1/completions", data=b"{}", headers={"Content-Type": "text/plain"},
                      timeout=60),
        requests.get(url + "/v1/nope", timeout=10),
        requests.post(url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "x"}]}),
    ]
    expected = [("GET", "/health", 200), ("POST", "/v1/completions", 200),
                ("POST", "/v1/completions", 200), ("POST", "/v1/chat/completions", 400),
                ("POST", "/v1/completions", 415), ("GET", "/v1/nope", 404),
                ("POST", "/v1/messages", 200)]
    assert [r.status_code for r in replies] == [code for _, _, code in expected]
    lines = _access_lines(caplog, len(replies))
    assert len(lines) == len(replies)
    by_id = {m["id"]: m for m in lines}
    for reply, (method, path, status) in zip(replies, expected):
        line = by_id[reply.headers["X-Request-Id"]]
        assert (line["method"], line["path"], int(line["status"])) == (method, path, status)
        assert float(line["ms"]) >= 0


def test_hostile_paths_stay_on_one_line(server, caplog):
    caplog.set_level(logging.INFO, logger="macspec.access")
    reply = requests.get(server.url + "/v1/%0Afake%20line%0D", timeout=10)
    assert reply.status_code == 404
    (line,) = _access_lines(caplog, 1)
    assert "\n" not in line.string and "\r" not in line.string and line["status"] == "404"


def test_generation_lines_carry_tokens_method_and_acceptance(server, caplog):
    caplog.set_level(logging.INFO, logger="macspec.access")
    body = {"prompt": "import os\n", "max_tokens": 6, "temperature": 0,
            "speculative": {"method": "ngram", "num_draft_tokens": 2, "adaptive": False}}
    plain = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()
    requests.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    lines = _access_lines(caplog, 2)
    assert len(lines) == 2
    for line in lines:
        assert int(line["prompt"]) == plain["usage"]["prompt_tokens"]
        assert int(line["completion"]) == plain["usage"]["completion_tokens"]
        assert line["spec"] == "ngram" and 0.0 <= float(line["acceptance"]) <= 1.0
