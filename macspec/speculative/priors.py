"""Acceptance priors kept between runs: `macspec run` starts each prompt at the k its model pair
earned before instead of exploring from scratch (the daemon keeps them in memory)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..paths import update_json

logger = logging.getLogger(__name__)


def pair_key(method: str, target: str, model: str | None, paired: bool) -> str:
    """Acceptance belongs to a (target, proposer) pair: with the proposer's own model, if it
    has one (`paired`)."""
    return f"{method}|{target}|{model or ''}" if paired else f"{method}|{target}"


def load(path: Path, keys: dict[str, str]) -> dict[str, list[float]]:
    """keys: method -> pair key; -> method -> alphas found in `path` (nothing when unreadable)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for method, key in keys.items():
        alphas = stored.get(key) if isinstance(stored, dict) else None
        if isinstance(alphas, list) and alphas and all(isinstance(a, (int, float)) and 0 <= a <= 1
                                                       for a in alphas):
            out[method] = [float(a) for a in alphas]
    return out


def save(path: Path, keys: dict[str, str], priors: dict[str, list[float]]) -> None:
    """Merge into `path`; a failure is logged, never raised (bookkeeping)."""
    def merged(stored: dict) -> dict:
        stored.update({keys[m]: [round(a, 4) for a in alphas] for m, alphas in priors.items() if m in keys})
        return stored

    update_json(path, merged, "acceptance priors", indent=1)
