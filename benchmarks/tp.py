"""Tensor-parallel benchmark: TP1 vs TP2 (ring over loopback), plain and speculative, side by side.

For each of `tiny` (one process) and `tiny-tp2` (rank 0 + one worker) it serves the same
streaming requests with speculation off and on (the embedded draft, adaptive k) and reports
decode tok/s, TTFT, ms per engine step (spec at a fixed k = 4 shows the wider verify
forward; adaptive k is what serving does by default), tokens per step, and collectives per decode step
(rank 0's step plans plus the model's own all_sums: 2 per sharded layer).

  python benchmarks/tp.py [--concurrency 1,4] [--rounds 4] [--max-tokens 64] [--json-out F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from serve import Server, free_port, prompts, scenario  # benchmarks/serve.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = {"plain": {"speculative": {"method": "none"}},
           "spec k=4": {"speculative": {"method": "draft", "num_draft_tokens": 4, "adaptive": False}},
           "spec adaptive": {"speculative": {"method": "draft"}}}


def engine_status(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/status", timeout=10) as reply:
        return json.load(reply)["engine"]


def measure(server: Server, concurrency: int, args, texts, tokenizer, model_collectives: int) -> dict:
    rows = {}
    for label, extra in METHODS.items():
        before = engine_status(server.url)
        result = asyncio.run(scenario(server.url, concurrency, args.rounds, texts, extra,
                                      args.max_tokens, tokenizer))
        after = engine_status(server.url)
        steps = after["totals"]["steps"] - before["totals"]["steps"]
        tp = after.get("tensor_parallel")
        plans = (tp["plan_collectives"] - before["tensor_parallel"]["plan_collectives"]) if tp else 0
        result.update({
            "ms_per_step": round(1e3 * result["wall_s"] / max(1, steps), 2),
            "tokens_per_step": round(result["tokens"] / max(1, steps), 2),
            "plan_collectives_per_step": round(plans / max(1, steps), 2),
            "model_collectives_per_forward": model_collectives if tp else 0,
        })
        rows[label] = result
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    import macspec  # noqa: F401  (OpenBLAS before mlx)
    from macspec.config import load_profile
    from macspec.models.loader import load_model

    target = load_model(load_profile("tiny").model.path)
    model_collectives = 2 * target.config["num_hidden_layers"]  # o_proj and down_proj all_sum
    texts = prompts(16)
    work = Path(tempfile.mkdtemp(prefix="macspec-bench-tp-"))
    levels = [int(c) for c in args.concurrency.split(",")]
    report = {}
    for profile in ("tiny", "tiny-tp2"):
        port = free_port()
        server = Server(profile, [sys.executable, "-m", "macspec", "serve", "--profile", profile,
                                  "--port", str(port), "--max-batch", str(max(levels))],
                        port, work / f"{profile}.log")
        try:
            server.wait_ready("/health", timeout=300)
            report[profile] = {c: measure(server, c, args, texts, target.tokenizer, model_collectives)
                               for c in levels}
        finally:
            server.stop()
    print_table(report, levels)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


def print_table(report: dict, levels: list[int]) -> None:
    print("| config | c | tok/s | TTFT p50 ms | ms/step | tok/step | plan coll./step | model coll./fwd |")
    print("|---|---|---|---|---|---|---|---|")
    for profile, by_level in report.items():
        for c in levels:
            for label, r in by_level[c].items():
                print(f"| {profile} {label} | {c} | {r['tok_per_s']} | {r['ttft_p50_ms']} | "
                      f"{r['ms_per_step']} | {r['tokens_per_step']} | {r['plan_collectives_per_step']} | "
                      f"{r['model_collectives_per_forward']} |")
    for c in levels:
        for label in METHODS:
            one, two = report["tiny"][c][label], report["tiny-tp2"][c][label]
            print(f"c={c} {label}: TP2/TP1 tok/s {two['tok_per_s'] / one['tok_per_s']:.2f}x, "
                  f"ms/step {two['ms_per_step'] / one['ms_per_step']:.2f}x")
    for profile in report:
        for c in levels:
            r = report[profile][c]
            for label in list(METHODS)[1:]:
                print(f"{profile} c={c}: {label}/plain tok/s {r[label]['tok_per_s'] / r['plain']['tok_per_s']:.2f}x")


if __name__ == "__main__":
    main()
