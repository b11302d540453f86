"""A real macspec server (aiohttp + engine thread) on a free port, inside the test process."""

from __future__ import annotations

import asyncio
import threading

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
