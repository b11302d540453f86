"""Serving benchmark: macspec serve vs mlx_lm.server, same model dirs, side by side in one run.

For 1, 4, 8, 16 concurrent streaming clients (each sends --rounds requests back to back):
aggregate completion tok/s, TTFT p50/p95, per configuration. Each server first runs one untimed
pass at the highest concurrency (first-time batch shapes and buffer growth cost seconds); then
per level its variants alternate --repeats times (order flipped each time), mean reported:
  macspec spec on (profile's method, adaptive k) | macspec spec off (speculative.method = none)
  mlx_lm.server plain | mlx_lm.server with the draft model (--draft-model).
Both servers load the same float32 model dirs (CPU matmuls are slow in bf16) and both run with
OpenBLAS preloaded (mlx_lm.server is started through `import macspec`). --target smollm2 is
the real SmolLM2-135M-Instruct with its trained MTP head (chat prompts; mlx_lm.server plain only,
since it cannot use an MTP head); --target tiny-wide is the bandwidth-bound stand-in (built:tiny-wide, ~206M float32); --draft random swaps the
distilled draft for one with random weights (a useless proposer: speculation must not cost).
macspec's rows also report host syncs per decode step and the mean k from /v1/status, and
below each its steps over the repeats by row range and window (/v1/status steps_by_window).

  python benchmarks/serve.py [--target tiny|tiny-wide|tiny-moe|smollm2] [--draft distilled|random]
      [--temperature 0] [--quick] [--concurrency 1,4,8,16] [--max-tokens 64] [--json-out F]
      [--methods mtp,ngram] [--fixed-k 0,1,2,3] [--tensor-parallel 2 --no-mlx-lm] [--ignore-eos]
      [--prompts heldout|code]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macspec.servebench.launch import LaunchedServer, float32_copy, free_port  # noqa: E402
from macspec.servebench.prompts import CODE  # noqa: E402
from macspec.servebench.report import spread  # noqa: E402
from macspec.servebench.steps import engine_seconds, merge, window_line, window_mix  # noqa: E402


def prompts(count: int) -> list[str]:
    from macspec import corpus

    texts = [t for t in corpus.read_texts(heldout=True) if len(t) > 3000]
    step = max(1, len(texts) // count)
    return [texts[(i * step) % len(texts)][:400] for i in range(count)]


def chat_prompts(tokenizer, count: int) -> list[str]:
    """Chat requests rendered by the model's own template (sent as completions, so every server
    sees the same text): the prompts held out from the MTP head's training (forge/chat_prompts.py)."""
    from macspec.forge import chat_prompts as source
    from macspec.forge.smollm2 import RECIPES

    _, heldout = source.split(source.build_prompts(RECIPES["full"].num_prompts))
    return [tokenizer.apply_chat_template([{"role": "user", "content": heldout[i % len(heldout)]}],
                                          tokenize=False, add_generation_prompt=True)
            for i in range(count)]


async def one_request(session, url, body) -> dict:
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    ttft = ttft or time.perf_counter() - start
                    text.append(choice["text"])
    return {"ttft": ttft or time.perf_counter() - start, "seconds": time.perf_counter() - start,
            "text": "".join(text), "usage": usage}


def engine_status(url: str, probe: str) -> dict | None:
    """macspec's /v1/status engine section (None for mlx_lm.server)."""
    if probe != "/health":
        return None
    import requests

    return requests.get(url + "/v1/status", timeout=30).json()["engine"]


