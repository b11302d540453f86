"""Step cost surface: the target forward's time for B rows × a window of W positions, through
the engine's runner (batched KV, the same forward a decode step runs), ÷ the time of W = 1 at
the same B. MoE targets read the experts their tokens route to, so the window's cost grows with
the distinct experts B·W tokens touch; dense targets read the same weights for any window.

  flock /tmp/macspec-bench.lock python benchmarks/cost_surface.py [--profiles tiny-moe,tiny-wide]
      [--sort-from N]

--sort-from N instead compares, forward by forward, grouping an MoE layer's tokens by expert
(mlx-lm's `sorted_indices` path) from N (token, expert) slots with mlx-lm's 64: does grouping a
small step's reads pay on this CPU?
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import macspec  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from macspec.config import load_profile  # noqa: E402
from macspec.engine.runner import TargetRunner  # noqa: E402
from macspec.engine.runtime import Runtime  # noqa: E402
from macspec.models.textconfig import moe_shape  # noqa: E402


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


SORT_FROM = [64]  # mlx-lm's SwitchGLU sorts tokens by expert from 64 (token, expert) slots


def sort_from_patch() -> None:
    """mlx-lm's SwitchGLU with its sort threshold read from SORT_FROM (switchable per forward)."""
    from mlx_lm.models import switch_layers as sl

    def call(self, x, indices):
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= SORT_FROM[0]
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = sl._gather_sort(x, indices)
        x_up = self.up_proj(x, idx, sorted_indices=do_sort)
        x_gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        x = self.down_proj(self.activation(x_up, x_gate), idx, sorted_indices=do_sort)
        if do_sort:
            x = sl._scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)

    sl.SwitchGLU.__call__ = call


def sort_comparison(profile: str, rows: list[int], windows: list[int], repeats: int, threshold: int) -> None:
    """Forward time at mlx-lm's threshold and at `threshold`, alternating forward by forward on
    the same rows (this machine's load drifts), for the shapes where the two differ."""
    sort_from_patch()
    loaded = load_profile(profile)
    loaded.override("speculative.method", "none", "bench")
    runtime = Runtime.load(loaded)
    runner = TargetRunner(runtime.view)
    top_k = moe_shape(runtime.target.config)[1]
    print(f"\n### {profile}: grouping tokens by expert from {threshold} slots vs mlx-lm's 64 "
          f"(median ms of {repeats} alternating forwards)\n")
    print("| B | W | slots | mlx-lm (ms) | sorted (ms) | sorted ÷ mlx-lm |")
    print("|---|---|---|---|---|---|")
    for b in rows:
        for w in windows:
            if not threshold <= b * w * top_k < 64:
                continue
            times: dict[int, list[float]] = {64: [], threshold: []}
            for i in range(2 * repeats + 2):
                SORT_FROM[0] = (64, threshold)[i % 2]
                times[SORT_FROM[0]] += runner.time_forward(b, w, 2)[1:]
            plain, grouped = (statistics.median(times[t][1:]) for t in (64, threshold))
            print(f"| {b} | {w} | {b * w * top_k} | {plain * 1e3:.2f} | {grouped * 1e3:.2f} | "
                  f"{grouped / plain:.3f} |", flush=True)
    SORT_FROM[0] = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="tiny-moe,tiny-wide")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--windows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sort-from", type=int, default=None,
                    help="compare grouping tokens by expert from this many (token, expert) slots "
                    "with mlx-lm's 64, on the MoE profiles, instead of the surface")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    for profile in args.profiles.split(","):
        if args.sort_from is not None:
            sort_comparison(profile, rows, windows, args.repeats, args.sort_from)
            continue
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
