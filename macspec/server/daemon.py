"""`serve` in the foreground or detached, and `status` / `stop` for the servers a user runs.

Every running server (foreground or detached) keeps one record, <state dir>/servers/<port>.json
(state dir: $MACSPEC_HOME/state, else platformdirs' user state dir): pid, host, port, profile,
model, name, log (None for a foreground server, which logs to its terminal), started, the
process's create_time and whether it is detached. A record is trusted only while its pid is
still that process (same create_time, a `macspec ... serve` command line); otherwise it is stale,
removed, and its pid is never signalled. Detached servers log to <state dir>/logs/<name or
port>.log. Ctrl-C while `serve --detach` waits for its server stops that server (exit 130);
Ctrl-C while a foreground server starts is a requested stop (exit 0), as once it serves.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..config import Profile
from ..paths import state_dir
from ..errors import MacspecError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # loading a large model can take minutes
STOP_TIMEOUT_S = 30.0
# A server still starting ends on SIGTERM at once (no handler yet); one that has just come up
# drains its (empty) queue well within this.
ABANDON_GRACE_S = 10.0
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report a command ended by Ctrl-C
# psutil derives create_time from the boot time, which Linux reports to the second and NTP can
# move: the same process may read a few ms to 1 s apart from two processes.
CREATE_TIME_TOLERANCE_S = 1.0
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def servers_dir() -> Path:
    path = state_dir() / "servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def logs_dir() -> Path:
    path = state_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_path(name: str | None, port: int) -> Path:
    """Where a detached server logs: logs/<name>.log, else logs/<port>.log."""
    return logs_dir() / f"{name or port}.log"


def check_name(name: str | None) -> None:
    if name is not None and (not name or set(name) - NAME_CHARS or name.startswith(".")):
        raise MacspecError(f"--name {name!r}: use letters, digits, '.', '_' and '-'")


# ---- records --------------------------------------------------------------------------------
def _record_files() -> list[Path]:
    return sorted(servers_dir().glob("*.json"))


def verify(record: dict):
    """The psutil.Process of the record's server, or a reason the record is stale (a str)."""
    import psutil

    pid = record.get("pid")
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return f"pid {pid} has exited"
        created = proc.create_time()
    except (psutil.NoSuchProcess, TypeError, ValueError):
        return f"pid {pid} is not running"
    except psutil.Error as err:
        return f"pid {pid} cannot be inspected ({type(err).__name__})"
    recorded = record.get("create_time")
    if not isinstance(recorded, (int, float)) or abs(created - recorded) > CREATE_TIME_TOLERANCE_S:
        return f"pid {pid} is now another process (started {time.ctime(created)})"
    try:
        cmdline = proc.cmdline()
    except psutil.AccessDenied:
        return proc  # create_time matched; the command line is not ours to read
    except psutil.Error:
        return f"pid {pid} is not running"
    if not (any("macspec" in arg for arg in cmdline) and "serve" in cmdline):
        return f"pid {pid} is now {' '.join(cmdline)[:80]!r}, not macspec serve"
    return proc


def read_records() -> tuple[list[dict], list[str]]:
    """(records of the running servers, notes on the stale records just removed)."""
    live, stale = [], []
    for path in _record_files():
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except FileNotFoundError:
            continue  # its server just removed it
        except (OSError, ValueError) as err:
            path.unlink(missing_ok=True)
            stale.append(f"{path.name}: unreadable ({err})")
            continue
        found = verify(record)
        if isinstance(found, str):
            path.unlink(missing_ok=True)
            stale.append(f"port {record.get('port')}: {found}")
            continue
        record["record"] = str(path)
        live.append(record)
    live.sort(key=lambda r: (r.get("port") or 0, r.get("pid") or 0))
    return live, stale


def select(records: list[dict], port: int | None = None, name: str | None = None) -> dict:
    """The one server given by --port or --name."""
    wanted = [r for r in records if (port is None or r["port"] == port)
              and (name is None or r.get("name") == name)]
    if not wanted:
        what = " and ".join(x for x in (port is not None and f"port {port}",
                                        name is not None and f"name {name!r}") if x)
        raise MacspecError(f"no macspec server with {what} is running" + listing(records))
    if len(wanted) > 1:
        raise MacspecError("several macspec servers match; choose one with --port or --name"
                           + listing(wanted))
    return wanted[0]


def listing(records: list[dict]) -> str:
    if not records:
        return ""
    return "; running:\n" + "\n".join(f"  {describe(r)}" for r in records)


def _write_record(record: dict) -> Path:
    """servers/<port>.json (servers/<port>-<pid>.json when another host address holds the port)."""
    path = servers_dir() / f"{record['port']}.json"
    if path.exists():
        try:
            other = json.loads(path.read_text())
        except (OSError, ValueError):
            other = {}
        if other.get("pid") != record["pid"] and not isinstance(verify(other), str):
            path = servers_dir() / f"{record['port']}-{record['pid']}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def _remove_record(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass


