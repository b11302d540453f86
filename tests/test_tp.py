"""Tensor parallelism, for real: two ranks over the ring backend on loopback, rank 0 being a
`macspec serve` daemon that starts its worker, compared with one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from macspec.config import find_profile, load_profile
from macspec.distributed.bootstrap import group_spec
from macspec.proposers import PROPOSER_NAMES

from .serverutil import RunningServer, runtime_with
from .tputil import TPServer

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

MAX_TOKENS = 40
METHODS_K = [("none", 1)] + [(m, k) for m in PROPOSER_NAMES for k in (1, 2, 4, 8)]


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    server = TPServer("tiny-tp2", tmp_path_factory.mktemp("tp"))
    workers = [psutil.Process(pid) for pid in server.status()["tensor_parallel"]["worker_pids"]]
    yield server
    assert server.stop() == 0, server.log.read_text()[-2000:]  # SIGTERM, like `macspec stop`
    assert not psutil.wait_procs(workers, timeout=15)[1], "workers outlived rank 0"
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def single_server():
    with RunningServer(runtime_with("tiny"), max_batch=8) as server:
        yield server


def _body(prompt, method, k, max_tokens=MAX_TOKENS):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "speculative": {"method": method, "num_draft_tokens": k, "adaptive": False}}


def _text(url, body) -> tuple[str, float, dict]:
    t0 = time.perf_counter()
    reply = requests.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["text"], time.perf_counter() - t0, data["macspec"]


def test_tp2_greedy_equals_single_process(tp_server, single_server, prompts):
    """Plain and speculative (draft, MTP, n-gram) at k in {1, 2, 4, 8}, 13 configurations x 2
    prompts, sent concurrently so the TP batch mixes them: every text equals one process's."""
    cases = [(list(p), m, k) for p in (prompts[0], prompts[4]) for m, k in METHODS_K]
    expected = {}
    for prompt, _, _ in cases:
        key = tuple(prompt)
        if key not in expected:
            expected[key] = _text(single_server.url, _body(prompt, "none", 1))[0]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda c: _text(tp_server.url, _body(*c)), cases))
    mismatches = [(m, k) for (prompt, m, k), (text, _, _) in zip(cases, got) if text != expected[tuple(prompt)]]
    assert not mismatches, mismatches
    drafted = {m: stats["spec"]["drafted"] for (_, m, _), (_, _, stats) in zip(cases, got)}
    assert all(drafted[m] > 0 for m in ("draft", "mtp", "eagle3", "dflash", "ngram")), drafted  # speculation ran
    tp = tp_server.status()["tensor_parallel"]
    assert tp["ranks"] == 2 and tp["plans"] > 0


def test_seed_scenario_sequential_then_concurrent(tp_server, single_server, prompts):
    """1 request, 3 sequential, 4 concurrent, k = 1..8: all complete, none far slower than one
    process (the deadlock and 300 s time-outs this replaces failed exactly here)."""
    bodies = [_body(list(prompts[i % len(prompts)]), "draft", k, 48) for i, k in enumerate(range(1, 9))]
    single = [_text(single_server.url, b) for b in bodies]
    first = [_text(tp_server.url, bodies[0])]
    sequential = [_text(tp_server.url, b) for b in bodies[1:4]]
    with ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(lambda b: _text(tp_server.url, b), bodies[4:]))
    for (ref_text, ref_s, _), (text, seconds, stats) in zip(single, first + sequential + concurrent):
        assert text == ref_text
        assert stats["finish_reason"] in ("length", "stop")
        assert seconds < 10 * ref_s + 2.0, (seconds, ref_s)
    assert tp_server.status()["running"] == 0
    assert requests.get(tp_server.url + "/health", timeout=5).json()["status"] == "ok"


def test_tp_sampling_completes_and_replays(tp_server):
    body = {"prompt": "def parse(self, text):", "max_tokens": 32, "temperature": 0.8, "seed": 7,
            "speculative": {"method": "draft", "num_draft_tokens": 3}}
    a, b = tp_server.complete(**body), tp_server.complete(**body)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"]["completion_tokens"] == 32


def _profile_with(tmp_path, base: str, **parallel) -> str:
    text = find_profile(base).read_text()
    for key, value in parallel.items():
        text = text.replace("[parallel]\n", f"[parallel]\n{key} = {json.dumps(value)}\n")
    path = tmp_path / f"{base}-test.toml"
    path.write_text(text.replace("step_timeout_s = 10.0\n", ""))
    return str(path)


