"""Prefix-cache lookup: the radix tree vs the linear scan it replaced, at agent sizes.

`--entries` stored sequences of `--tokens` tokens share a common system prompt (half of them)
and then diverge, as agent sessions do; each lookup is a new turn of one of them. Prints the
median lookup time of each index and the ratio.

  python benchmarks/prefix_lookup.py [--entries 64] [--tokens 20000] [--lookups 50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from macspec.kv.cache import first_divergence  # noqa: E402
from macspec.kv.prefix import PrefixCache  # noqa: E402


def linear_lookup(keys: list[tuple[int, ...]], prompt: list[int]) -> tuple[int, tuple | None]:
    """The scan kv/prefix.py did before the radix tree."""
    best_len, best_key = 0, None
    for key in keys:
        n = min(first_divergence(key, prompt), len(prompt) - 1)
        if n > best_len:
            best_len, best_key = n, key
    return best_len, best_key


def sessions(entries: int, tokens: int, rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(150_000) for _ in range(tokens // 2)]
    return [system + [rng.randrange(150_000) for _ in range(tokens - len(system))] for _ in range(entries)]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--lookups", type=int, default=50)
    args = parser.parse_args()
    rng = random.Random(0)
    stored = sessions(args.entries, args.tokens, rng)
    cache = PrefixCache(max_bytes=2**62)
    for tokens in stored:
        cache.store(tokens, 1)
    keys = list(cache.entries)
    prompts = [stored[rng.randrange(len(stored))] + [rng.randrange(150_000) for _ in range(200)]
               for _ in range(args.lookups)]
    for prompt in prompts[:3]:  # both indexes find the same length
        assert cache.lookup(prompt)[0] == linear_lookup(keys, prompt)[0]
    radix = timed(lambda: [cache.lookup(p) for p in prompts], 3) / len(prompts)
    linear = timed(lambda: [linear_lookup(keys, p) for p in prompts[:5]], 3) / 5
    print(f"{args.entries} entries x {args.tokens} tokens: radix {radix * 1e3:.3f} ms, "
          f"linear scan {linear * 1e3:.1f} ms per lookup ({linear / radix:.0f}x)")


if __name__ == "__main__":
    main()