def step_figures(before: dict | None, after: dict | None) -> dict:
    """Host syncs per decode step, mean k and tokens per row-step over one scenario."""
    if before is None or after is None:
        return {}
    steps = after["totals"]["steps"] - before["totals"]["steps"]
    syncs = after["host_syncs"] - before["host_syncs"]

    def total(status: dict, key: str) -> float:
        spec = status["speculation"].values()
        if key == "emitted":
            return sum(s["tokens_per_forward"] * s["target_forwards"] for s in spec)
        return sum(s[key] for s in spec)

    row_steps = total(after, "target_forwards") - total(before, "target_forwards")
    drafted = total(after, "drafted") - total(before, "drafted")
    emitted = total(after, "emitted") - total(before, "emitted")
    (prefill_was, decode_was), (prefill_s, decode_s) = engine_seconds(before), engine_seconds(after)
    return {"syncs_per_step": round(syncs / max(steps, 1), 2), "mean_k": round(drafted / max(row_steps, 1), 2),
            "tokens_per_step": round(emitted / max(row_steps, 1), 2),
            # the engine's own seconds (its warm-up request included): the wall clock less these is
            # what serving cost outside the steps
            "prefill_s": round(prefill_s - prefill_was, 3), "decode_s": round(decode_s - decode_was, 3),
            # of decode_s, proposers taking rows on and catching them up (timed apart from the steps)
            "catch_up_s": round(after.get("catch_up_s", 0.0) - before.get("catch_up_s", 0.0), 3),
            # where a decode step's time went, ms a step (engine.py's parts, prefill apart)
            "parts_ms": {part: round((ms - before["time_ms"][part]) / max(steps, 1), 2)
                         for part, ms in after["time_ms"].items() if part != "prefill"},
            # decode steps whose best window (or a due probe) a request behind its pace vetoed
            "held_by_pace": (after.get("policy", {}).get("steps_held_by_pace", 0)
                             - before.get("policy", {}).get("steps_held_by_pace", 0)),
            "windows": window_mix(before["steps_by_window"], after["steps_by_window"])}


async def scenario(url: str, concurrency: int, rounds: int, texts: list[str], extra: dict,
                   max_tokens: int, tokenizer, temperature: float = 0.0, ignore_eos: bool = False) -> dict:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client(c: int):
            out = []
            for r in range(rounds):
                index = (c * rounds + r) % len(texts)
                body = {"prompt": texts[index], "max_tokens": max_tokens, "temperature": temperature,
                        "stream": True, "stream_options": {"include_usage": True}, **extra,
                        **({"ignore_eos": True} if ignore_eos else {})}
                out.append({"prompt": index, **await one_request(session, url, body)})
            return out

        await one_request(session, url, {"prompt": texts[0], "max_tokens": 8, "stream": True, **extra})
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c) for c in range(concurrency))) for r in rs]
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    for r in ok:
        r["tokens"] = (r["usage"]["completion_tokens"] if r["usage"] else
                       len(tokenizer.encode(r["text"], add_special_tokens=False)))
    tokens = sum(r["tokens"] for r in ok)
    ttfts = sorted(r["ttft"] for r in ok)
    return {"requests": len(results), "errors": [r["error"] for r in results if "error" in r],
            "answers": [{key: r[key] for key in ("prompt", "text", "tokens", "seconds")} for r in ok],
            "tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p95_ms": round(1e3 * ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], 1) if ttfts else None}


def print_same_text(table: dict, levels: list[int]) -> None:
    """Greedy: which prompts each config answered as macspec spec off did, and the peer's speed
    against macspec's on the prompts all three answered alike (a peer whose answers differ, warm
    from cold or from ours, is not timed on the same work). Throughput there is the prompts'
    tokens over their requests' seconds (their own time at c = 1, overlapped above it)."""
    def texts(row: dict) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for a in row["answers"]:  # mlx_lm.server streams the first token without its space
            out.setdefault(a["prompt"], set()).add(a["text"].lstrip())
        return out

    def rate(row: dict, prompts: set[int]) -> float:
        chosen = [a for a in row["answers"] if a["prompt"] in prompts]
        return sum(a["tokens"] for a in chosen) / max(sum(a["seconds"] for a in chosen), 1e-9)

    print("\nSame text as macspec spec off (prompts answered alike / sent; a config whose repeats "
          "differed counts as not alike):")
    for c in levels:
        base = texts(table["macspec spec off"][c])
        alike = {name: {p for p, t in texts(rows[c]).items() if len(t) == 1 and t == base.get(p)}
                 for name, rows in table.items()}
        print(f"  c={c}: " + ", ".join(f"{name} {len(alike[name])}/{len(base)}" for name in table))
        for peer in (n for n in ("mlx_lm.server", "mlx_lm.server draft") if n in table):
            shared = alike[peer] & alike["macspec spec on"]
            if shared:
                ratio = rate(table["macspec spec on"][c], shared) / rate(table[peer][c], shared)
                print(f"  c={c}: macspec spec on / {peer} on the {len(shared)} prompts both answer as spec "
                      f"off: {ratio:.2f}x")


