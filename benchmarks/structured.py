"""Structured output with speculation: json_schema requests, spec on ÷ off, one warm server.

`macspec serve` with the distilled draft; every request carries the same JSON Schema
(response_format json_schema), so the grammar masks every window position. Per concurrency
level the two variants (speculation on / off) alternate --repeats times, order flipped each
time; aggregate completion tok/s (mean) and the ratio are printed, with the grammar's cost per
mask from /v1/status (µs; a step masks each row's window: k + 1 positions) and per emitted token.
Plain-text requests (no grammar) run the same way for reference.

  python benchmarks/structured.py [--target tiny-wide|tiny] [--concurrency 1,4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macspec.servebench.launch import LaunchedServer, float32_copy  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "version", "tags", "stable"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "version": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 10}},
                         "stable": {"type": "boolean"}}}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "package", "schema": SCHEMA}}
VARIANTS = {"json spec on": {"response_format": JSON_FORMAT},
            "json spec off": {"response_format": JSON_FORMAT, "speculative": {"method": "none"}},
            "text spec on": {},
            "text spec off": {"speculative": {"method": "none"}}}


def prompts(count: int) -> list[str]:
    from macspec import corpus

    texts = [t for t in corpus.read_texts(heldout=True) if len(t) > 3000]
    step = max(1, len(texts) // count)
    return [texts[(i * step) % len(texts)][:300] + "\n# metadata as JSON:\n" for i in range(count)]


async def one(session, url: str, body: dict) -> dict:
    async with session.post(url + "/v1/completions", json=body) as resp:
        reply = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {reply}")
    choice = reply["choices"][0]
    if "response_format" in body and choice["finish_reason"] == "stop":
        json.loads(choice["text"])  # the grammar's promise
    return reply


async def level(url: str, concurrency: int, rounds: int, texts: list[str], extra: dict,
                max_tokens: int) -> tuple[float, float]:
    """-> (completion tok/s over the level, acceptance)."""
    tokens, accepted, drafted = 0, 0, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client(c: int):
            nonlocal tokens, accepted, drafted
            for r in range(rounds):
                body = {"prompt": texts[(c * rounds + r) % len(texts)], "max_tokens": max_tokens,
                        "temperature": 0, **extra}
                reply = await one(session, url, body)
                tokens += reply["usage"]["completion_tokens"]
                spec = reply.get("macspec", {}).get("spec", {})
                accepted += spec.get("accepted", 0)
                drafted += spec.get("drafted", 0)

        start = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(concurrency)))
        seconds = time.perf_counter() - start
    return tokens / seconds, accepted / drafted if drafted else 0.0


def grammar_cost(url: str) -> dict:
    import requests

    return requests.get(url + "/v1/status", timeout=30).json().get("grammar", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-wide", choices=("tiny", "tiny-wide"))
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    import macspec  # noqa: F401  (OpenBLAS before mlx)
    from macspec.models.loader import resolve_path

    work = Path(tempfile.mkdtemp(prefix="macspec-structured-"))
    target = (resolve_path("built:tiny-wide") if args.target == "tiny-wide"
              else float32_copy(resolve_path("embedded:tiny-target"), work / "target"))
    draft = float32_copy(resolve_path("embedded:tiny-draft"), work / "draft")
    profile = work / "bench.toml"
    profile.write_text(f'name = "bench"\n[model]\npath = "{target}"\ndtype = "float32"\nchat = false\n'
                       f'[speculative]\nmethod = "draft"\ndraft_model = "{draft}"\nnum_draft_tokens = 4\n'
                       f'[kv]\nmax_context = 4096\n[server]\nmax_batch = {max(levels)}\n')
    texts = prompts(16)
    server = LaunchedServer.macspec(str(profile), work)
    rows = []
    try:
        server.wait_ready()
        for name, extra in VARIANTS.items():  # warm every shape once, untimed
            asyncio.run(level(server.url, max(levels), 1, texts, extra, 16))
        before = grammar_cost(server.url)
        for c in levels:
            runs: dict[str, list] = {name: [] for name in VARIANTS}
            for repeat in range(args.repeats):
                order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
                for name in order:
                    runs[name].append(asyncio.run(level(server.url, c, args.rounds, texts,
                                                        VARIANTS[name], args.max_tokens)))
            row = {"concurrency": c}
            for name, values in runs.items():
                row[name] = round(statistics.mean(v[0] for v in values), 1)
                row[name + " acceptance"] = round(statistics.mean(v[1] for v in values), 3)
            row["json on/off"] = round(row["json spec on"] / row["json spec off"], 2)
            row["text on/off"] = round(row["text spec on"] / row["text spec off"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        after = grammar_cost(server.url)
    finally:
        server.stop()
    masks = after.get("masks", 0) - before.get("masks", 0)
    print(f"\ntarget {args.target}, {args.max_tokens} tokens, greedy, draft k=4 (adaptive)")
    print(f"{'clients':>8} {'json on':>9} {'json off':>9} {'on/off':>7} {'acc':>5} | {'text on':>9} "
          f"{'text off':>9} {'on/off':>7}")
    for r in rows:
        print(f"{r['concurrency']:>8} {r['json spec on']:>9} {r['json spec off']:>9} {r['json on/off']:>6}× "
              f"{r['json spec on acceptance']:>5} | {r['text spec on']:>9} {r['text spec off']:>9} "
              f"{r['text on/off']:>6}×")
    print(f"grammar: {after.get('mask_us')} µs per mask over the whole run ({masks} masks timed "
          f"in the measured levels)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "grammar": after}, indent=2))


if __name__ == "__main__":
    main()
