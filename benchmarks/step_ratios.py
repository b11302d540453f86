"""How far a decode step's seconds stray from what the step-cost table expected of its cell, in
process, adaptive at 1, 4 and 16 rows: the most for each cell's first step and for later ones,
and how many read over ONE_OFF (costs.py skips those once per cell as one-off work, as a GPU's
first step at a new shape is). On this CPU none should.

    python benchmarks/step_ratios.py --profile tiny --methods draft,mtp,dflash
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--methods", default="draft,mtp")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    import macspec  # noqa: F401  (BLAS before mlx)
    from benchmarks.common import bench_prompts, generate_in_batches
    from benchmarks.gpu import runtime_for
    from macspec.engine.launch import calibrated_engine
    from macspec.speculative import costs

    seen, firsts, later = set(), [], []
    observe = costs.StepCosts.observe

    def watched(self, chain, rows, window, seconds):
        ratio = seconds / self.seconds(chain, rows, window)
        (later if (chain, rows, window) in seen else firsts).append((ratio, chain or "plain", rows, window))
        seen.add((chain, rows, window))
        observe(self, chain, rows, window, seconds)

    costs.StepCosts.observe = watched
    runtime = runtime_for(args.profile)
    engine = calibrated_engine(runtime, max_batch=16)
    prompts = bench_prompts(runtime.tokenizer, 16, length=48)
    for method in args.methods.split(","):
        for batch in (1, 4, 16):
            generate_in_batches(engine, prompts, batch, args.tokens, method, None, adaptive=True)
    for name, ratios in (("cells' first steps", firsts), ("later steps", later)):
        top = sorted(ratios, reverse=True)[:3]
        over = sum(r > costs.ONE_OFF for r, *_ in ratios)
        print(f"{args.profile} {name}: {len(ratios)} steps, {over} over {costs.ONE_OFF}x; the most: "
              + ", ".join(f"{r:.2f}x ({c}, {b} rows, W = {w})" for r, c, b, w in top))


if __name__ == "__main__":
    main()
