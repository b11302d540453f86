"""Tokens per target forward, matched: macspec's engine vs mlx-lm's speculative_generate_step on
the same target/draft pair, the same prompts, greedy, the same stopping rule (exactly
--max-tokens, EOS ignored), each k fixed. Both emit the same tokens, so only the forward counts
can differ. mlx-lm does not report forwards; each of its decode forwards yields one token not
from the draft, except a last one whose own token max_tokens cut off, which that estimate misses.

    python benchmarks/forwards.py [--prompts 8] [--max-tokens 64] [--ks 2,4]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import bench_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="2,4")
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    from macspec.config import load_profile
    from macspec.engine.launch import calibrated_engine
    from macspec.engine.runtime import Runtime
    from macspec.models.loader import load_model
    from macspec.sampling import SamplingParams

    target, draft = load_model("embedded:tiny-target"), load_model("embedded:tiny-draft")
    engine = calibrated_engine(Runtime(load_profile("tiny"), target, "draft", draft=draft), max_batch=1)
    prompts = bench_prompts(target.tokenizer, args.prompts)
    print("| k | macspec tok/fwd (tokens, forwards) | mlx-lm tok/fwd (tokens, estimated forwards) | same tokens |")
    print("|---|---|---|---|")
    for k in (int(x) for x in args.ks.split(",")):
        ours, theirs, same = [0, 0], [0, 0], 0
        for prompt in prompts:
            done = engine.generate([prompt], SamplingParams(), args.max_tokens, num_draft=k,
                                   adaptive=False, ignore_eos=True)[0]
            ours[0] += len(done.tokens) - 1  # decode tokens: the first one comes from prefill
            ours[1] += done.stats["spec"]["target_forwards"]
            tokens, from_draft = [], 0
            for token, _, drafted in speculative_generate_step(
                    mx.array(prompt), target.model, draft.model, num_draft_tokens=k,
                    max_tokens=args.max_tokens, sampler=make_sampler(temp=0.0)):
                tokens.append(int(token))
                from_draft += int(drafted)
            theirs[0] += len(tokens) - 1
            theirs[1] += len(tokens) - 1 - from_draft
            same += tokens == done.tokens
        print(f"| {k} | {ours[0] / ours[1]:.3f} ({ours[0]}, {ours[1]}) | {theirs[0] / theirs[1]:.3f} "
              f"({theirs[0]}, {theirs[1]}) | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
