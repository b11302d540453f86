"""A real macspec server on a free port: inside the test process (aiohttp + engine thread), or
as a `macspec serve` child process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from macspec.config import load_profile
from macspec.engine.engine import Engine
from macspec.engine.service import EngineService
from macspec.engine.runtime import Runtime
from macspec.server.app import serve_forever


class RunningServer:
    def __init__(self, runtime: Runtime, api_key: str | None = None, max_batch: int | None = None,
                 max_queue: int | None = None):
        self.runtime = runtime
        self.engine = EngineService(Engine(runtime, max_batch=max_batch), max_queue=max_queue)
        self.api_key = api_key
        self.port = None
        self._ready = threading.Event()
        self._loop = None
        self._stop = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def ready(port):
                self.port = port
                self._ready.set()

            await serve_forever(self.engine, self.runtime.profile, "127.0.0.1", 0, self.api_key,
                                ready, self._stop)

        asyncio.run(main())

    def __enter__(self) -> "RunningServer":
        self.engine.start()
        self._thread.start()
        assert self._ready.wait(30), "server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def runtime_with(profile_name: str = "tiny", **overrides) -> Runtime:
    profile = load_profile(profile_name)
    for key, value in overrides.items():
        profile.override(key.replace("__", "."), value, "test")
    return Runtime.load(profile)


def records(home: Path) -> dict[int, dict]:
    """pid -> record, from <home>/state/servers/*.json."""
    out = {}
    for path in (home / "state" / "servers").glob("*.json"):
        record = json.loads(path.read_text())
        out[record["pid"]] = record
    return out


def has_ended(proc: psutil.Process | int) -> bool:
    """Whether a process (or pid) has exited: gone, or a zombie whose exit status waits for a
    parent that may be slow to reap it (an orphan's is this machine's PID 1; a full suite here once
    saw one still unreaped after 2 s)."""
    try:
        proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Foreground:
    """`python -m macspec serve` as a child, as a terminal would run it."""

    def __init__(self, home: Path, *args: str, env: dict | None = None):
        self.home = home
        self.log = home.parent / f"fg-{time.time_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "macspec", "serve", "--port", "0", *args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            self.record = records(home).get(self.proc.pid)
            if self.record:
                self.url = f"http://127.0.0.1:{self.record['port']}"
                return
            time.sleep(0.1)
        self.proc.kill()
        raise AssertionError(f"not ready: {self.log.read_text()}")

    def wait(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
