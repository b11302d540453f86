"""Scenarios (single, N sequential, M concurrent) against one target, with the server's own
counters read before and after each, so the report can set them beside the client's view."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp

from .client import stream_completion


@dataclass
class Target:
    label: str  # "macspec spec on", "macspec spec off", "mlx_lm.server"
    url: str
    extra: dict = field(default_factory=dict)  # added to every request body
    api_key: str | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: int
    concurrency: int


def scenarios(names: list[str], sequential: int, concurrent: int) -> list[Scenario]:
    table = {"single": Scenario("single", 1, 1),
             "sequential": Scenario(f"sequential x{sequential}", sequential, 1),
             "concurrent": Scenario(f"concurrent x{concurrent}", concurrent, concurrent)}
    return [table[n] for n in names]


async def run_target(target: Target, plan: list[Scenario], prompts: list[str], max_tokens: int,
                     tick: Callable[[], None]) -> dict:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = aiohttp.ClientTimeout(total=1800, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before_all = await server_status(session, target, headers)
        warmup = await stream_completion(session, target.url, _body(target, prompts[0], 8), headers)
        results = []
        for index, scenario in enumerate(plan):
            results.append(await _scenario(session, target, scenario, prompts, max_tokens, headers,
                                           tick, offset=index))
        after_all = await server_status(session, target, headers)
    return {"label": target.label, "url": target.url, "extra": target.extra, "warmup": warmup,
            "scenarios": results, "server_counters": counters_delta(before_all, after_all)}


async def _scenario(session, target: Target, scenario: Scenario, prompts: list[str], max_tokens: int,
                    headers: dict, tick, offset: int) -> dict:
    before = await server_status(session, target, headers)
    gate = asyncio.Semaphore(scenario.concurrency)

    async def one(i: int) -> dict:
        async with gate:
            prompt = prompts[(offset * 7 + i) % len(prompts)]
            row = await stream_completion(session, target.url, _body(target, prompt, max_tokens), headers)
            tick()
            return {"index": i, **row}

    start = time.perf_counter()
    rows = await asyncio.gather(*(one(i) for i in range(scenario.requests)))
    wall = time.perf_counter() - start
    after = await server_status(session, target, headers)
    return {"name": scenario.name, "requests": list(rows), "summary": summarize(rows, wall),
            "speculation": speculation_delta(before, after),
            "server_counters": counters_delta(before, after)}


def _body(target: Target, prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **target.extra}


async def server_status(session, target: Target, headers: dict) -> dict | None:
    """macspec's /v1/status engine block; None for servers without it (mlx_lm.server)."""
    try:
        async with session.get(target.url + "/v1/status", headers=headers) as resp:
            if resp.status != 200:
                return None
            body = await resp.json()
            return body.get("engine") if isinstance(body, dict) else None
    except (aiohttp.ClientError, ValueError, TimeoutError):
        return None


def summarize(rows: list[dict], wall: float) -> dict:
    ok = [r for r in rows if r["status"] == "OK"]
    tokens = sum(r["completion_tokens"] for r in ok)
    ttfts = sorted(r["ttft_s"] for r in ok)
    decode = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    prefill = [r["prefill_tok_s"] for r in ok if r["prefill_tok_s"]]
    return {
        "requests": len(rows), "ok": len(ok), "failed": len(rows) - len(ok),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok), "completion_tokens": tokens,
        "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "decode_tok_s_mean": round(statistics.mean(decode), 1) if decode else None,
        "prefill_tok_s_mean": round(statistics.mean(prefill), 1) if prefill else None,
        "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p95_ms": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 1) if ttfts else None,
    }


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    keys = ("requests", "completed", "cancelled", "failed", "generated_tokens", "prompt_tokens", "steps")
    out = {k: after["totals"][k] - before["totals"][k] for k in keys}
    if "host_syncs" in after and "host_syncs" in before:  # one per decode step is the design
        out["host_syncs_per_step"] = round((after["host_syncs"] - before["host_syncs"]) / max(out["steps"], 1), 3)
    return out


def speculation_delta(before: dict | None, after: dict | None) -> dict | None:
    """Per method over the scenario: drafted, accepted, acceptance, tokens per target forward."""
    if before is None or after is None:
        return None
    out = {}
    for method, now in after["speculation"].items():
        was = before["speculation"].get(method) or {"target_forwards": 0, "drafted": 0, "accepted": 0,
                                                    "tokens_per_forward": 0.0}
        forwards = now["target_forwards"] - was["target_forwards"]
        if forwards <= 0:
            continue
        drafted, accepted = now["drafted"] - was["drafted"], now["accepted"] - was["accepted"]
        committed = (now["tokens_per_forward"] * now["target_forwards"]
                     - was["tokens_per_forward"] * was["target_forwards"])
        out[method] = {"target_forwards": forwards, "drafted": drafted, "accepted": accepted,
                       "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
                       "tokens_per_forward": round(committed / forwards, 3),
                       "drafts_per_forward": round(drafted / forwards, 3)}
    return out
