"""Where macspec keeps its state and caches: $MACSPEC_HOME/{state,cache}, else the platform's
user state and cache dirs; $MACSPEC_CACHE moves the cache alone."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from .config import HOME_ENV

logger = logging.getLogger(__name__)


def _user_dir(kind: str) -> Path:
    """$MACSPEC_HOME/<kind>, else the platform's user <kind> dir (created)."""
    home = os.environ.get(HOME_ENV)
    if home:
        path = Path(home) / kind
    else:
        import platformdirs

        path = Path(getattr(platformdirs, f"user_{kind}_dir")("macspec"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_dir() -> Path:
    return _user_dir("state")


CACHE_ENV = "MACSPEC_CACHE"  # the cache alone elsewhere (`macspec bench` shares the user's)


def cache_dir() -> Path:
    """Rebuildable files (built:NAME model dirs): safe to delete, rebuilt on next use."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return Path(chosen)
    return _user_dir("cache")


def fresh_subdir(parent: Path, prefix: str, keep: int) -> Path:
    """A new folder in `parent` named prefix + a unique suffix, after removing the oldest
    siblings beyond `keep` (so logs stay bounded)."""
    parent.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for path in old[:max(0, len(old) - keep + 1)]:
        shutil.rmtree(path, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def read_json(path: Path) -> dict:
    """The JSON object at `path`; {} when it is missing, unreadable or not an object."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def update_json(path: Path, change: Callable[[dict], dict], what: str, indent: int | None = None) -> None:
    """Write change(the JSON object at `path`) back atomically ({} when it is missing or
    unreadable). A failure is logged, never raised: these files are bookkeeping."""
    stored = read_json(path)
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(change(stored), indent=indent))
        tmp.replace(path)
    except OSError as err:
        logger.warning("could not save %s to %s: %s", what, path, err)
