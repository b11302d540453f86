"""`serve` in the foreground or detached, and `status` / `stop` for a detached daemon.

A running server records {pid, host, port, profile, log} in <state dir>/serve.json (state dir:
$MACSPEC_HOME/state, else platformdirs' user state dir); status and stop find it there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..config import HOME_ENV, Profile
from ..errors import MacspecError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # loading a large model can take minutes
STOP_TIMEOUT_S = 30.0


def state_dir() -> Path:
    home = os.environ.get(HOME_ENV)
    if home:
        path = Path(home) / "state"
    else:
        import platformdirs

        path = Path(platformdirs.user_state_dir("macspec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def pid_file() -> Path:
    return state_dir() / "serve.json"


def log_file() -> Path:
    return state_dir() / "serve.log"


def read_record() -> dict | None:
    """The running daemon's record, or None (a stale file of a dead process is removed)."""
    path = pid_file()
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(record.get("pid", -1)):
        path.unlink(missing_ok=True)
        return None
    return record


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError):
        return False


def serve_foreground(profile: Profile, host: str, port: int, api_key: str | None) -> None:
    from ..engine.launch import start_engine
    from .app import serve_forever

    existing = read_record()
    if existing and existing["pid"] != os.getpid():
        logger.warning("another macspec server is running (pid %d, port %d); `macspec stop` ends it",
                       existing["pid"], existing["port"])
    engine = start_engine(profile)
    record_path = pid_file()

    def on_ready(bound_port: int) -> None:
        record = {"pid": os.getpid(), "host": host, "port": bound_port, "profile": profile.name,
                  "log": str(log_file()), "started": time.time(), "auth": bool(api_key)}
        record_path.write_text(json.dumps(record))

    try:
        asyncio.run(serve_forever(engine, profile, host, port, api_key, on_ready))
    finally:
        record = read_record()
        if record and record["pid"] == os.getpid():
            record_path.unlink(missing_ok=True)
        engine.stop()
    if not engine.alive and engine.degraded_reason:
        raise MacspecError(f"the engine failed: {engine.degraded_reason}")


def serve_detached(argv: list[str], api_key: str | None) -> dict:
    """Start `macspec serve` (argv without --detach) in a new session; wait until it listens."""
    if read_record():
        raise MacspecError(f"a macspec server is already running ({describe(read_record())}); "
                           "`macspec stop` ends it")
    log = log_file()
    env = dict(os.environ)
    if api_key:
        env["MACSPEC_API_KEY"] = api_key  # not on the command line, where `ps` would show it
    with open(log, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "macspec", "serve", *argv], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        record = read_record()
        if record and record["pid"] == child.pid:
            return record
        if child.poll() is not None:
            raise MacspecError(f"the server exited with code {child.returncode} while starting; "
                               f"log {log}:\n{tail(log)}")
        time.sleep(0.2)
    child.terminate()
    raise MacspecError(f"the server did not start within {START_TIMEOUT_S:.0f} s; log {log}")


def describe(record: dict) -> str:
    return (f"pid {record['pid']}, http://{record['host']}:{record['port']}, "
            f"profile {record['profile']}, log {record['log']}")


def query_status(record: dict, api_key: str | None) -> dict:
    host = "127.0.0.1" if record["host"] in ("0.0.0.0", "::") else record["host"]
    req = urllib.request.Request(f"http://{host}:{record['port']}/v1/status")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raise MacspecError(f"the server answered {err.code} to /v1/status"
                           + (" (set MACSPEC_API_KEY)" if err.code == 401 else "")) from None
    except OSError as err:
        raise MacspecError(f"the server (pid {record['pid']}) does not answer: {err}") from None


def stop_daemon() -> dict | None:
    record = read_record()
    if record is None:
        return None
    pid = record["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        logger.warning("pid %d ignored SIGTERM for %.0f s; killing it", pid, STOP_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)
    pid_file().unlink(missing_ok=True)
    return record


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