def _stream_until_error(url: str, worker_pid: int, sig: int) -> tuple[str, float]:
    """Start a long stream, hit the worker with `sig` after the first tokens; -> (tail, seconds)."""
    body = {"prompt": "class Stack:", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(4):
            next(lines)
        os.kill(worker_pid, sig)
        t0 = time.monotonic()
        tail = "\n".join(line.decode() for line in lines if line)
    return tail, time.monotonic() - t0


def _assert_clean_exit(server: TPServer, children: list[psutil.Process]) -> None:
    code = server.proc.wait(30)
    assert code != 0, "a daemon that lost a peer must exit non-zero for its supervisor"
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphans left: {alive}"
    assert "tensor parallelism failed" in server.log.read_text()


@pytest.mark.parametrize("profile", ["tiny-mtp-tp2", "kimi-tp2-mini"])
def test_killed_worker_fails_the_stream_fast(tmp_path, profile):
    server = TPServer(profile, tmp_path / "home")
    children = psutil.Process(server.proc.pid).children(recursive=True)
    worker = server.status()["tensor_parallel"]["worker_pids"][0]
    tail, seconds = _stream_until_error(server.url, worker, signal.SIGKILL)
    assert seconds < 10, seconds
    assert "tensor parallelism failed: rank 1 stopped (exit code -9)" in tail, tail[-500:]
    assert str(tmp_path) not in tail and "rank1.log" not in tail  # the worker's log stays on the server
    _assert_clean_exit(server, children)
    assert "rank1.log" in server.log.read_text()


def test_stuck_worker_hits_the_step_deadline(tmp_path):
    server = TPServer(_profile_with(tmp_path, "tiny-tp2", step_timeout_s=2.0), tmp_path / "home")
    children = psutil.Process(server.proc.pid).children(recursive=True)
    worker = server.status()["tensor_parallel"]["worker_pids"][0]
    try:
        tail, seconds = _stream_until_error(server.url, worker, signal.SIGSTOP)
        assert seconds < 10, seconds
        assert "deadline" in tail, tail[-500:]
        _assert_clean_exit(server, children)
    finally:
        for child in children:
            if child.is_running():
                child.kill()


HANDSHAKE = """
import sys, macspec
from macspec.config import load_profile
from macspec.distributed.bootstrap import join_group
from macspec.distributed.handshake import handshake, identity, HandshakeError
import json
rank, profile = int(sys.argv[1]), sys.argv[2]
group = join_group(json.loads(sys.argv[3]), rank)
try:
    handshake(group, identity(load_profile(profile)))
    print("OK")
except HandshakeError as err:
    print("REFUSED", err)
"""


@pytest.mark.parametrize("worker_profile, field", [("tiny-mtp-tp2", "profile"),
                                                   ("MODEL", "model files")])
def test_handshake_refuses_mismatched_peers(tmp_path, worker_profile, field):
    if worker_profile == "MODEL":  # same profile text, other model directory
        worker_profile = str(tmp_path / "tiny-tp2.toml")
        (tmp_path / "tiny-tp2.toml").write_text(
            find_profile("tiny-tp2").read_text().replace("embedded:tiny-target", "embedded:tiny-draft"))
    spec = json.dumps(group_spec(load_profile("tiny-tp2").parallel))
    procs = [subprocess.Popen([sys.executable, "-c", HANDSHAKE, str(rank), profile, spec],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, profile in ((0, "tiny-tp2"), (1, worker_profile))]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    for proc, out in zip(procs, outputs):
        assert "REFUSED" in out and f"rank 1 has {field}" in out, (proc.returncode, outputs)


def test_tp_structured_output_and_n_choices_equal_one_process(tp_server, single_server):
    """A grammar (the drafts synced once more to mask each window position) and n = 2 choices
    sharing their prompt's prefill (a mirrored prefix op) under TP: equal to one process."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
              "properties": {"name": {"type": "string", "maxLength": 10},
                             "size": {"type": "integer", "minimum": 0, "maximum": 99}}}
    body = {"prompt": "def describe(self):\n    return ", "max_tokens": 48, "temperature": 0, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            "speculative": {"method": "draft", "num_draft_tokens": 4, "adaptive": False}}
    tp = requests.post(tp_server.url + "/v1/completions", json=body, timeout=120).json()
    one = requests.post(single_server.url + "/v1/completions", json=body, timeout=120).json()
    texts = [c["text"] for c in tp["choices"]]
    assert texts == [c["text"] for c in one["choices"]] and texts[0] == texts[1]
    assert set(json.loads(texts[0])) == {"name", "size"}
    assert tp["macspec"]["spec"]["accepted"] > 0
