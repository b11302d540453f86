"""Plain decoding through the engine (batch of one) vs mlx_lm.stream_generate, same model.

Interleaved rounds (engine, mlx-lm, engine, mlx-lm, ...), each one held-out prompt (cycling),
greedy, so both decode the same tokens; prints decode tok/s per round and the medians (this
machine is shared and noisy: the median of paired rounds is what to read).

    python benchmarks/plain.py [--models tiny,wide] [--rounds 12] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import macspec  # noqa: E402,F401  (BLAS first)
from macspec.blas import blas_info  # noqa: E402

from benchmarks.common import bench_prompts, load_family, time_macspec, time_mlx_lm_plain  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,wide")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--wide-hidden", type=int, default=1664)
    args = ap.parse_args(argv)
    family = load_family(args.wide_hidden, args.models.split(","))
    prompts = bench_prompts(family["tokenizer"], args.prompts)
    print(f"BLAS {blas_info().name}; {args.max_tokens} tokens per round, greedy, {args.rounds} "
          f"interleaved rounds over {args.prompts} prompts")
    print("| model | engine tok/s (median, best) | mlx_lm.stream_generate tok/s (median, best) | "
          "ratio median of rounds | ratio best/best |")
    print("|---|---|---|---:|---:|")
    for name, runtimes in family["targets"].items():
        ours, theirs = [], []
        for round_ in range(args.rounds):
            prompt = [prompts[round_ % len(prompts)]]  # (each timing call warms up on it first)
            ours.append(time_macspec(runtimes["none"], prompt, args.max_tokens, 0.0, None, False, "plain")["tok_s"])
            theirs.append(time_mlx_lm_plain(runtimes["none"], prompt, args.max_tokens, 0.0)["tok_s"])
            print(f"#  {name}: engine {ours[-1]:.1f}, mlx-lm {theirs[-1]:.1f}", file=sys.stderr, flush=True)
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"| {name} | {statistics.median(ours):.1f}, {max(ours):.1f} | "
              f"{statistics.median(theirs):.1f}, {max(theirs):.1f} | {ratio:.3f} | "
              f"{max(ours) / max(theirs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
