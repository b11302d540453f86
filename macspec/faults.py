"""Faults the engine survives, and a way to cause them on purpose.

Speculation is bookkeeping around the target: the policy, an acceptance estimate or a proposer that raises
must cost that row its speculation for the step, never the request. `SpecFaults` counts such
faults (shown in /v1/status and /metrics) and logs each kind once with its cause.

`arm(point, error)` makes the engine raise `error` the next time it reaches `point` (fault
injection for tests and chaos drills); an unarmed point costs one dict lookup. A daemon takes
them from MACSPEC_INJECT_FAULTS="point[:times],..." at start.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

# Where the engine checks for injected faults.
POINTS = ("plan", "proposer_start", "propose", "proposer_observe", "acceptance", "cost_model", "admit", "prefill",
          "decode")

_armed: dict[str, list] = {}
_armed_lock = threading.Lock()


def arm(point: str, error: BaseException, times: int = 1) -> None:
    """Raise `error` at the next `times` passes through `point`."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; one of {', '.join(POINTS)}")
    with _armed_lock:
        _armed[point] = [error, times]


ENV = "MACSPEC_INJECT_FAULTS"


def arm_from_env() -> None:
    """Arm the faults named in MACSPEC_INJECT_FAULTS (each raises RuntimeError)."""
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        point, _, times = item.partition(":")
        arm(point, RuntimeError(f"injected fault at {point}"), int(times or 1))
        logger.warning("fault injection armed: %s x%s (%s)", point, times or 1, ENV)


def disarm_all() -> None:
    with _armed_lock:
        _armed.clear()


def check(point: str) -> None:
    if not _armed:
        return
    with _armed_lock:
        entry = _armed.get(point)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _armed[point]
    raise entry[0]


class SpecFaults:
    """Counts speculation-bookkeeping faults by source; logs each (source, error type) once."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.last: str | None = None
        self._logged: set[tuple[str, str]] = set()

    def record(self, source: str, exc: BaseException) -> None:
        self.counts[source] = self.counts.get(source, 0) + 1
        self.last = f"{source}: {exc!r}"[:300]
        key = (source, type(exc).__name__)
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("speculation fault in %s: %r; the row decodes plainly for this step "
                           "(logged once per kind, counted in /v1/status)", source, exc, exc_info=exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        return {"total": self.total, "by_source": dict(self.counts), "last": self.last}
