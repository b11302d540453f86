"""What a run keeps for the next, on disk: the step-cost table, under a key of what sets a step's
cost (the models' parameter shapes and dtypes, the method, k_max, the batch, the ranks, the
machine and its threads), from which calibrate.py seeds the next start; and each model pair's
acceptance prior, from which `run` and `serve` start each method at the acceptance the pair
measured before (the engine saves both when idle and when it closes). Bookkeeping: an unreadable
file is no file, a failed write is logged, never raised."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models import row_padding
from ..paths import read_json, update_json
from .costs import StepCosts

COSTS_FILE = "step-costs.json"  # in the cache dir
PRIORS_FILE = "acceptance-priors.json"  # in the state dir (measured, not rebuildable)
KEYS_KEPT = 32  # (models, settings, machine) entries; the least recently saved go first
CACHE_SCHEMA = 3  # bump when what a cell means changes (3: tables before it ratcheted; costs.py)


# ---- the step-cost table ---------------------------------------------------------------------
def cost_key(runtime, method: str, max_batch: int, ranks: int) -> str:
    """What sets a step's cost, hashed: the loaded models' parameter shapes and dtypes (not their
    values or paths: a copy or a retrained draft costs the same), the settings and the machine."""
    from ..blas import blas_info

    modules = [runtime.target.model, getattr(runtime.draft, "model", None), runtime.mtp_head, runtime.eagle3_head,
               runtime.dflash_drafter]
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    blas = blas_info()
    parts = {"schema": CACHE_SCHEMA, "models": [_shapes(m) for m in modules if m is not None],
             "method": method, "k_max": runtime.profile.speculative.num_draft_tokens,
             "max_batch": max_batch, "ranks": ranks, "hosts": runtime.profile.parallel.hosts,
             "device": str(mx.default_device()), "chip": info.get("device_name", ""),
             "cpu": platform.machine(), "cores": os.cpu_count(), "mlx": mx.__version__,
             "blas": [blas.name, blas.core, blas.threads], "row_pads": row_padding.table()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _shapes(module) -> str:
    flat = tree_flatten(module.parameters()) if hasattr(module, "parameters") else []
    text = ";".join(f"{name}:{tuple(a.shape)}:{a.dtype}" for name, a in flat)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_costs(path: Path, key: str) -> dict[tuple[str, int, int], float] | None:
    """An earlier run's table for `key`, or None (no file, no entry, unreadable)."""
    try:
        cells = {(str(c), int(b), int(w)): float(s) for c, b, w, s in read_json(path)[key]["cells"]}
    except (ValueError, TypeError, KeyError):
        return None
    return {cell: s for cell, s in cells.items() if s > 0} or None


def save_costs(path: Path, key: str, costs: StepCosts) -> None:
    """Merge this table into `path`, keeping the KEYS_KEPT most recently saved keys."""
    def merged(stored: dict) -> dict:
        stored[key] = {"saved": time.time(), "cells": [[c, b, w, round(seconds, 7)]
                                                       for (c, b, w), seconds in costs.now().items()]}
        saved = lambda k: stored[k].get("saved", 0) if isinstance(stored[k], dict) else 0  # noqa: E731
        return {k: stored[k] for k in sorted(stored, key=saved, reverse=True)[:KEYS_KEPT]}

    update_json(path, merged, "step costs")


# ---- the acceptance priors -------------------------------------------------------------------
def pair_key(method: str, target: str, model: str | None, paired: bool) -> str:
    """Acceptance belongs to a (target, proposer) pair: with the proposer's own model, if it
    has one (`paired`)."""
    return f"{method}|{target}|{model or ''}" if paired else f"{method}|{target}"


def load_priors(path: Path, keys: dict[str, str]) -> dict[str, list[float]]:
    """keys: method -> pair key; -> method -> alphas found in `path` (nothing when unreadable)."""
    stored = read_json(path)
    out = {}
    for method, key in keys.items():
        alphas = stored.get(key)
        if isinstance(alphas, list) and alphas and all(isinstance(a, (int, float)) and 0 <= a <= 1
                                                       for a in alphas):
            out[method] = [float(a) for a in alphas]
    return out


def save_priors(path: Path, keys: dict[str, str], priors: dict[str, list[float]]) -> None:
    """Merge into `path`; a failure is logged, never raised (bookkeeping)."""
    def merged(stored: dict) -> dict:
        stored.update({keys[m]: [round(a, 4) for a in alphas] for m, alphas in priors.items() if m in keys})
        return stored

    update_json(path, merged, "acceptance priors", indent=1)
