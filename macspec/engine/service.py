"""The engine for `serve`: one thread owns it (all MLX work), fed through a small queue API.

submit()/cancel()/status() may be called from any thread: they go through an inbox the engine
thread drains between steps, so the engine itself stays single-threaded. A step that raises
fails the requests it concerns, never leaves one waiting; under tensor parallelism it is fatal
(the ranks may be out of lock-step) and the daemon exits for its supervisor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout

from ..errors import EngineUnavailableError, MacspecError, QueueFullError
from .engine import Engine
from .request import Accepted, Failed, Finished, GenerationRequest, emit_safely

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
HEARTBEAT_S = 1.0  # tensor parallelism: an idle rank 0 proves itself alive this often
STATUS_WAIT_S = 0.5  # then the last full status with live queue lengths (a long prefill step)


class EngineService:
    def __init__(self, engine: Engine, max_queue: int | None = None):
        self.engine = engine
        self.runtime = engine.runtime
        self.max_queue = max_queue or engine.runtime.profile.server.max_queue
        self.degraded_reason: str | None = None
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_status: dict | None = None
        self._in_flight: set[int] = set()  # submitted, not yet finished or failed
        engine.on_fatal = self._wake.set  # an idle loop notices a watchdog's verdict at once

    # ---- any thread ------------------------------------------------------------------------
    def start(self, calibrate: bool = True) -> None:
        if calibrate:
            self.engine.calibrate()
        self._thread = threading.Thread(target=self._loop, name="macspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2.0 if self.fatal_reason else timeout)
        # A thread stuck in a collective cannot say goodbye: the peers are reaped instead.
        self.engine.close(clean=not self._thread_alive())

    @property
    def fatal_reason(self) -> str | None:
        return self.engine.fatal_reason

    @property
    def alive(self) -> bool:
        return (self._thread_alive() and not self._stopping and self.engine.fatal_reason is None)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, *requests: GenerationRequest) -> None:
        """Queue requests together: the engine takes them in the same step (so the choices of
        one request are admitted together and share their prompt's prefill)."""
        if not self.alive:
            raise EngineUnavailableError("the engine is not running")
        with self._lock:
            # Counted here, not from the engine's lists, so a verdict never depends on how far
            # the engine thread has got with earlier requests: beyond the batch's rows, they wait.
            queued = len(self._in_flight) + len(requests) - self.engine.max_batch
            if queued > self.max_queue:
                self.engine.stats.count("rejected", len(requests))
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting); retry later")
            for request in requests:
                self._track(request)
                self._inbox.append((self._add, request))
        self._wake.set()

    def _track(self, request: GenerationRequest) -> None:
        """Count the request until its last event (the sink is wrapped to see it)."""
        self._in_flight.add(request.id)
        sink = request.sink

        def tracked(event) -> None:
            if isinstance(event, (Finished, Failed)):
                with self._lock:
                    self._in_flight.discard(request.id)
            sink(event)

        request.sink = tracked

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        with self._lock:
            self._inbox.append((self._cancel, (request_id, reason)))
        self._wake.set()

    def status(self) -> dict:
        """The engine's status, taken by the engine thread between steps."""
        if self._thread_alive() and threading.current_thread() is not self._thread:
            future: Future = Future()
            with self._lock:
                self._inbox.append((self._status, future))
            self._wake.set()
            try:
                body = self._last_status = future.result(STATUS_WAIT_S)
            except FutureTimeout:  # inside a long step (or a stuck collective)
                if self._last_status is None:
                    body = self._last_status = self.engine.status()
                else:
                    body = {**self._last_status, **self.engine.live_counts, "stale": True}
        else:
            body = self.engine.status()
        return {"state": "running" if self.alive else "stopped",
                "degraded_reason": self.degraded_reason or self.engine.fatal_reason,
                "max_queue": self.max_queue, **body}

    # ---- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping and engine.fatal_reason is None:
            try:
                self._drain_inbox()
                if not engine.has_work:
                    engine.idle(HEARTBEAT_S)
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                engine.step()
                self.degraded_reason = None
            except Exception as exc:  # an engine bug must fail requests, never hang them
                if engine.tp is not None:  # the ranks may no longer be in lock-step
                    logger.error("tensor-parallel engine step failed", exc_info=exc)
                    engine.fatal(self._explain_tp_failure(exc))
                    break
                logger.exception("engine step failed")
                self.degraded_reason = f"last step failed: {exc!r}"
                engine.fail_running(exc)
        self._drain_inbox()
        engine.fail_all(EngineUnavailableError(
            f"tensor parallelism failed: {engine.fatal_reason}" if engine.fatal_reason
            else "the server is shutting down"))

    def _explain_tp_failure(self, exc: Exception) -> str:
        """A lost link usually means a dead peer: name it (and its exit code) when one exits;
        the link's own error is in the server log (the caller logs it), not in the clients'."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            exited = self.engine.tp.peers.first_exited()
            if exited:
                return exited
            time.sleep(0.05)
        return str(exc)

    def _drain_inbox(self) -> None:
        """Run what other threads queued (each entry: a handler below and its payload)."""
        while True:
            with self._lock:
                if not self._inbox:
                    return
                handle, payload = self._inbox.popleft()
            handle(payload)

    def _add(self, request: GenerationRequest) -> None:
        try:
            self.engine.add_request(request)
        except MacspecError as err:
            emit_safely(request, Failed(err))
            return
        emit_safely(request, Accepted())

    def _cancel(self, payload: tuple[int, str]) -> None:
        self.engine.cancel(*payload)

    def _status(self, future: Future) -> None:
        try:
            future.set_result(self.engine.status())
        except Exception as exc:
            future.set_exception(exc)
