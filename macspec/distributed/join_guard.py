"""Watches rank 0 while it sits in mx.distributed.init, which holds the GIL until every rank
has connected: no thread of rank 0 can notice a dead peer or a Ctrl-C meanwhile.

Run as a separate process (`python -I join_guard.py CONFIG`, standard library and psutil only,
so nothing in the working directory can shadow it). Rank 0 writes "done" on stdin when init
returns. Until then: a peer that exits, the deadline, or Ctrl-C -> print the reason on stderr,
kill the peers and rank 0 (which cannot be interrupted any other way). Rank 0 gone without
"done" -> kill the peers, which would otherwise wait in init forever.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

import psutil


def main() -> int:
    cfg = json.loads(sys.argv[1])
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(signal.SIGINT))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(signal.SIGTERM))
    deadline = time.monotonic() + cfg["timeout"]
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.1)
        if ready:
            if os.read(sys.stdin.fileno(), 64).startswith(b"done"):
                return 0
            _kill_peers(cfg)  # end of file: rank 0 died inside init
            return 1
        if interrupted:
            return _fail(cfg, "interrupted while the tensor-parallel group formed; every rank stopped")
        for rank, host, pid, log in cfg["peers"]:
            code = _exit_code(pid)
            if code is not None:
                return _fail(cfg, f"rank {rank} on {host} exited with code {code} while the "
                                  f"tensor-parallel group formed{_tail(log)}")
        if time.monotonic() > deadline:
            return _fail(cfg, f"the tensor-parallel group did not form within {cfg['timeout']:.0f} s "
                              f"(a peer never connected: check {cfg['where']}){_tails(cfg)}")


def _exit_code(pid: int):
    """None while running; the exit code of a peer that exited (rank 0 has not reaped it)."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return "unknown"
    try:  # Linux keeps a zombie's wait status in the last field of /proc/PID/stat
        status = int(open(f"/proc/{pid}/stat").read().rsplit(" ", 1)[1])
    except (OSError, ValueError, IndexError):
        return "unknown"
    return -(status & 0x7F) if status & 0x7F else status >> 8


def _tail(log: str, lines: int = 6) -> str:
    try:
        text = open(log, errors="replace").read().strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (": " + " | ".join(line.strip() for line in text)) if text else ""


def _tails(cfg: dict) -> str:
    return "".join(f"; rank {rank} on {host}{_tail(log, 3)}" for rank, host, _, log in cfg["peers"])


def _kill_peers(cfg: dict) -> None:
    for _, _, pid, _ in cfg["peers"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _fail(cfg: dict, message: str) -> int:
    sys.stderr.write(f"Error: {message}\n")
    sys.stderr.flush()
    _kill_peers(cfg)
    parent = cfg["parent"]
    try:
        os.kill(parent, signal.SIGTERM)  # init ignores Python's handlers; the default ends it
        psutil.Process(parent).wait(2)
    except psutil.TimeoutExpired:
        os.kill(parent, signal.SIGKILL)
    except (OSError, psutil.Error):
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
