"""Connections a client never finishes (slowloris), more connections than allowed or than the
process has file descriptors: the server closes what it must, keeps answering /health, and
logs a line, not a traceback per accept retry."""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

PARTIAL = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


def _connect(port: int, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if payload:
        sock.sendall(payload)
    return sock


def _open_many(port: int, count: int, within_s: float = 15.0) -> list[socket.socket]:
    """`count` connections opened at once (a full accept queue costs a connect a 1 s SYN retry;
    in parallel those overlap)."""
    pending = {}
    selector = selectors.DefaultSelector()
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        pending[sock] = None
        selector.register(sock, selectors.EVENT_WRITE)
    opened, deadline = [], time.monotonic() + within_s
    while pending and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            sock = key.fileobj
            selector.unregister(sock)
            del pending[sock]
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                opened.append(sock)
            else:
                sock.close()
    for sock in pending:
        sock.close()
    selector.close()
    return opened


def _closed_by_server(socks: list[socket.socket], within_s: float) -> tuple[int, list[bytes]]:
    """How many of `socks` the server closed within `within_s` (and what they received)."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed, received = 0, []
    deadline = time.monotonic() + within_s
    pending = len(socks)
    while pending and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            except BlockingIOError:
                continue
            if data:
                received.append(data)
                continue
            selector.unregister(sock)
            closed += 1
            pending -= 1
    selector.close()
    return closed, received


def _health(url: str, timeout: float = 5.0) -> requests.Response:
    return requests.get(url + "/health", timeout=timeout)


@pytest.fixture(scope="module")
def quick_timeouts():
    runtime = runtime_with("tiny", server__idle_timeout_s=1.0, server__body_timeout_s=1.0)
    with RunningServer(runtime) as srv:
        yield srv


def test_slowloris_connections_are_closed_and_health_answers(quick_timeouts):
    socks = [_connect(quick_timeouts.port, PARTIAL) for _ in range(300)]
    try:
        started = time.monotonic()
        for _ in range(3):  # /health answers while they are all open
            resp = _health(quick_timeouts.url)
            assert resp.status_code == 200 and resp.json() == {"status": "ok"}
        for sock in socks[::10]:  # dribbling more header bytes does not extend the deadline
            sock.sendall(b"a")
        closed, _ = _closed_by_server(socks, within_s=8.0)
        assert closed == len(socks), f"{len(socks) - closed} slow connections still open"
        assert time.monotonic() - started < 8.0
    finally:
        for sock in socks:
            sock.close()
    assert _health(quick_timeouts.url).json() == {"status": "ok"}


def test_idle_keepalive_connection_is_closed(quick_timeouts):
    sock = _connect(quick_timeouts.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        closed, received = _closed_by_server([sock], within_s=6.0)
        assert b"".join(received).startswith(b"HTTP/1.1 200")
        assert closed == 1
    finally:
        sock.close()


def test_slow_body_gets_408(quick_timeouts):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = _connect(quick_timeouts.port, head + body[:5])
    try:
        closed, received = _closed_by_server([sock], within_s=6.0)
        reply = b"".join(received)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"did not arrive" in reply and closed == 1
    finally:
        sock.close()
    assert _health(quick_timeouts.url).status_code == 200


def test_connection_cap_closes_idle_ones_then_refuses_with_503():
    runtime = runtime_with("tiny", server__max_connections=16, server__body_timeout_s=60.0)
    with RunningServer(runtime) as srv:
        idle = [_connect(srv.port) for _ in range(60)]
        try:
            time.sleep(0.3)
            for _ in range(5):  # room is made by closing the oldest idle connections
                assert _health(srv.url).json() == {"status": "ok"}
            closed, _ = _closed_by_server(idle, within_s=3.0)
            assert closed >= 60 - 16, closed
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.3)
        # 16 connections busy (uploading a body slowly) fill the table: a newcomer gets a 503.
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100\r\n\r\n{")
        busy = [_connect(srv.port, head) for _ in range(16)]
        try:
            time.sleep(0.5)
            resp = _health(srv.url)
            assert resp.status_code == 503 and resp.headers["Retry-After"]
            assert "too many open connections" in resp.json()["error"]["message"]
        finally:
            for sock in busy:
                sock.close()
        time.sleep(0.3)
        assert _health(srv.url).json() == {"status": "ok"}


SERVE_WITH_LOW_FILE_LIMIT = r"""
import asyncio, logging, resource, sys
import macspec
from macspec.config import load_profile
from macspec.engine.engine import Engine
from macspec.engine.service import EngineService
from macspec.engine.runtime import Runtime
from macspec.server.app import serve_forever

# After the imports: mlx_lm sets its own limit (2048, 4096) when imported. A hard limit this low
# cannot be raised by the server.
resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))
logging.basicConfig(level=logging.INFO, stream=sys.stderr)

engine = EngineService(Engine(Runtime.load(load_profile("tiny"))))
engine.start()

def ready(port):
    if LOWER_TO:  # now the connection cap (from FILE_LIMIT) exceeds what accept() can open
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOWER_TO, FILE_LIMIT))
    print(port, flush=True)

asyncio.run(serve_forever(engine, engine.runtime.profile, "127.0.0.1", 0, None, ready))
"""


def _serve_in_subprocess(log: Path, limit: int, lower_to: int = 0) -> subprocess.Popen:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4 * limit:
        pytest.skip("the test process itself needs more file descriptors")
    if soft < 4 * limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    script = (SERVE_WITH_LOW_FILE_LIMIT.replace("FILE_LIMIT", str(limit))
              .replace("LOWER_TO", str(lower_to)))
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_more_connections_than_file_descriptors(tmp_path: Path):
    limit = 256
    log = tmp_path / "serve.log"
    proc = _serve_in_subprocess(log, limit)
    socks: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), log.read_text()[-3000:]
        url = f"http://127.0.0.1:{int(line)}"
        assert _health(url).status_code == 200
        socks = _open_many(int(line), 3 * limit)  # idle, far more than the server has descriptors
        assert len(socks) > limit
        for _ in range(10):
            resp = _health(url, timeout=5)
            assert resp.status_code in (200, 503), resp.text
        deadline = time.monotonic() + 10
        while _health(url).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _health(url).json() == {"status": "ok"}
        time.sleep(2.5)  # asyncio retries a failed accept every second
        assert _health(url).json() == {"status": "ok"}
        text = log.read_text(errors="replace")
        assert log.stat().st_size < 20_000, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


def test_failed_accepts_are_logged_once_a_minute(tmp_path: Path):
    """Out of descriptors anyway (here: the limit lowered under the server's feet): asyncio
    retries accept() every second and reports each failure; the log gets one warning."""
    log = tmp_path / "serve.log"
    proc = _serve_in_subprocess(log, 256, lower_to=40)
    socks: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), log.read_text()[-3000:]
        socks = _open_many(int(line), 120, within_s=3.0)
        time.sleep(2.0)  # five accept retries in all
        text = log.read_text(errors="replace")
        assert text.count("cannot accept connections") == 1, text[-3000:]
        assert "Traceback" not in text and log.stat().st_size < 20_000, text[-3000:]
        for sock in socks:  # descriptors come back: the server accepts again
            sock.close()
        socks = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if _health(f"http://127.0.0.1:{int(line)}", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not recover: " + log.read_text()[-3000:])
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
