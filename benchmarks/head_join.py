"""What a head's row costs before it drafts: the join (its context into the head's cache) and the
first proposal after P more states, for B rows, through the block's attention alone where the
group uses it (models/mtp.py `feed`) against the whole block. Drafts are compared as well.

    python benchmarks/head_join.py [--target tiny-moe] [--method mtp] [--rows 1,4,16]
        [--pending 2,3,16] [--repeats 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny-moe")
    ap.add_argument("--method", default="mtp", choices=("mtp", "eagle3"))
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--pending", default="2,3,16")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()

    import macspec  # noqa: F401  (BLAS before mlx)
    import mlx.core as mx

    from benchmarks.common import bench_prompts
    from macspec.config import load_profile
    from macspec.engine.runtime import Runtime
    from macspec.sampling import Rng, RowContext, SamplingParams
    from macspec.speculative.base import ChainRow

    runtime = Runtime.load(load_profile(args.target))
    runtime.ensure_method(args.method)
    view = runtime.view
    context, most = 96, max(int(p) for p in args.pending.split(","))
    prompts = bench_prompts(runtime.tokenizer, 16, length=context + most + 1)
    states = [view.states(view.hidden(mx.array(p)[None]))[0] for p in prompts]
    mx.eval(states)

    def row(i: int, length: int) -> ChainRow:
        return ChainRow(i, RowContext(SamplingParams(), prompts[i][:length]), 1, Rng(0))

    def once(rows: int, pending: int, alone: bool):
        group = runtime.make_group(args.method, runtime.vocab_size)
        group.attention_alone = None if alone else False  # None: checked (and used) as serving does
        for i in range(rows):
            group.join(i, prompts[i][:context], states[i][:context])
        t0 = time.perf_counter()
        group.start_rows([row(i, context) for i in range(rows)])
        joined = time.perf_counter() - t0
        for i in range(rows):
            group.observe(i, states[i][context:context + pending])
        t0 = time.perf_counter()
        drafts = group.propose([row(i, context + pending + 1) for i in range(rows)])
        mx.eval([d.tokens for d in drafts.values()], group.cache_arrays())
        return joined, time.perf_counter() - t0, [d.tokens.tolist() for d in drafts.values()]

    print(f"{args.target} {args.method}: ms, attention alone / whole block (best of {args.repeats})")
    for rows in [int(r) for r in args.rows.split(",")]:
        for pending in [int(p) for p in args.pending.split(",")]:
            best = {True: [float("inf")] * 2, False: [float("inf")] * 2}
            same = True
            for _ in range(args.repeats):
                got = {}
                for alone in (True, False):
                    joined, proposed, got[alone] = once(rows, pending, alone)
                    best[alone] = [min(best[alone][0], joined), min(best[alone][1], proposed)]
                same = same and got[True] == got[False]
            print(f"B={rows:2d} P={pending:2d}: join {best[True][0] * 1e3:6.1f} / {best[False][0] * 1e3:6.1f}   "
                  f"first proposal {best[True][1] * 1e3:6.1f} / {best[False][1] * 1e3:6.1f}   "
                  f"drafts {'equal' if same else 'differ'}", flush=True)


if __name__ == "__main__":
    main()