def fixed_k_variant(entry: str) -> tuple[str, dict]:
    """--fixed-k entry "3" (the profile's method) or "mtp:3" -> (row label, request extras)."""
    method, _, k = entry.rpartition(":")
    label = f"macspec {method + ' ' if method else ''}k={k}"
    return label, {"speculative": {**({"method": method} if method else {}), "num_draft_tokens": int(k),
                                   "adaptive": False}}


def mean_row(rows: list[dict]) -> dict:
    """Throughput and a step's parts averaged over the repeats, steps summed (the other figures from the last one)."""
    row = dict(rows[-1])
    row["answers"] = [a for r in rows for a in r["answers"]]
    row["tok_per_s_all"] = [r["tok_per_s"] for r in rows]
    row["tok_per_s"] = round(statistics.mean(row["tok_per_s_all"]), 1)
    if "windows" in row:  # summed over the repeats
        row["windows"] = merge([r["windows"] for r in rows])
        row["held_by_pace"] = sum(r["held_by_pace"] for r in rows)
        row["parts_ms"] = {part: round(statistics.mean(r["parts_ms"][part] for r in rows), 2)
                           for part in row["parts_ms"]}
    return row


def paired_ratio(row: dict, base: dict) -> str:
    """Its tok/s over spec off's, three decimals, ± the standard error of the per-repeat ratios
    (each repeat runs the two side by side, so a change of load over the run is paired away)."""
    pairs = [a / b for a, b in zip(row["tok_per_s_all"], base["tok_per_s_all"])]
    return f"{row['tok_per_s'] / base['tok_per_s']:.3f}x" + spread(pairs)


