"""Load a profile's models and start the serving engine: one process, or rank 0 of a
tensor-parallel group (which starts its peers first)."""

from __future__ import annotations

from ..config import Profile
from .engine import Engine
from .runtime import Runtime


def start_engine(profile: Profile, max_batch: int | None = None, calibrate: bool = True) -> Engine:
    tp = None
    if profile.parallel.tensor_parallel > 1:
        from ..distributed.context import TPContext

        tp = TPContext.open(profile)
    try:
        runtime = Runtime.load(profile, tp)
        engine = Engine(runtime, max_batch=max_batch, tp=tp)
        engine.start(calibrate=calibrate)
    except BaseException as exc:
        if tp is not None:  # Ctrl-C while loading: end the peers now, not after their load
            tp.close(clean=not isinstance(exc, KeyboardInterrupt))
        raise
    return engine
