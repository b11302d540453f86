"""What the engine counts: requests and tokens, steps by batch size, host syncs, where step time
goes, and the periodic log line. /v1/status, /metrics and the benchmarks read these."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .. import proposers
from ..models import row_padding
from ..monitor.memory import MB, usage

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 30.0
STEP_PARTS = ("prefill", "plan", "build", "sync", "commit", "close")


@dataclass
class EngineStats:
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("requests", "completed", "cancelled", "failed", "rejected", "prompt_tokens",
         "generated_tokens", "steps"), 0))
    # (rows, window) -> [steps, seconds plan to close, tokens committed]: what the policy chose at
    # each batch size and what it paid (a scenario's difference shows where a benchmark's time went)
    steps_by_window: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    host_syncs: int = 0  # in decode steps (one per step without TP)
    time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    last_log: float = field(default_factory=time.perf_counter)

    def count(self, key: str, n: int = 1) -> None:
        self.totals[key] += n

    def step_done(self, rows: int, window: int, tokens: int, marks: list[float]) -> None:
        """A decode step over `rows` rows at `window` positions that committed `tokens`; `marks`:
        its perf_counter times, one per part boundary."""
        self.totals["steps"] += 1
        cell = self.steps_by_window.setdefault((rows, window), [0, 0.0, 0])
        cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + marks[-1] - marks[0], cell[2] + tokens
        for part, start, end in zip(STEP_PARTS[1:], marks, marks[1:]):
            self.time_s[part] += end - start

    @property
    def batch_histogram(self) -> dict[int, int]:
        """Rows in a step -> steps (its windows summed)."""
        out: dict[int, int] = {}
        for (rows, _), (steps, _, _) in self.steps_by_window.items():
            out[rows] = out.get(rows, 0) + steps
        return out

    def as_dict(self) -> dict:
        return {"totals": dict(self.totals),
                "batch_size_histogram": {str(b): n for b, n in sorted(self.batch_histogram.items())},
                "steps_by_window": self.steps_by_window_dict(),
                "host_syncs": self.host_syncs,
                "time_ms": {k: round(v * 1e3, 1) for k, v in self.time_s.items()},
                "host_syncs_per_step": round(self.host_syncs / max(1, self.totals["steps"]), 3)}

    def steps_by_window_dict(self) -> dict:
        """{rows: {window: {steps, seconds, tokens}}}, as /v1/status shows them."""
        out: dict = {}
        for (rows, window), (steps, seconds, tokens) in sorted(self.steps_by_window.items()):
            out.setdefault(str(rows), {})[str(window)] = {"steps": steps, "seconds": round(seconds, 4),
                                                         "tokens": tokens}
        return out

    def maybe_log(self, engine) -> None:
        """Every LOG_INTERVAL_S: the queues, acceptance per method and memory, at INFO."""
        now = time.perf_counter()
        if now - self.last_log < LOG_INTERVAL_S:
            return
        self.last_log = now
        s, memory = engine.scheduler, engine.scheduler.memory
        parts = [f"{m}: acceptance {st.acceptance_rate:.2f}, {st.tokens_per_forward:.2f} tok/fwd"
                 for m, st in engine.speculator.totals.items()]
        logger.info("%d running, %d waiting, %d tokens generated; %s", len(s.running), len(s.waiting),
                    self.totals["generated_tokens"], "; ".join(parts) or "-")
        mem = usage()
        logger.info("memory: KV reserved %d/%d MB, prefix cache %d MB, MLX active %d MB, cache %d MB, "
                    "%d admissions waited", memory.reserved // MB, memory.budget // MB,
                    s.prefix_cache.nbytes // MB, mem["mlx_active_bytes"] // MB,
                    mem["mlx_cache_bytes"] // MB, memory.waits)


def engine_status(engine) -> dict:
    """A snapshot of `engine`; call it from the thread that steps it (the service does)."""
    s, memory = engine.scheduler, engine.scheduler.memory
    rows = list(s.running)
    return {
        "running": len(rows), "prefilling": len(s.prefilling), "waiting": len(s.waiting),
        "max_batch": engine.max_batch,
        **engine.stats.as_dict(),
        "rows": {"k_in_use": [seq.spec.k for seq in rows]},
        "proposers": {"default": engine.runtime.method, "methods": list(proposers.METHODS),
                      "unavailable": dict(engine.runtime.unavailable)},
        **engine.speculator.status(),
        "prefix_cache": {**s.prefix_cache.as_dict(),
                         "disk": engine.runner.disk.as_dict() if engine.runner.disk else None},
        "kv_cache_bytes": engine.runner.kv.nbytes(),
        "memory": {**usage(), "kv_budget_bytes": memory.budget, "kv_reserved_bytes": memory.reserved,
                   "limit_bytes": memory.limit},
        "admission": memory.as_dict(),
        "row_padding": row_padding.status(),
        "tensor_parallel": engine.tp.status() if engine.tp is not None else None,
    }
