"""serve --detach, status, stop as a user runs them: real processes, a real port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import requests


def macspec(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "macspec", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_detach_status_stop(isolated_home):
    env = dict(os.environ, MACSPEC_API_KEY="sk-daemon")
    started = macspec("serve", "--detach", "--port", "0", "--log-level", "info", env=env)
    assert started.returncode == 0, started.stderr
    assert "serving in the background" in started.stdout
    record = json.loads((isolated_home / "state" / "serve.json").read_text())
    assert record["host"] == "127.0.0.1" and record["auth"] is True  # loopback by default
    url = f"http://127.0.0.1:{record['port']}"
    try:
        assert requests.get(url + "/health", timeout=5).json() == {"status": "ok"}
        assert requests.get(url + "/v1/models", timeout=5).status_code == 401
        status = macspec("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["status"]["engine"]["state"] == "running"
        assert "running: pid" in macspec("status", env=env).stdout
        assert "sk-daemon" not in " ".join(psutil.Process(record["pid"]).cmdline())
    finally:
        stopped = macspec("stop", env=env)
    assert stopped.returncode == 0 and f"stopped pid {record['pid']}" in stopped.stdout
    deadline = time.monotonic() + 10
    while psutil.pid_exists(record["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(record["pid"])
    after = macspec("status", env=env)
    assert after.returncode == 1 and "no macspec server is running" in after.stderr
    assert "shutting down" in (isolated_home / "state" / "serve.log").read_text()


def test_stop_without_server(isolated_home):
    result = macspec("stop")
    assert result.returncode == 1 and "no macspec server is running" in result.stderr
