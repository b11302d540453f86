"""Start-up phases (model load, tensor-parallel group, calibration): each is logged at info
with its duration and, when stderr is a terminal and the command asked for it, shown as one
live status line there, so a user never stares at a silent prompt for seconds."""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("macspec.startup")

_live = False
timings: list[tuple[str, float]] = []  # (phase, seconds) in the order they ran: `run --json`


def show_on_terminal(enabled: bool = True) -> None:
    """Called by the CLI (not with --json): live lines only if stderr is a terminal."""
    global _live
    _live = enabled and sys.stderr.isatty()


@contextmanager
def phase(what: str):
    started = time.perf_counter()
    logger.info("%s…", what)
    if _live:
        sys.stderr.write(f"\r\033[K{what}…")
        sys.stderr.flush()
    try:
        yield
    finally:
        seconds = time.perf_counter() - started
        timings.append((what, seconds))
        logger.info("%s: %.2f s", what, seconds)
        if _live:
            sys.stderr.write(f"\r\033[K{what}: {seconds:.1f} s")
            sys.stderr.flush()


def clear() -> None:
    """Remove the live line (before the output it was waiting for)."""
    if _live:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def process_seconds() -> float:
    """Wall seconds since this process was exec'd. Linux: from /proc in clock ticks (psutil's
    create_time rounds the boot time to whole seconds there)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()