def Server(name: str, argv: list[str], port: int, log: Path, threads: int | None) -> LaunchedServer:
    """A server process with its own MACSPEC_HOME next to its log; `threads` pins OpenBLAS's
    threads for both servers alike (else macspec's follow the machine's load, the peer's do not)."""
    env = {"MACSPEC_HOME": str(log.parent / "home")}
    if threads:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    return LaunchedServer(name, argv, port, log, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="1,4 clients, 32 tokens, 1 round")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server rows")
    ap.add_argument("--json-out", help="also write the rows as JSON to F, and each server's log beside it (F's "
                    "stem + .macspec.log, ...)")
    ap.add_argument("--status-out", help="write macspec's /v1/status engine section after each "
                    "level (the policy's guards and step costs: why adaptive chose what it did)")
    ap.add_argument("--target", default="tiny-wide", choices=("tiny", "tiny-wide", "tiny-moe", "smollm2"))
    ap.add_argument("--fixed-k", default="", help="more variants at a fixed k, e.g. 1,2,3 (the "
                    "profile's method, adaptive off) or mtp:1,mtp:2 (another method's): the best fixed k to compare adaptive with")
    ap.add_argument("--methods", default="", help="more macspec variants on the same server, e.g. "
                    "mtp,ngram (each its own row beside the profile's method)")
    ap.add_argument("--draft", default="distilled", choices=("distilled", "random"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", default="heldout", choices=("heldout", "code"), help="tiny targets: "
                    "held-out standard-library code (400 characters each) or `macspec bench`'s short "
                    "code prompts (\"def fibonacci(n):\", ...)")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens "
                    "(vLLM's option; mlx_lm.server has none: use with --no-mlx-lm)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats per level (mean)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="macspec over N local ranks "
                    "(ring over 127.0.0.1; mlx_lm.server has no TP: use with --no-mlx-lm)")
    ap.add_argument("--dtype", default="float32", help="the models' compute dtype (float32: CPU "
                    "matmuls are slow in half precision; bfloat16 on a GPU)")
    ap.add_argument("--threads", type=int, help="OPENBLAS_NUM_THREADS for every server (a fair "
                    "serving-overhead comparison on a machine with other load)")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds = "1,4", 32, 1
    levels = [int(c) for c in args.concurrency.split(",")]

    import macspec  # noqa: F401  (OpenBLAS before mlx)
    from macspec.blas import blas_info
    from macspec.models.loader import resolve_path
    from macspec.servebench.launch import random_weights_copy
    from transformers import AutoTokenizer  # ships with mlx-lm

    work = Path(tempfile.mkdtemp(prefix="macspec-bench-"))
    draft = None
    if args.target == "smollm2":  # a real instruct model and its trained MTP head
        target = resolve_path("pulled:smollm2")
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        texts = chat_prompts(tokenizer, 32)
        method = 'method = "mtp"\n'
    else:
        target = (resolve_path(f"built:{args.target}") if args.target in ("tiny-wide", "tiny-moe")
                  else float32_copy(resolve_path("embedded:tiny-target"), work / "target"))
        draft = float32_copy(resolve_path("embedded:tiny-draft"), work / "draft")
        if args.draft == "random":
            draft = random_weights_copy(draft, work / "random-draft", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(str(target))
        texts = prompts(32) if args.prompts == "heldout" else CODE
        method = f'method = "draft"\ndraft_model = "{draft}"\n'
    profile = work / "bench.toml"
    profile.write_text(f'name = "bench"\n[model]\npath = "{target}"\ndtype = "{args.dtype}"\nchat = false\n'
                       f'[speculative]\n{method}'
                       f'num_draft_tokens = {args.num_draft}\n[kv]\nmax_context = 4096\n'
                       f'[server]\nmax_batch = {max(levels)}\nmax_queue = 256\n'
                       + (f'[parallel]\ntensor_parallel = {args.tensor_parallel}\nbackend = "ring"\n'
                          f'hosts = {json.dumps(["127.0.0.1"] * args.tensor_parallel)}\n'
                          if args.tensor_parallel > 1 else ''))
    py = sys.executable
    mlx_lm_cmd = [py, "-c", "import macspec, runpy, sys; sys.argv = sys.argv[1:]; "
                  "runpy.run_module('mlx_lm.server', run_name='__main__')", "mlx_lm.server"]
    # One server per entry; its variants (request extras) run alternately on it, so spec on and
    # spec off are measured side by side on the same warm server.
    more = [(f"macspec {m}", {"speculative": {"method": m}}) for m in args.methods.split(",") if m]
    more += [fixed_k_variant(entry) for entry in args.fixed_k.split(",") if entry]
    servers = [("macspec", [py, "-m", "macspec", "serve", "--profile", str(profile)], "/health",
                [("macspec spec on", {}), ("macspec spec off", {"speculative": {"method": "none"}}), *more])]
    if not args.no_mlx_lm:
        base = [*mlx_lm_cmd, "--model", str(target), "--max-tokens", str(args.max_tokens)]
        servers += [("mlx_lm.server", base, "/v1/models", [("mlx_lm.server", {})])]
        if draft is not None:  # mlx_lm.server cannot use an MTP head
            servers += [("mlx_lm.server draft", [*base, "--draft-model", str(draft), "--num-draft-tokens",
                                                 str(args.num_draft)], "/v1/models", [("mlx_lm.server draft", {})])]
    table: dict[str, dict] = {}
    statuses: dict[int, dict] = {}
    server = None
    for label, argv, probe, variants in servers:
        if server:
            server.stop()
        port = free_port()
        server = Server(label, argv + ["--port", str(port)], port, work / f"{label.replace(' ', '_')}.log",
                        args.threads)
        server.wait_ready(probe, timeout=300)
        # Untimed: every batch shape and buffer size seen once, and every prompt the timed runs
        # send prefilled once (else whichever variant runs first pays the cold prefills: on
        # tiny-moe, whose prefill is slow on a CPU, that alone cost spec on 0.8x at c=4).
        for name, extra in variants:
            asyncio.run(scenario(server.url, max(levels), args.rounds, texts, extra, args.max_tokens, tokenizer,
                                 args.temperature, args.ignore_eos))
        for c in levels:
            for name, extra in variants:
                table.setdefault(name, {})[c] = []
            for repeat in range(args.repeats):
                # Alternate the order too: a machine that speeds up or slows down over a run
                # must not favour whichever variant goes first.
                for name, extra in (variants if repeat % 2 == 0 else variants[::-1]):
                    before = engine_status(server.url, probe)
                    row = asyncio.run(scenario(server.url, c, args.rounds, texts, extra,
                                               args.max_tokens, tokenizer, args.temperature, args.ignore_eos))
                    row.update(step_figures(before, engine_status(server.url, probe)))
                    table[name][c].append(row)
            if args.status_out and probe == "/health":
                statuses[c] = engine_status(server.url, probe)
                Path(args.status_out).write_text(json.dumps(statuses, indent=1))
            for name, _ in variants:
                table[name][c] = row = mean_row(table[name][c])
                extra_text = (f"  {row['syncs_per_step']} syncs/step, mean k {row['mean_k']}, "
                              f"{row['tokens_per_step']} tok/row-step, engine {row['decode_s']} s decode ({row['catch_up_s']} catch-up) + "
                              f"{row['prefill_s']} s prefill of {row['wall_s']} s; {row['held_by_pace']} steps held by pace; "
                              f"a step's ms {row['parts_ms']}"
                              if "syncs_per_step" in row else "")
                print(f"{name:22s} c={c:2d}  {row['tok_per_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']} ms "
                      f"p95 {row['ttft_p95_ms']} ms  errors {len(row['errors'])}{extra_text}", flush=True)
                if row.get("windows"):
                    print(f"{'':22s}   steps (all repeats): {window_line(row['windows'])}", flush=True)
    if server:
        server.stop()
    print(f"\nBLAS {blas_info().name}; target {args.target}, {args.draft} draft; {args.rounds} request(s) "
          f"per client, {args.max_tokens} tokens{' (ignore_eos)' if args.ignore_eos else ''}, "
          f"temperature {args.temperature}")
    header = "| config | " + " | ".join(f"c={c} tok/s (TTFT p50/p95 ms)" for c in levels) + " |"
    print(header)
    print("|" + "---|" * (len(levels) + 1))
    for name, rows in table.items():
        cells = [f"{r['tok_per_s']} ({r['ttft_p50_ms']}/{r['ttft_p95_ms']})" + (f" {len(r['errors'])} err" if r["errors"] else "")
                 for r in rows.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    base = table["macspec spec off"]
    for name in ["macspec spec on", *(n for n, _ in more)]:
        print(f"| {name} / off | " + " | ".join(paired_ratio(table[name][c], base[c]) for c in levels) + " |")
    if "mlx_lm.server" in table:
        for name in [n for n in ("mlx_lm.server", "mlx_lm.server draft") if n in table]:
            print(f"| macspec on / {name} | " + " | ".join(
                f"{table['macspec spec on'][c]['tok_per_s'] / max(table[name][c]['tok_per_s'], 1e-9):.2f}x"
                for c in levels) + " |")
    if not args.temperature:
        print_same_text(table, levels)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(table, indent=2))
        for log in work.glob("*.log"):  # the policy's verdicts ("mtp off at batch 1: ...") say why a cell drafted less
            shutil.copy(log, Path(args.json_out).with_suffix(f".{log.name}"))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
