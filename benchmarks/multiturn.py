"""Multi-turn TTFT: a 6-turn chat with a long system prompt, prefix cache on vs off.

One in-process server per variant (the second with kv.prefix_cache_mb = 0); each turn re-sends
the whole conversation through /v1/chat/completions (streamed) and the time to the first
content chunk is taken, with the reported cached tokens.

  flock /tmp/macspec-bench.lock python benchmarks/multiturn.py [--profile tiny-wide] [--system-tokens 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def conversation(url: str, system: str, max_tokens: int) -> list[tuple[float, int, int]]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages, out = [{"role": "system", "content": system}], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        start, first, answer, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            if chunk.choices:
                answer += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        messages.append({"role": "assistant", "content": answer})
        out.append((first or time.perf_counter() - start, usage.prompt_tokens,
                    usage.prompt_tokens_details.cached_tokens))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny-wide")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
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
