"""A tensor-parallel daemon takes seconds to tear down (the workers leave, then are reaped):
/health answers 503 "shutting down" all along instead of hanging or refusing connections."""

from __future__ import annotations

import pytest

import threading
import time

import requests

from .tputil import TPServer

pytestmark = pytest.mark.slow  # loads a model or starts a server/process


def test_tp_teardown_keeps_health_answering(tmp_path):
    server = TPServer("tiny-tp2", tmp_path / "tp")
    polls: list[object] = []
    stopped = threading.Event()

    def poll() -> None:
        while not stopped.is_set():
            try:
                reply = requests.get(server.url + "/health", timeout=3)
                polls.append((reply.status_code, reply.json().get("reason")))
            except requests.RequestException as err:
                polls.append(err)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    try:
        assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
        poller.start()
        time.sleep(0.2)
        server.proc.terminate()  # SIGTERM, like `macspec stop`
        code = server.proc.wait(60)
    finally:
        stopped.set()
        if poller.is_alive():
            poller.join(10)
        if server.proc.poll() is None:
            server.proc.kill()
    assert code == 0, server.log.read_text()[-2000:]
    assert (503, "shutting down") in polls, polls[:10]
    first = polls.index((503, "shutting down"))
    assert all(p == (200, None) for p in polls[:first])
    last = max(i for i, p in enumerate(polls) if p == (503, "shutting down"))
    assert all(p in ((200, None), (503, "shutting down")) for p in polls[:last + 1]), \
        "a poll failed while /health still answered"
    assert all(isinstance(p, Exception) for p in polls[last + 1:])
