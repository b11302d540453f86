"""What sampling costs per decode step, through the engine: method none, a batch of B requests
decoding together, each sampler's step time ÷ greedy's, measured interleaved in one process.

    python benchmarks/sampling.py [--profiles tiny,smollm2] [--batches 1,8] [--tokens 64]

Every request ignores EOS, so both sides decode the same number of steps; the time is the
engine's own decode time (`decode_s`) per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import macspec  # noqa: E402,F401  (BLAS first)

SAMPLERS = {
    "greedy": {},
    "T=0.7": {"temperature": 0.7},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=0.7 top_k=50": {"temperature": 0.7, "top_k": 50},
    "T=0.7 min_p=0.05": {"temperature": 0.7, "min_p": 0.05},
}


def step_ms(engine, prompts, params, tokens: int) -> float:
    """Mean decode step time (ms) of a batch decoding `tokens` tokens per request."""
    done = engine.generate(prompts, params, tokens, ignore_eos=True)
    steps = max(d.stats["generated_tokens"] - 1 for d in done)
    return max(d.stats["decode_s"] for d in done) / max(steps, 1) * 1e3


def main(argv=None) -> None:
    from macspec.config import load_profile
    from macspec.engine.launch import build_engine
    from macspec.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="tiny,smollm2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print("| profile | batch | " + " | ".join(f"{name} ÷ greedy" for name in SAMPLERS if name != "greedy")
          + " | greedy step ms |")
    print("|---|---:|" + "---:|" * len(SAMPLERS))
    for name in args.profiles.split(","):
        profile = load_profile(name)
        profile.speculative.method = "none"
        engine = build_engine(profile, max_batch=max(int(b) for b in args.batches.split(",")))
        vocab = engine.runtime.target.model.args.vocab_size
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = [[(17 * i + j) % 1000 + 10 for j in range(24)] for i in range(batch)]
            times: dict[str, list[float]] = {s: [] for s in SAMPLERS}
            for round_ in range(args.rounds + 1):  # round 0 warms up
                for sampler, kw in SAMPLERS.items():
                    params = SamplingParams(seed=round_, **kw)
                    ms = step_ms(engine, prompts, params, args.tokens)
                    if round_:
                        times[sampler].append(ms)
            greedy = statistics.median(times["greedy"])
            ratios = [statistics.median(times[s]) / greedy for s in SAMPLERS if s != "greedy"]
            print(f"| {name} (V={vocab}) | {batch} | " + " | ".join(f"{r:.2f}" for r in ratios)
                  + f" | {greedy:.1f} |", flush=True)
        engine.close()


if __name__ == "__main__":
    main()