def describe(record: dict) -> str:
    where = f"log {record['log']}" if record.get("log") else "foreground (logs to its terminal)"
    name = f", name {record['name']}" if record.get("name") else ""
    model = f", model {record['model']}" if record.get("model") else ""
    return (f"pid {record['pid']}, http://{_url_host(record['host'])}:{record['port']}, "
            f"profile {record['profile']}{model}{name}, {where}")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ---- the address --------------------------------------------------------------------------
def check_address(host: str, port: int) -> None:
    """Refuse, before any model is loaded, an address this server could not listen on."""
    where = f"{_url_host(host)}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise MacspecError(f"cannot listen on {where}: {err.strerror}; check --host") from None
    seen = set()
    for family, kind, proto, _, addr in infos:
        if (family, addr) in seen:
            continue
        seen.add((family, addr))
        with socket.socket(family, kind, proto) as sock:
            # As asyncio's create_server does: a port held only by TIME_WAIT connections is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE and port:
                    raise MacspecError(in_use_message(host, port)) from None
                raise MacspecError(f"cannot listen on {where}: {err.strerror or err}; "
                                   "check --host") from None


def in_use_message(host: str, port: int) -> str:
    pid = port_owner(port)
    by = f" (by pid {pid})" if pid else ""
    return f"{_url_host(host)}:{port} is in use{by}; choose --port"


def port_owner(port: int) -> int | None:
    """The pid listening on `port`, when this user may know it (best effort)."""
    import psutil

    def listening(conns) -> bool:
        return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in conns)

    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.pid and conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                return conn.pid
    except psutil.AccessDenied:  # macOS lists system-wide sockets only to root
        me = os.getuid()
        for proc in psutil.process_iter(["uids"]):
            try:
                uids = proc.info.get("uids")
                if uids and uids.real == me and listening(proc.net_connections(kind="inet")):
                    return proc.pid
            except (psutil.Error, OSError):
                continue
    except (psutil.Error, OSError):
        pass
    live, _ = read_records()
    return next((r["pid"] for r in live if r["port"] == port), None)


def check_name_free(name: str | None) -> None:
    if name is None:
        return
    live, _ = read_records()
    for record in live:
        if record.get("name") == name and record["pid"] != os.getpid():
            raise MacspecError(f"a macspec server named {name!r} is already running "
                               f"({describe(record)}); choose another --name")


# ---- serving --------------------------------------------------------------------------------
def serve_foreground(profile: Profile, host: str, port: int, api_key: str | None,
                     name: str | None = None, log: Path | None = None) -> None:
    """Serve until SIGTERM/SIGINT/`macspec stop` (then return: exit 0); raise (exit 1) only
    when the engine died on its own. `log`: this is a detached server writing to that file."""
    import psutil

    check_address(host, port)
    check_name_free(name)
    engine = _start_engine(profile)
    if engine is None:
        return
    record_path: list[Path] = []
    requested: list[str] = []  # the signal that asked us to stop
    engine_alive_at_request: list[bool] = []

    def on_ready(bound_port: int) -> None:
        log_file = None
        if log is not None:
            log_file = log_path(name, bound_port)
            if log != log_file:  # --port 0: the log started under a provisional name
                try:
                    os.replace(log, log_file)
                except OSError:
                    log_file = log
        record = {"pid": os.getpid(), "host": host, "port": bound_port, "profile": profile.name,
                  "model": profile.model.path, "name": name,
                  "log": str(log_file) if log_file else None, "started": time.time(),
                  "create_time": psutil.Process().create_time(), "detached": log is not None,
                  "auth": bool(api_key)}
        record_path.append(_write_record(record))

    async def run() -> None:
        from .app import serve_forever

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop(sig: signal.Signals) -> None:
            if not requested:
                requested.append(sig.name)
                engine_alive_at_request.append(engine.alive)
                logger.info("%s: stopping", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, request_stop, sig)
        await serve_forever(engine, profile, host, port, api_key, on_ready, stop)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:  # before the loop took SIGINT over
        requested.append("SIGINT")
        engine_alive_at_request.append(engine.alive)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:  # taken while the model loaded
            raise MacspecError(in_use_message(host, port)) from None
        raise
    finally:
        for path in record_path:
            _remove_record(path)
        engine.stop()
    if engine.fatal_reason:
        raise MacspecError(f"the engine failed: {engine.fatal_reason}")
    if not requested or not engine_alive_at_request[0]:
        reason = engine.degraded_reason or "the engine thread ended"
        raise MacspecError(f"the engine stopped on its own: {reason}")


def _start_engine(profile: Profile):
    """The engine, or None when Ctrl-C stopped its start-up: a requested stop, so exit 0 as
    once serving (start_engine ends what it started, TP ranks included, itself)."""
    try:
        from ..engine.launch import start_engine

        return start_engine(profile)
    except KeyboardInterrupt:
        logger.info("SIGINT while starting: stopped")
        return None


