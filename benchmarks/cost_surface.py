"""Step cost surface: the target forward's time for B rows × a window of W positions, through
the engine's runner (batched KV, the same forward a decode step runs), ÷ the time of W = 1 at
the same B. MoE targets read the experts their tokens route to, so the window's cost grows with
the distinct experts B·W tokens touch; dense targets read the same weights for any window.

  flock /tmp/macspec-bench.lock python benchmarks/cost_surface.py [--profiles tiny-moe,tiny-wide]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import macspec  # noqa: E402,F401  (OpenBLAS before mlx)
from macspec.config import load_profile  # noqa: E402
from macspec.engine.runner import TargetRunner  # noqa: E402
from macspec.engine.runtime import Runtime  # noqa: E402
from macspec.spec.planner import moe_shape  # noqa: E402


def surface(profile: str, rows: list[int], windows: list[int], repeats: int) -> dict:
    loaded = load_profile(profile)
    loaded.override("speculative.method", "none", "bench")
    runtime = Runtime.load(loaded)
    runner = TargetRunner(runtime.view)
    seconds = {}
    for b in rows:
        for w in windows:
            times = runner.time_forward(b, w, repeats + 1)[1:]  # the first pays one-off costs
            seconds[b, w] = statistics.median(times)
    return {"seconds": seconds, "moe": moe_shape(runtime.target.config)}


def distinct_ratio(moe, tokens: int) -> str:
    """Expected distinct experts read by `tokens` independently routed tokens ÷ one token's."""
    if moe is None:
        return "—"
    experts, top_k = moe
    return f"{experts * (1 - (1 - top_k / experts) ** tokens) / top_k:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="tiny-moe,tiny-wide")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--windows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    for profile in args.profiles.split(","):
        result = surface(profile, rows, windows, args.repeats)
        s, moe = result["seconds"], result["moe"]
        print(f"\n### {profile}: forward time ÷ W = 1 at the same B (W = 1 in ms)\n")
        print("| B | W=1 (ms) | " + " | ".join(f"W={w}" for w in windows[1:]) + " |")
        print("|---|---|" + "---|" * (len(windows) - 1))
        for b in rows:
            one = s[b, windows[0]]
            print(f"| {b} | {one * 1e3:.1f} | " + " | ".join(f"{s[b, w] / one:.2f}" for w in windows[1:]) + " |")
        if moe:
            print(f"| distinct experts ÷ top-k, B=1 ({moe[0]} experts, top {moe[1]}) | 1.00 | "
                  + " | ".join(distinct_ratio(moe, w) for w in windows[1:]) + " |")
        print(f"\nB = 16 ÷ B = 1 at W = 1: {s[rows[-1], windows[0]] / s[rows[0], windows[0]]:.2f}")


if __name__ == "__main__":
    main()
