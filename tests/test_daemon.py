"""serve (foreground and --detach), status, stop as a user runs them: real processes, real ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import requests

from .serverutil import Foreground, has_ended, records

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

KEY = "sk-daemon"


def macspec(*args, env=None, timeout=300, cwd=None):
    return subprocess.run([sys.executable, "-P", "-m", "macspec", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=cwd)


def wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        if has_ended(pid):
            return
        time.sleep(0.05)
    assert not psutil.pid_exists(pid), f"pid {pid} still running"


# ---- checks before anything loads ---------------------------------------------------------
@pytest.mark.parametrize("detach", [False, True])
def test_port_in_use_is_one_line_before_loading(isolated_home, detach):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        result = macspec("serve", "--port", str(port), *(["--detach"] if detach else []))
        seconds = time.monotonic() - t0
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"Error: 127.0.0.1:{port} is in use (by pid {os.getpid()}); choose --port\n"
    assert seconds < 20  # no model was loaded
    logs = isolated_home / "state" / "logs"
    assert not logs.is_dir() or not any(logs.iterdir())  # nothing was spawned


@pytest.mark.parametrize("how", ["flag", "env"])
def test_empty_api_key_is_refused(isolated_home, how):
    env = dict(os.environ)
    args = ["serve", "--port", "0"]
    if how == "flag":
        args += ["--api-key", ""]
    else:
        env["MACSPEC_API_KEY"] = ""
    result = macspec(*args, env=env, timeout=60)
    assert result.returncode == 1, result.stderr
    name = "--api-key" if how == "flag" else "MACSPEC_API_KEY"
    assert result.stderr.startswith(f"Error: {name} is") and "empty" in result.stderr
    assert "loaded" not in result.stderr and not records(isolated_home)


# ---- records that no longer name their server ----------------------------------------------
def test_stale_records_are_removed_and_never_signalled(isolated_home):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        servers = isolated_home / "state" / "servers"
        servers.mkdir(parents=True)
        created = psutil.Process(bystander.pid).create_time()
        base = {"host": "127.0.0.1", "profile": "tiny", "name": None, "log": None, "started": 0,
                "detached": True, "auth": False}
        cases = {  # port -> (pid, create_time)
            40001: (bystander.pid, created - 3600),  # the pid was reused by another process
            40002: (bystander.pid, created),  # right start time, but not `macspec serve`
            40003: (2**22 + 17, created),  # no such process
        }
        for port, (pid, ctime) in cases.items():
            (servers / f"{port}.json").write_text(json.dumps({**base, "pid": pid, "port": port,
                                                              "create_time": ctime}))
        targeted = macspec("stop", "--port", "40001")
        assert targeted.returncode == 1
        assert "removed a stale server record: port 40001: pid" in targeted.stderr
        assert "no macspec server with port 40001 is running" in targeted.stderr
        assert "port 40002: pid" in targeted.stderr and "not macspec serve" in targeted.stderr
        assert "port 40003: pid" in targeted.stderr
        plain = macspec("stop")
        assert plain.returncode == 1 and plain.stderr == "Error: no macspec server is running\n"
        assert bystander.poll() is None, "a stale record's pid was signalled"
        assert not list(servers.glob("*.json"))
        assert macspec("status").stdout.startswith("no servers running")
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_without_server(isolated_home):
    result = macspec("stop")
    assert result.returncode == 1 and "no macspec server is running" in result.stderr


# ---- detached servers --------------------------------------------------------------------------
def test_several_detached_servers_by_port_and_name(isolated_home, tmp_path):
    """Two daemons at once, one started from a directory whose macspec/ folder would shadow the
    package (the daemon must still start), addressed by --name and --port."""
    env = dict(os.environ, MACSPEC_API_KEY=KEY)
    shadow = tmp_path / "cwd"
    (shadow / "macspec").mkdir(parents=True)
    (shadow / "macspec" / "__init__.py").write_text("raise ImportError('shadowed macspec')\n")
    alpha = macspec("serve", "--detach", "--port", "0", "--name", "alpha", env=env, cwd=shadow)
    assert alpha.returncode == 0, alpha.stderr
    assert "serving in the background" in alpha.stdout and "name alpha" in alpha.stdout
    beta = macspec("serve", "--detach", "--port", "0", env=env)
    assert beta.returncode == 0, beta.stderr
    found = records(isolated_home)
    assert len(found) == 2
    a = next(r for r in found.values() if r["name"] == "alpha")
    b = next(r for r in found.values() if r["name"] is None)
    logs = isolated_home / "state" / "logs"
    try:
        assert a["port"] != b["port"]
        assert (isolated_home / "state" / "servers" / f"{a['port']}.json").is_file()
        assert a["log"] == str(logs / "alpha.log") and b["log"] == str(logs / f"{b['port']}.log")
        for r in (a, b):
            assert r["host"] == "127.0.0.1" and r["auth"] is True and r["detached"] is True
            assert r["create_time"] == pytest.approx(psutil.Process(r["pid"]).create_time(), abs=1)
            assert KEY not in " ".join(psutil.Process(r["pid"]).cmdline())
            url = f"http://127.0.0.1:{r['port']}"
            assert requests.get(url + "/health", timeout=5).json() == {"status": "ok"}
            assert requests.get(url + "/v1/models", timeout=5).status_code == 401

        same_port = macspec("serve", "--detach", "--port", str(a["port"]), env=env)
        assert same_port.returncode == 1
        assert same_port.stderr == (f"Error: 127.0.0.1:{a['port']} is in use (by pid {a['pid']}); "
                                    "choose --port\n")
        same_name = macspec("serve", "--detach", "--port", "0", "--name", "alpha", env=env)
        assert same_name.returncode == 1 and "named 'alpha' is already running" in same_name.stderr

        listing = macspec("status", env=env)
        assert listing.returncode == 0, listing.stderr
        assert f"running: pid {a['pid']}" in listing.stdout and f"running: pid {b['pid']}" in listing.stdout
        every = json.loads(macspec("status", "--json", env=env).stdout)["servers"]
        assert sorted(s["daemon"]["pid"] for s in every) == sorted([a["pid"], b["pid"]])
        assert all(s["status"]["engine"]["state"] == "running" for s in every)
        one = json.loads(macspec("status", "--name", "alpha", "--json", env=env).stdout)
        assert one["daemon"]["pid"] == a["pid"] and one["status"]["engine"]["state"] == "running"
        by_port = macspec("status", "--port", str(b["port"]), env=env)
        assert by_port.stdout.startswith(f"running: pid {b['pid']}")

        ambiguous = macspec("stop", env=env)
        assert ambiguous.returncode == 1 and "several macspec servers are running" in ambiguous.stderr
        assert psutil.pid_exists(a["pid"]) and psutil.pid_exists(b["pid"])
        stopped = macspec("stop", "--name", "alpha", env=env)
        assert stopped.returncode == 0 and f"stopped pid {a['pid']}" in stopped.stdout
        wait_gone(a["pid"])
        assert psutil.pid_exists(b["pid"])
        last = macspec("stop", env=env)  # exactly one left: no flag needed
        assert last.returncode == 0 and f"stopped pid {b['pid']}" in last.stdout
        wait_gone(b["pid"])
    finally:
        macspec("stop", "--all", env=env)
    after = macspec("status", env=env)
    assert after.returncode == 0 and after.stdout.startswith("no servers running")
    assert not records(isolated_home)
    assert sorted(p.name for p in logs.iterdir()) == sorted(["alpha.log", f"{b['port']}.log"])
    for log in (logs / "alpha.log", logs / f"{b['port']}.log"):
        assert "shutting down" in log.read_text()


# ---- foreground servers: a requested stop is exit 0 -----------------------------------------
def test_sigterm_after_a_failed_step_exits_0_and_flag_key_warns(isolated_home):
    """The last engine step failed (an injected decode fault: /health is degraded), then a
    requested stop: exit 0 all the same (it was exit 1)."""
    env = dict(os.environ, MACSPEC_INJECT_FAULTS="decode:1")
    server = Foreground(isolated_home, "--api-key", KEY, env=env)
    assert server.record["log"] is None and server.record["detached"] is False
    auth = {"Authorization": f"Bearer {KEY}"}
    reply = requests.post(server.url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8},
                          headers=auth, timeout=60)
    assert reply.status_code >= 500 or "error" in reply.json(), reply.text
    health = requests.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and "last step failed" in health.json()["reason"]
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait() == 0, server.log.read_text()
    assert time.monotonic() - t0 < 10
    log = server.log.read_text()
    assert "visible to every user in `ps`" in log and "MACSPEC_API_KEY environment variable" in log
    assert not records(isolated_home)


def test_sigint_exits_0_and_open_bind_without_key_warns(isolated_home):
    server = Foreground(isolated_home, "--host", "0.0.0.0")
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    server.proc.send_signal(signal.SIGINT)
    assert server.wait() == 0, server.log.read_text()
    log = server.log.read_text()
    assert "WARNING" in log and "serving on 0.0.0.0 with NO API key" in log
    assert "export MACSPEC_API_KEY=" in log


def test_macspec_stop_port_ends_a_foreground_server_with_exit_0(isolated_home):
    server = Foreground(isolated_home, "--name", "term")
    port = server.record["port"]
    listing = macspec("status")
    assert listing.returncode == 0 and "foreground (logs to its terminal)" in listing.stdout
    refused = macspec("stop")  # a bare stop never ends a server someone runs in a terminal
    assert refused.returncode == 1 and "no detached macspec server is running" in refused.stderr
    assert server.proc.poll() is None
    stopped = macspec("stop", "--port", str(port))
    assert stopped.returncode == 0 and f"stopped pid {server.proc.pid}" in stopped.stdout
    assert server.wait() == 0, server.log.read_text()
    assert not records(isolated_home)


# ---- the first ten minutes: status with a key, Ctrl-C while starting ---------------------------
def test_status_lists_a_server_that_needs_a_key_without_failing(isolated_home):
    server = Foreground(isolated_home, env=dict(os.environ, MACSPEC_API_KEY=KEY))
    try:
        no_key = {k: v for k, v in os.environ.items() if k != "MACSPEC_API_KEY"}
        listing = macspec("status", env=no_key)
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.splitlines()[0].startswith(f"running: pid {server.proc.pid}")
        assert "needs MACSPEC_API_KEY" in listing.stdout and "not answering" not in listing.stdout
        one = json.loads(macspec("status", "--port", str(server.record["port"]), "--json", env=no_key).stdout)
        assert one["status"] is None and one["error"] is None and "MACSPEC_API_KEY" in one["needs_api_key"]
        wrong = macspec("status", env=dict(no_key, MACSPEC_API_KEY="sk-wrong"))
        assert wrong.returncode == 0 and "not this server's key" in wrong.stdout
        right = macspec("status", env=dict(no_key, MACSPEC_API_KEY=KEY))
        assert right.returncode == 0 and "requests: 0 running" in right.stdout
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log.read_text()


@pytest.fixture
def stalling_model(tmp_path):
    """The tiny target with a FIFO for tokenizer.json: loading it blocks until the test writes
    to it, so a server stays in start-up for as long as the test needs (no timing)."""
    from macspec.models.store import embedded_dir

    model = tmp_path / "stalling-model"
    model.mkdir()
    for source in (embedded_dir() / "tiny-target").iterdir():
        if source.name != "tokenizer.json":
            (model / source.name).symlink_to(source)
    os.mkfifo(model / "tokenizer.json")
    return model


def held_while_loading(proc: subprocess.Popen, model, timeout: float = 120.0) -> int:
    """Wait until `proc`'s server reads the FIFO (it is loading the model); -> the write end,
    held open so the read stays blocked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            writer = os.open(model / "tokenizer.json", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: nobody is reading it yet
            time.sleep(0.05)
            continue
        wait_blocked_in_read(proc.pid, deadline)
        return writer
    raise AssertionError("the server never started loading the model")


def wait_blocked_in_read(pid: int, deadline: float) -> None:
    """Until a process of `pid`'s tree sleeps in the FIFO's read. A signal that lands after the
    open but before the read starts is only noted, and the read then blocks through it (1 run in
    8 on a loaded machine); Linux says where a process sleeps, elsewhere this returns at once."""
    if not os.path.exists(f"/proc/{pid}/wchan"):
        return
    while time.monotonic() < deadline:
        tree = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
        if any(reading_a_pipe(member) for member in tree):
            return
        time.sleep(0.02)


def reading_a_pipe(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            place = f.read()
    except OSError:
        return False
    return "pipe_read" in place or place == "pipe_wait"  # the name differs between kernels


def sigint_as_in_a_terminal() -> None:
    """A child's SIGINT as a foreground job's: a suite run as a background job ignores SIGINT
    (the shell's rule for `&`), and its children inherit that, so Python never takes Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_a_detached_server_starts_stops_it(isolated_home, stalling_model):
    parent = subprocess.Popen([sys.executable, "-P", "-m", "macspec", "serve", "--detach", "--port", "0",
                               "--model", str(stalling_model)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal)
    writer = held_while_loading(parent, stalling_model)
    try:
        [child] = psutil.Process(parent.pid).children()
        assert "--daemon-log" in child.cmdline()
        parent.send_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
        out, err = parent.communicate(timeout=30)
        assert parent.returncode == 130, err
        assert err.splitlines()[-1].startswith(f"Error: interrupted: stopped the server that was "
                                               f"starting (pid {child.pid}); nothing is serving")
        assert "Aborted" not in err and "Traceback" not in err and out == ""
        wait_gone(child.pid)  # still inside its load, yet gone: it was stopped, not left to serve
        assert not records(isolated_home)
        assert macspec("status").stdout.startswith("no servers running")
    finally:
        os.close(writer)


def test_ctrl_c_while_a_foreground_server_starts_exits_0(isolated_home, stalling_model):
    proc = subprocess.Popen([sys.executable, "-P", "-m", "macspec", "serve", "--port", "0",
                             "--model", str(stalling_model)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_in_a_terminal)
    writer = held_while_loading(proc, stalling_model)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err  # a requested stop, as once serving
        assert "SIGINT while starting: stopped" in err
        assert "Aborted" not in err and "Traceback" not in err
        assert not records(isolated_home)
    finally:
        os.close(writer)
