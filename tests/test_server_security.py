"""A local server against web pages: Host names (DNS rebinding), JSON-only POST bodies (no
CORS-preflight-free text/plain posts), and a case-insensitive Bearer scheme."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from macspec.server.app import allowed_host_names

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

KEY = "sk-sec-1"
BODY = {"prompt": "x", "max_tokens": 1}
ANTHROPIC_BODY = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def server():
    runtime = runtime_with("tiny", server__allowed_hosts=["myllm.internal", "Box.LAN:9000"])
    with RunningServer(runtime, api_key=KEY) as srv:
        yield srv


def call(server, path="/v1/completions", body=BODY, host=None, content_type="application/json",
         auth=f"Bearer {KEY}", method="POST", data=None):
    headers = {"Authorization": auth}
    if host is not None:
        headers["Host"] = host
    if content_type is not None:
        headers["Content-Type"] = content_type
    if data is None and body is not None:
        data = json.dumps(body).encode()
    return requests.request(method, server.url + path, data=data if method == "POST" else None,
                            headers=headers, timeout=30)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "10.0.0.1", "0.0.0.0"])
def test_foreign_host_is_403(server, host):
    resp = call(server, host=host)
    assert resp.status_code == 403, resp.text
    error = resp.json()["error"]
    assert error["type"] == "forbidden_host" and "not allowed" in error["message"]
    assert call(server, "/v1/models", method="GET", host=host).status_code == 403
    assert call(server, "/health", method="GET", host=host).status_code == 403
    anthropic_style = call(server, "/v1/messages", ANTHROPIC_BODY, host=host)
    assert anthropic_style.status_code == 403
    body = anthropic_style.json()
    assert body["type"] == "error" and body["error"]["type"] == "permission_error"


def test_text_plain_from_a_foreign_host_is_not_served(server):
    """What a web page can send cross-origin without a preflight, via a rebound DNS name."""
    def engine_requests():
        return requests.get(server.url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"},
                            timeout=5).json()["engine"]["totals"]["requests"]

    before = engine_requests()
    resp = call(server, host="evil.example", content_type="text/plain")
    assert resp.status_code == 403
    assert call(server, content_type="text/plain").status_code == 415
    assert engine_requests() == before  # nothing reached the engine


def test_loopback_and_configured_hosts_are_served(server):
    port = server.port
    for host in ["localhost", f"localhost:{port}", "LOCALHOST", "127.0.0.1", f"127.0.0.1:{port}",
                 "[::1]", f"[::1]:{port}", "localhost.", "myllm.internal", f"myllm.internal:{port}",
                 "box.lan", "box.lan:1234"]:
        resp = call(server, host=host)
        assert resp.status_code == 200, (host, resp.text)


def test_raw_request_without_host_header_is_served(server):
    """HTTP/1.0 clients may send no Host at all; a browser always sends one."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    sock.close()
    assert data.startswith(b"HTTP/1.") and b" 200 " in data.split(b"\r\n")[0]


def test_host_check_only_on_loopback_binds():
    assert allowed_host_names("0.0.0.0", []) is None
    assert allowed_host_names("::", []) is None
    assert allowed_host_names("192.168.1.20", ["x"]) is None
    names = allowed_host_names("127.0.0.1", ["Model.Local:8000"])
    assert {"localhost", "127.0.0.1", "[::1]", "model.local"} <= names
    assert "[::1]" in allowed_host_names("::1", [])
    assert "localhost" in allowed_host_names("localhost", [])


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx",
                                          "text/json"])
def test_post_needs_a_json_content_type(server, content_type):
    resp = call(server, content_type=content_type)
    assert resp.status_code == 415, resp.text
    error = resp.json()["error"]
    assert "application/json" in error["message"] and error["type"] == "unsupported_media_type"
    anthropic_style = call(server, "/v1/messages", ANTHROPIC_BODY, content_type=content_type)
    assert anthropic_style.status_code == 415
    body = anthropic_style.json()
    assert body["type"] == "error" and "application/json" in body["error"]["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json",
                                          "application/merge-patch+json; charset=UTF-8"])
def test_json_content_types_are_accepted(server, content_type):
    assert call(server, content_type=content_type).status_code == 200


def test_unknown_routes_stay_404_whatever_the_content_type(server):
    resp = call(server, "/v1/nope", content_type="text/plain")
    assert resp.status_code == 404 and "no route" in resp.json()["error"]["message"]


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(server, scheme):
    assert call(server, auth=f"{scheme} {KEY}").status_code == 200
    assert call(server, auth=f"{scheme}  {KEY} ").status_code == 200
    assert call(server, auth=f"{scheme} sk-wrong").status_code == 401


def test_other_schemes_and_bare_keys_are_refused(server):
    for auth in [f"Basic {KEY}", KEY, f"Token {KEY}", "bearer", ""]:
        assert call(server, auth=auth).status_code == 401, auth
