"""/health during shutdown: 503 "shutting down" while the engine stops (off the event loop),
never a hang or a refused connection before the engine is down."""

from __future__ import annotations

import pytest

import threading
import time

import requests

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

PROMPT_TOKENS = 4000  # one prefill step of a few hundred ms (fast Mac) to seconds (CI CPU)


def test_health_says_shutting_down_while_the_engine_stops():
    runtime = runtime_with("tiny", kv__max_context=PROMPT_TOKENS + 64,
                           kv__prefill_chunk=PROMPT_TOKENS + 64)
    server = RunningServer(runtime).__enter__()
    url = server.url
    long_reply: list = []

    def long_request() -> None:  # the engine thread is inside this step when the stop comes
        body = {"prompt": [5] * PROMPT_TOKENS, "max_tokens": 1, "speculative": {"method": "none"}}
        try:
            long_reply.append(requests.post(url + "/v1/completions", json=body, timeout=120).status_code)
        except requests.RequestException as err:
            long_reply.append(err)

    polls: list[tuple[float, object]] = []
    engine_down_at: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            try:
                reply = requests.get(url + "/health", timeout=3)
                polls.append((time.monotonic(), (reply.status_code, reply.json().get("reason"))))
            except requests.RequestException as err:
                polls.append((time.monotonic(), err))
                if not server.engine._thread.is_alive():
                    return
                time.sleep(0.01)

    sender = threading.Thread(target=long_request)
    sender.start()
    deadline = time.monotonic() + 30
    while requests.get(url + "/v1/status", timeout=5).json()["engine"]["prefilling"] == 0:
        assert time.monotonic() < deadline and not long_reply, long_reply
        time.sleep(0.005)
    poller = threading.Thread(target=poll_health)
    poller.start()
    server.__exit__(None, None, None)  # stop: returns once the server thread has ended
    engine_down_at.append(time.monotonic())
    done.set()
    poller.join(10)
    sender.join(30)

    outcomes = [outcome for _, outcome in polls]
    assert (503, "shutting down") in outcomes, outcomes[:20]
    first = outcomes.index((503, "shutting down"))
    assert all(o == (200, None) for o in outcomes[:first]), outcomes[:first]
    after = outcomes[first:]
    assert (200, None) not in after  # once shutting down, never ok again
    errors = [t for t, o in polls if isinstance(o, Exception)]
    last_503 = max(t for t, o in polls if o == (503, "shutting down"))
    assert all(t > last_503 for t in errors), "a connection failed while /health still answered"
    assert long_reply and long_reply[0] in (200, 503), long_reply
