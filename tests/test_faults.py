"""Bookkeeping never fails a request: the step-cost table never raises, a fault in the policy,
an acceptance estimate or a proposer costs that step's speculation only (counted, logged once), and a
fault in an engine step ends every request it concerns with an error, never a hang."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading

import pytest
import requests

from macspec import faults
from macspec.engine.engine import Engine
from macspec.engine.service import EngineService
from macspec.engine.request import Failed, Finished, GenerationRequest
from macspec.sampling import SamplingParams
from macspec.speculative.policy import PlanRow, Policy

from .serverutil import RunningServer, runtime_with


def test_the_policy_plans_after_a_long_plain_run_and_survives_clock_glitches():
    policy = Policy()
    for seconds in [0.008] * 2000 + [float("nan"), float("inf"), -1.0]:
        policy.observe_step([PlanRow("draft", 0, [])], [0], seconds, [1])
    rows = [PlanRow("draft", 4, [0.7] * 4)] * 3
    assert len(policy.plan(rows)) == 3  # no exception, one k per row


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny"), max_batch=8) as srv:
        yield srv


@pytest.fixture(autouse=True)
def clean_faults():
    faults.disarm_all()
    yield
    faults.disarm_all()


def _complete(server, prompt: str, method: str = "draft", k: int = 4, max_tokens: int = 24):
    return requests.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "speculative": {"method": method, "num_draft_tokens": k, "adaptive": False}})


def _status(server) -> dict:
    return requests.get(server.url + "/v1/status", timeout=10).json()["engine"]


@pytest.mark.parametrize("point,method", [("plan", "draft"), ("proposer_start", "mtp"),
                                          ("propose", "draft"), ("proposer_observe", "mtp"),
                                          ("acceptance", "ngram"), ("cost_model", "draft")])
@pytest.mark.slow
def test_bookkeeping_fault_falls_back_to_plain_and_is_counted(server, caplog, point, method):
    prompt = "def parse(self, text):\n    "
    plain = _complete(server, prompt, "none").json()["choices"][0]["text"]
    before = _status(server)["speculation_faults"]["by_source"]
    faults.arm(point, RuntimeError(f"injected {point}"), times=3)
    with caplog.at_level(logging.WARNING, logger="macspec.engine.faults"):
        reply = _complete(server, prompt, method)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == plain  # still lossless
    after = _status(server)["speculation_faults"]
    source = f"proposer:{method}" if point.startswith("propos") else point
    assert after["by_source"].get(source, 0) > before.get(source, 0), after
    assert f"injected {point}" in after["last"]
    logged = [r for r in caplog.records if f"injected {point}" in r.getMessage()]
    assert len(logged) <= 1  # once per kind, not per step
    assert _status(server)["degraded_reason"] is None


@pytest.mark.slow
def test_failing_decode_step_ends_every_request_with_an_error(server):
    prompts = [f"def f{i}(x):\n    return" for i in range(6)]

    def stream(prompt):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
        events = []
        with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: "):
                    events.append(line[6:].decode())
        return resp.status_code, events

    faults.arm("decode", RuntimeError("injected decode failure"), times=1)
    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(stream, prompts))
    errors = [events for status, events in results if any('"error"' in e for e in events)]
    assert errors, results  # the injected step failed the requests it held...
    for status, events in results:  # ...and every client got an end: an error or [DONE]
        assert events and (events[-1] == "[DONE]" or '"error"' in events[-1]), events
    assert _complete(server, "import os\n").status_code == 200  # and the next one is served
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}


@pytest.mark.slow
def test_failing_prefill_fails_only_that_request(server):
    faults.arm("prefill", RuntimeError("injected prefill failure"), times=1)
    reply = _complete(server, "class Queue:\n")
    assert reply.status_code >= 500 and "injected prefill failure" in reply.text
    assert _complete(server, "class Queue:\n").status_code == 200


@pytest.mark.slow
def test_failing_admission_fails_the_request_instead_of_losing_it(server):
    """A request taken from the queue when its prefix lookup fails gets the error at once (it
    waited, lost, until the server stopped: ten minutes in a test) and the next is served."""
    faults.arm("admit", RuntimeError("injected admission failure"), times=1)
    reply = _complete(server, "class Stack:\n")
    assert reply.status_code >= 500 and "injected admission failure" in reply.text
    assert _complete(server, "class Stack:\n").status_code == 200


@pytest.mark.slow
def test_bad_seed_reaching_the_engine_fails_that_request_at_once():
    """A request the engine cannot start (here: a seed mx.random.key refuses) gets its Failed
    event at once, through the service as through the engine itself; both keep serving."""
    engine = Engine(runtime_with("tiny"))
    bad = SamplingParams(temperature=0.5, seed=-1)
    [failed, fine] = engine.generate([[1, 2, 3], [1, 2, 3]], [bad, SamplingParams()], 4)
    assert failed.error is not None and "could not start" in str(failed.error)
    assert fine.error is None and len(fine.tokens) == 4
    service = EngineService(engine)
    service.start(calibrate=False)
    try:
        events = []
        done = threading.Event()

        def sink(event):
            events.append(event)
            if isinstance(event, (Failed, Finished)):
                done.set()

        service.submit(GenerationRequest([1, 2, 3], bad, 4, sink))
        assert done.wait(10), events
        assert isinstance(events[-1], Failed)
        done.clear()
        service.submit(GenerationRequest([1, 2, 3], SamplingParams(), 4, sink))
        assert done.wait(30) and isinstance(events[-1], Finished)
        assert service.degraded_reason is None
    finally:
        service.stop()


@pytest.mark.slow
def test_faults_reach_metrics(server):
    faults.arm("plan", RuntimeError("injected plan"), times=1)
    assert _complete(server, "x = 1\n").status_code == 200
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert "macspec_speculation_faults_total" in text
    assert json.dumps(_status(server)["speculation_faults"])


@pytest.mark.slow
def test_tp_engine_failure_is_logged_with_its_traceback(tmp_path, monkeypatch):
    from .tputil import TPServer

    monkeypatch.setenv(faults.ENV, "decode:1")
    server = TPServer("tiny-tp2", tmp_path / "home")
    try:
        reply = requests.post(server.url + "/v1/completions", timeout=60,
                              json={"prompt": "import os", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 503 and "injected fault at decode" in reply.text
        assert server.proc.wait(30) != 0  # the ranks may be out of lock-step: the daemon exits
    finally:
        server.stop()
    log = server.log.read_text()
    assert "tensor-parallel engine step failed" in log and "Traceback" in log
    assert 'raise entry[0]' in log or "faults.py" in log
