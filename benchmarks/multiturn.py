"""Multi-turn TTFT: a 6-turn chat with a long system prompt, prefix cache on vs off.

One in-process server per variant (the second with kv.prefix_cache_mb = 0); each turn re-sends
the whole conversation through /v1/chat/completions (streamed) and the time to the first
content chunk is taken, with the reported cached tokens.

With --method (a head: mtp, eagle3, dflash) both servers keep the prefix cache and draft k = 1
every step (--adaptive: as the profile decides); the second starts every row's head from nothing instead of from the head's KV that
earlier turns left (MTPGroup's kept prefixes): each turn's seconds, and the positions its head
joined (/v1/status), side by side.

  flock /tmp/macspec-bench.lock python benchmarks/multiturn.py [--profile tiny-wide] [--system-tokens 2000]
  flock /tmp/macspec-bench.lock python benchmarks/multiturn.py --profile smollm2 --method eagle3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serverutil import RunningServer, runtime_with  # noqa: E402

TURNS = ["def parse(", "and load", "now main", "run it", "emit all", "read back"]
FILLER = "def helper_{i}(x):\n    return x * {i} + len(str(x))\n\n"


def system_prompt(tokenizer, tokens: int) -> str:
    text, i = "", 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += "".join(FILLER.format(i=i + j) for j in range(20))
        i += 20
    return text


def conversation(url: str, system: str, max_tokens: int, extra: dict | None = None) -> list[tuple[float, ...]]:
    """Each turn's (TTFT, prompt tokens, cached tokens, seconds, head positions joined)."""
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages, out = [{"role": "system", "content": system}], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        joined = head_joined(url)
        start, first, answer, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            if chunk.choices:
                answer += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": answer})
        out.append((first or time.perf_counter() - start, usage.prompt_tokens,
                    usage.prompt_tokens_details.cached_tokens, time.perf_counter() - start,
                    head_joined(url) - joined))
    return out


def head_joined(url: str) -> int:
    """The positions the server's heads joined so far (0 without one)."""
    engine = requests.get(url + "/v1/status", timeout=30).json()["engine"]
    return sum(p.get("joined_positions", 0) for p in engine.get("proposers", {}).values())


def head_turns(args) -> None:
    """The same conversation through a head whose kept prefixes serve the next turn, and not."""
    from macspec.speculative import mtp

    drafting = {"speculative": {"method": args.method, **({} if args.adaptive else {"num_draft_tokens": 1, "adaptive": False})}}
    rows, kept = {}, mtp.MTPGroup._kept_prefix
    for name, extra in (("kept", drafting), ("not kept", drafting), ("spec off", {"speculative": {"method": "none"}})):
        if name == "not kept":
            mtp.MTPGroup._kept_prefix = lambda self, committed, waiting: (self._fresh_cache(), 0)
        try:
            runtime = runtime_with(args.profile, speculative__method=args.method)
            system = system_prompt(runtime.tokenizer, args.system_tokens)
            with RunningServer(runtime, max_batch=1) as server:
                rows[name] = conversation(server.url, system, args.max_tokens, extra)
        finally:
            mtp.MTPGroup._kept_prefix = kept
    print(f"{args.profile}, {args.method} {'adaptive' if args.adaptive else 'at k = 1'}, {args.max_tokens} tokens a turn, greedy")
    print("| turn | prompt tokens | cached | head joined: kept / not | turn s: kept / not / spec off | "
          "not ÷ kept | spec off ÷ kept |")
    print("|---|---|---|---|---|---|---|")
    for turn, (on, off, plain) in enumerate(zip(rows["kept"], rows["not kept"], rows["spec off"]), 1):
        print(f"| {turn} | {on[1]} | {on[2]} | {on[4]} / {off[4]} | {on[3]:.2f} / {off[3]:.2f} / {plain[3]:.2f} "
              f"| {off[3] / on[3]:.2f}x | {plain[3] / on[3]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny-wide")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--method", default="none", help="a head: its kept prefixes on and off")
    parser.add_argument("--adaptive", action="store_true", help="with --method: the profile's adaptive k, not k = 1")
    args = parser.parse_args()
    if args.method != "none":
        return head_turns(args)
    rows = {}
    for name, overrides in (("cache on", {}), ("cache off", {"kv__prefix_cache_mb": 0})):
        runtime = runtime_with(args.profile, speculative__method="none", **overrides)
        system = system_prompt(runtime.tokenizer, args.system_tokens)
        with RunningServer(runtime, max_batch=1) as server:
            rows[name] = conversation(server.url, system, args.max_tokens)
    print("| turn | prompt tokens | cached (on) | TTFT on (ms) | TTFT off (ms) | off ÷ on |")
    print("|---|---|---|---|---|---|")
    for turn, (on, off) in enumerate(zip(rows["cache on"], rows["cache off"]), 1):
        print(f"| {turn} | {on[1]} | {on[2]} | {on[0] * 1e3:.0f} | {off[0] * 1e3:.0f} | "
              f"{off[0] / on[0]:.1f}x |")


if __name__ == "__main__":
    main()
