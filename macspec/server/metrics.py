"""GET /metrics: Prometheus text built from the engine's status at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.service import EngineService


class EngineCollector:
    def __init__(self, engine: EngineService):
        self.engine = engine

    def collect(self):
        status = self.engine.status()
        totals = status["totals"]
        yield _gauge("macspec_requests_running", "Requests decoding now", status["running"])
        yield _gauge("macspec_requests_prefilling", "Requests in prefill", status["prefilling"])
        yield _gauge("macspec_requests_waiting", "Requests queued", status["waiting"])
        requests = CounterMetricFamily("macspec_requests", "Requests by outcome", labels=["outcome"])
        for outcome in ("completed", "cancelled", "failed", "rejected"):
            requests.add_metric([outcome], totals[outcome])
        yield requests
        yield CounterMetricFamily("macspec_prompt_tokens", "Prompt tokens prefilled",
                                  value=totals["prompt_tokens"])
        yield CounterMetricFamily("macspec_generated_tokens", "Tokens generated",
                                  value=totals["generated_tokens"])
        yield CounterMetricFamily("macspec_decode_steps", "Batched decode steps", value=totals["steps"])
        drafted = CounterMetricFamily("macspec_spec_drafted_tokens", "Draft tokens verified",
                                      labels=["method"])
        accepted = CounterMetricFamily("macspec_spec_accepted_tokens", "Draft tokens accepted",
                                       labels=["method"])
        per_forward = GaugeMetricFamily("macspec_spec_tokens_per_forward",
                                        "Committed tokens per target forward", labels=["method"])
        draft_length = GaugeMetricFamily("macspec_spec_mean_draft_length",
                                         "Draft tokens per speculative step", labels=["method"])
        for method, spec in status["speculation"].items():
            drafted.add_metric([method], spec["drafted"])
            accepted.add_metric([method], spec["accepted"])
            per_forward.add_metric([method], spec["tokens_per_forward"])
            draft_length.add_metric([method], spec["mean_draft_length"])
        yield drafted
        yield accepted
        yield per_forward
        yield draft_length
        speedup = GaugeMetricFamily("macspec_spec_speedup", "Measured tokens per second while the "
                                    "method drafts / plain decoding's, by batch bucket (its guard)",
                                    labels=["method", "batch", "state"])
        for method, buckets in status["policy"]["guards"].items():
            for batch, guard in buckets.items():
                speedup.add_metric([method, batch, guard["state"]], guard["speedup"] or 0.0)
        yield speedup
        faults = CounterMetricFamily("macspec_speculation_faults", "Speculation bookkeeping faults "
                                     "(the row decoded plainly for that step)", labels=["source"])
        for source, count in status["speculation_faults"]["by_source"].items():
            faults.add_metric([source], count)
        yield faults
        memory = GaugeMetricFamily("macspec_memory_bytes", "Memory in use", labels=["kind"])
        for kind, value in status["memory"].items():
            memory.add_metric([kind.removesuffix("_bytes")], value)
        memory.add_metric(["kv_cache"], status["kv_cache_bytes"])
        memory.add_metric(["prefix_cache"], status["prefix_cache"]["bytes"])
        yield memory


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def metrics_text(engine: EngineService) -> bytes:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return generate_latest(registry)
