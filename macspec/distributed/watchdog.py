"""Rank 0's liveness guard: a deadline on every collective step, and an eye on peer processes.

A stuck collective cannot be interrupted, so the watchdog fails the in-flight requests itself
and tells the engine to stop; the daemon then exits non-zero for its supervisor.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.2


class Watchdog:
    def __init__(self, step_timeout_s: float, on_fatal: Callable[[str], None], peers=None):
        self.step_timeout_s = step_timeout_s
        self.on_fatal = on_fatal
        self.peers = peers
        self._armed: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._fired = False
        self._thread = threading.Thread(target=self._run, name="macspec-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @contextmanager
    def step(self, label: str):
        self._armed = (label, time.monotonic())
        try:
            yield
        finally:
            self._armed = None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            reason = self._check()
            if reason and not self._fired:
                self._fired = True
                self.on_fatal(reason)  # which logs it

    def _check(self) -> str | None:
        if self.peers is not None:
            exited = self.peers.first_exited()
            if exited:
                return exited
        armed = self._armed
        if armed and time.monotonic() - armed[1] > self.step_timeout_s:
            return (f"the {armed[0]} step passed its {self.step_timeout_s:g} s deadline: a peer is "
                    "stuck or the link is down (parallel.step_timeout_s)")
        return None
