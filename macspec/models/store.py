"""The bottom of models/: where model dirs live and how they are made safely. Stamps say a dir
is a finished, current build; `build` writes one atomically under a lock; the embedded family
ships in the package; safetensors headers are read without loading a tensor. Imports nothing
else from models/.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..errors import ModelLoadError
from ..progress import phase

logger = logging.getLogger(__name__)

STAMP = "macspec-build.json"  # written last: a dir without it is not a finished build
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_ENV = "MACSPEC_EMBEDDED_DIR"  # point embedded:NAME at another forge output


def embedded_dir() -> Path:
    override = os.environ.get(EMBEDDED_ENV)
    return Path(override) if override else Path(__file__).resolve().parent.parent / "assets" / "models"


def embedded_names() -> list[str]:
    root = embedded_dir()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def safetensors_header(path: Path) -> dict:
    """A safetensors file's JSON header (names, dtypes, shapes, offsets): no tensor is read."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def is_current(path: Path, stamp: dict) -> bool:
    """Is `path` a finished build of exactly `stamp`'s recipe and inputs?"""
    try:
        return json.loads((path / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def build(out: Path, stamp: dict, write: Callable[[Path], None], force: bool, what: str | None) -> Path:
    """Write a model dir to `out` atomically: `write(tmp)` fills a temp dir beside it (and writes
    the stamp last), which is then renamed into place under a file lock, so a concurrent or
    interrupted build never leaves a half dir at `out`; a killed build's temp dir is removed by
    the next build. Unless `force`, a current build (one another process finished while we
    waited for the lock) is kept."""
    out = out.expanduser().resolve()
    if out.exists() and not (out / STAMP).is_file():
        raise ModelLoadError(f"{out} exists and is not a macspec build; remove it or choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        if not force and is_current(out, stamp):
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"  # unique: we hold the lock
        old = out.parent / f"{tmp.name}-old"
        tmp.mkdir()
        try:
            with phase(what or f"building {out.name}"):
                write(tmp)
            if out.exists():
                out.rename(old)
            tmp.rename(out)
        finally:
            for leftover in (tmp, old):
                shutil.rmtree(leftover, ignore_errors=True)
    return out


@contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building %s", path.name)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
