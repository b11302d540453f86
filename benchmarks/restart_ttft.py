"""Restart TTFT: a long system prompt's first request on a fresh `macspec serve`, cold (empty
cache dir) vs after a restart with `kv.prefix_cache_disk_gb` on (its KV read from disk).

Each variant is a new server process; the request is a streamed chat completion (openai
client) whose system prompt has about --system-tokens tokens; TTFT is the time to the first
content chunk. Output must be identical.

  flock /tmp/macspec-bench.lock python benchmarks/restart_ttft.py [--profile smollm2] [--system-tokens 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.multiturn import system_prompt  # noqa: E402
from macspec.config import find_profile, load_profile  # noqa: E402
from macspec.servebench.launch import LaunchedServer  # noqa: E402


def bench_profile(name: str, work: Path, system_tokens: int) -> Path:
    """The shipped profile with the disk cache on, in a dir of its own (so the cold server's is
    empty), and room for the prompt."""
    text = find_profile(name).read_text()
    extra = (f'\nprefix_cache_disk_gb = 2.0\nprefix_cache_disk_dir = "{work / "prefix-kv"}"\n'
             f"max_context = {system_tokens + 512}\n")
    lines = [line for line in text.splitlines() if not line.startswith("max_context")]
    text = "\n".join(lines).replace("[kv]", "[kv]" + extra, 1) if "[kv]" in text else \
        "\n".join(lines) + "\n[kv]" + extra
    path = work / f"{name}-restart.toml"
    path.write_text(text)
    return path


def first_request(profile: Path, work: Path, system: str) -> tuple[float, str, int]:
    """(TTFT s, text, cached tokens reported) of the first request on a fresh server."""
    server = LaunchedServer.macspec(str(profile), work)
    try:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        t0, ttft, parts, cached = time.perf_counter(), None, [], 0
        stream = client.chat.completions.create(
            model="default", temperature=0, max_tokens=24, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "Summarise the helpers in one sentence."}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage and chunk.usage.prompt_tokens_details:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        time.sleep(1.0)  # the idle engine writes the entry to disk
        return ttft, "".join(parts), cached
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smollm2")
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from macspec.models.loader import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_path(load_profile(args.profile).model.path)))
    system = system_prompt(tokenizer, args.system_tokens)
    colds, warms = [], []
    for _ in range(args.repeats):
        work = Path(tempfile.mkdtemp(prefix="macspec-restart-"))
        profile = bench_profile(args.profile, work, args.system_tokens)
        cold, cold_text, _ = first_request(profile, work, system)
        warm, warm_text, cached = first_request(profile, work, system)
        assert warm_text == cold_text, (cold_text, warm_text)
        colds.append(cold)
        warms.append(warm)
        print(f"cold {cold:.3f} s, after restart {warm:.3f} s ({cached} cached tokens), same output")
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"| {args.profile} | {len(tokenizer.encode(system))} | {cold:.2f} s | {warm:.2f} s | "
          f"{warm / cold:.2f}× |")


if __name__ == "__main__":
    main()
