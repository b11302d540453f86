"""Load a profile's models and build the engine: one process, or rank 0 of a tensor-parallel
group (which starts its peers first)."""

from __future__ import annotations

from ..config import Profile
from .engine import Engine
from .runtime import Runtime
from .service import EngineService


def calibrated_engine(runtime: Runtime, max_batch: int) -> Engine:
    """An engine over already loaded models, its cost model seeded as at start-up (tests and
    benchmarks build models by hand)."""
    engine = Engine(runtime, max_batch=max_batch)
    engine.calibrate()
    return engine


def build_engine(profile: Profile, max_batch: int | None = None) -> Engine:
    """The synchronous engine (`run`, benchmarks); under TP it drives the peers it started."""
    tp = None
    if profile.parallel.tensor_parallel > 1:
        from ..distributed.context import TPContext

        tp = TPContext.open(profile)
    try:
        return Engine(Runtime.load(profile, tp), max_batch=max_batch, tp=tp)
    except BaseException as exc:
        if tp is not None:  # Ctrl-C while loading: end the peers now, not after their load
            tp.close(clean=not isinstance(exc, KeyboardInterrupt))
        raise


def start_engine(profile: Profile, max_batch: int | None = None, calibrate: bool = True) -> EngineService:
    """The engine in its own thread, for `serve`."""
    engine = build_engine(profile, max_batch)
    try:
        engine.remember_priors()  # a restarted daemon starts each method where it left off
        service = EngineService(engine)
        service.start(calibrate=calibrate)
    except BaseException as exc:
        engine.close(clean=not isinstance(exc, KeyboardInterrupt))
        raise
    return service