def _child_env(api_key: str | None) -> dict:
    import macspec

    env = dict(os.environ)
    if api_key:
        env["MACSPEC_API_KEY"] = api_key  # not on the command line, where `ps` would show it
    # The child starts in the state dir; a macspec imported from the current directory (a
    # checkout that is not installed) would not be found there, so name its folder.
    root = Path(macspec.__file__).resolve().parent.parent
    elsewhere = {Path(p).resolve() for p in sys.path[1:] if p}
    if root == Path.cwd().resolve() and root not in elsewhere:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return env


def serve_detached(argv: list[str], api_key: str | None, host: str, port: int,
                   name: str | None) -> dict:
    """Start `macspec serve ARGV` in a new session; wait until it listens; -> its record.

    It starts with the state dir as its working directory and (Python 3.11+) -P, so a folder
    named macspec/ in the user's directory cannot shadow the package; `--workdir` then takes it
    back to the user's directory, where relative profile and model paths resolve."""
    check_name(name)
    check_address(host, port)
    check_name_free(name)
    log = log_path(name, port) if port else logs_dir() / f"starting-{os.getpid()}-{time.time_ns()}.log"
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    command = [sys.executable, *safe_path, "-m", "macspec", "serve", *argv,
               "--workdir", os.getcwd(), "--daemon-log", str(log)]
    with open(log, "ab") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=_child_env(api_key),
                                 cwd=state_dir(), start_new_session=True)
    try:
        return _wait_listening(child, log)
    except KeyboardInterrupt:  # its own session: the terminal's Ctrl-C reached only us
        abandon(child.pid)
        raise StartInterrupted(f"interrupted: stopped the server that was starting (pid "
                               f"{child.pid}); nothing is serving; log {log}") from None


class StartInterrupted(MacspecError):
    """Ctrl-C while a detached server started: it was stopped; exit 130."""

    exit_code = INTERRUPTED_EXIT


def _wait_listening(child: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        live, _ = read_records()
        record = next((r for r in live if r["pid"] == child.pid), None)
        if record:
            return record
        if child.poll() is not None:
            raise MacspecError(f"the server exited with code {child.returncode} while starting; "
                               f"log {log}:\n{tail(log)}")
        time.sleep(0.2)
    abandon(child.pid)
    raise MacspecError(f"the server did not start within {START_TIMEOUT_S:.0f} s; log {log}")


def abandon(pid: int) -> None:
    """End a server we started and will not wait for, with everything it started (TP ranks):
    SIGTERM, SIGKILL after ABANDON_GRACE_S or a second Ctrl-C; then drop any record it wrote."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    _signal_all(procs, "terminate")
    try:
        _, alive = psutil.wait_procs(procs, timeout=ABANDON_GRACE_S)
    except KeyboardInterrupt:
        alive = procs
    if alive:
        _signal_all(alive, "kill")
        psutil.wait_procs(alive, timeout=5)
    for path in _record_files():
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue


def _signal_all(procs: list, how: str) -> None:
    import psutil

    for proc in procs:
        try:
            getattr(proc, how)()
        except psutil.NoSuchProcess:
            pass


class KeyRequired(MacspecError):
    """The server wants a Bearer key the client did not give (or gave wrong): it is up all the same."""


def query_status(record: dict, api_key: str | None) -> dict:
    host = record["host"]
    host = "127.0.0.1" if host == "0.0.0.0" else "::1" if host == "::" else host
    req = urllib.request.Request(f"http://{_url_host(host)}:{record['port']}/v1/status")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        if err.code == 401:
            raise KeyRequired("needs MACSPEC_API_KEY (its key) for load and speculation stats"
                              if not api_key else "refused MACSPEC_API_KEY: not this server's "
                              "key (401)") from None
        raise MacspecError(f"the server answered {err.code} to /v1/status") from None
    except OSError as err:
        raise MacspecError(f"the server (pid {record['pid']}) does not answer: {err}") from None


def stop_server(record: dict) -> str | None:
    """SIGTERM the record's server (SIGKILL after STOP_TIMEOUT_S); None once it is gone, or why
    the record was stale (then nothing was signalled and the record is removed)."""
    import psutil

    path = Path(record["record"]) if record.get("record") else None
    proc = verify(record)
    if isinstance(proc, str):
        if path:
            path.unlink(missing_ok=True)
        return proc
    try:
        proc.terminate()
        if not _wait_gone(proc, STOP_TIMEOUT_S):
            logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, STOP_TIMEOUT_S)
            proc.kill()
            _wait_gone(proc, 10)
    except psutil.NoSuchProcess:
        pass
    if path:
        path.unlink(missing_ok=True)
    return None


def _wait_gone(proc, timeout: float) -> bool:
    """Until the process has exited (a zombie its parent has yet to reap counts as exited)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
