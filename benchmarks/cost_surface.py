"""Step cost surface: the target forward's time for B rows × a window of W positions, through
the engine's runner (batched KV, the same forward a decode step runs), ÷ the time of W = 1 at
the same B. MoE targets read the experts their tokens route to, so the window's cost grows with
the distinct experts B·W tokens touch; dense targets read the same weights for any window.

  flock /tmp/macspec-bench.lock python benchmarks/cost_surface.py [--profiles tiny-moe,tiny-wide]
      [--routing trained,independent] [--bits 4] [--paths]

Rows and windows are held-out code (the forge's held-out stdlib files), so an MoE target routes
as it does on text. --routing picks tiny-moe's router (built:tiny-moe or
built:tiny-moe-independent) and prints the routing's statistics. --paths instead compares,
forward by forward on the same rows, the engine's MoE path (models/expert_union.py: a step's
pairs sorted by expert, or stacked per expert from STACK_FROM pairs per expert) with mlx-lm's
and with stacking at every size; each path's window ÷ its own W = 1 at the same B, against the
bytes floor: (non-expert bytes + the distinct experts' bytes) ÷ those of W = 1.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import nullcontext
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import macspec  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from macspec.config import load_profile  # noqa: E402
from macspec.engine.runner import TargetRunner  # noqa: E402
from macspec.engine.runtime import Runtime  # noqa: E402
from macspec import corpus  # noqa: E402
from macspec.models import expert_union  # noqa: E402
from macspec.models.textconfig import moe_shape  # noqa: E402

PATHS = ("mlx-lm", "engine", "stacked")

ROUTED = {"trained": "built:tiny-moe", "independent": "built:tiny-moe-independent"}


def load(profile: str, routing: str | None, bits: int | None) -> Runtime:
    loaded = load_profile(profile)
    loaded.override("speculative.method", "none", "bench")
    if routing:
        loaded.override("model.path", ROUTED[routing], "bench")
    runtime = Runtime.load(loaded)
    if bits:  # experts and dense layers quantized as mlx-community's builds are
        nn.quantize(runtime.target.model, group_size=64, bits=bits,
                    class_predicate=lambda _, m: hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding))
    return runtime


def text_rows(tokenizer, rows: int, length: int) -> mx.array:
    """`rows` distinct stretches of held-out code, `length` tokens each."""
    tokens: list[int] = []
    for text in corpus.read_texts(heldout=True):
        tokens += tokenizer.encode(text)
        if len(tokens) >= 16 * length * 16:
            break
    stride = len(tokens) // max(rows, 1)
    return mx.array([tokens[r * stride:r * stride + length] for r in range(rows)])


class Routes:
    """Records each MoE layer's expert indices (mlx-lm's gates return them), kept lazy so the
    forward runs as it would; read after it."""

    def __init__(self, model):
        self.seen: list[mx.array] = []
        self.layers = sum(1 for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "gate"))
        gate_class = next(type(layer.mlp.gate) for layer in model.model.layers
                          if hasattr(getattr(layer, "mlp", None), "gate"))
        original = gate_class.__call__

        def record(gate, x):
            inds, scores = original(gate, x)
            self.seen.append(inds)
            return inds, scores

        gate_class.__call__ = record

    def last(self) -> list[np.ndarray]:
        """The last forward's indices per layer, [tokens, top_k] each."""
        picked = self.seen[-self.layers:]
        self.seen.clear()
        return [np.array(s).reshape(-1, s.shape[-1]) for s in picked]

    def distinct(self) -> float:
        """Mean distinct experts per layer in the last forward."""
        return float(np.mean([len(np.unique(s)) for s in self.last()]))


def bytes_per_token(runtime: Runtime) -> tuple[float, float]:
    """(non-expert bytes read per token, one routed expert's bytes) of the target."""
    routed, other = 0, 0
    for name, value in tree_flatten(runtime.target.model.parameters()):
        if "switch_mlp" in name:
            routed += value.nbytes
        elif "embed_tokens" not in name:
            other += value.nbytes
    experts, _ = moe_shape(runtime.target.config)
    layers = sum(1 for layer in runtime.target.model.model.layers if hasattr(layer.mlp, "switch_mlp"))
    return other, routed / (experts * layers)


def surface(runtime: Runtime, rows: list[int], windows: list[int], repeats: int) -> dict:
    runner = TargetRunner(runtime.view)
    seconds = {}
    for b in rows:
        text = text_rows(runtime.tokenizer, b, 16 + max(windows))
        for w in windows:
            times = runner.time_forward(b, w, repeats + 1, text[:, :16 + w])[1:]  # the first pays one-off costs
            seconds[b, w] = statistics.median(times)
    return seconds


def routing_stats(runtime: Runtime) -> str:
    """Next-token overlap and distinct experts per window on held-out code, layer mean."""
    routes = Routes(runtime.target.model)
    text = text_rows(runtime.tokenizer, 1, 1024)
    mx.eval(runtime.target.model(text))
    per_layer = routes.last()
    top_k = per_layer[0].shape[1]
    overlap = np.mean([(s[1:, :, None] == s[:-1, None, :]).any(-1).sum(-1).mean() / top_k for s in per_layer])
    windows = {w: np.mean([np.mean([len(np.unique(s[i:i + w])) for i in range(0, len(s) - w, w)])
                           for s in per_layer]) for w in (2, 4, 8)}
    return (f"next-token overlap {overlap:.3f} (independent: {top_k / moe_shape(runtime.target.config)[0]:.3f}); "
            "distinct experts per window of " + ", ".join(f"{w}: {d:.1f}" for w, d in windows.items()))


def taking(path: str):
    """A forward through one MoE path: mlx-lm's own, the engine's choice, or stacked at any size."""
    if path == "mlx-lm":
        return expert_union.mlx_lm_path()
    return expert_union.forced("stacked") if path == "stacked" else nullcontext()


def path_comparison(runtime: Runtime, rows: list[int], windows: list[int], repeats: int) -> None:
    """The engine's path, mlx-lm's and stacking, in turn forward by forward on the same rows
    (this machine's load drifts), with the bytes floor from the experts each forward routed to."""
    runner = TargetRunner(runtime.view)
    routes = Routes(runtime.target.model)
    other, expert = bytes_per_token(runtime)
    layers = routes.layers
    print("| B | W | distinct experts/layer | mlx-lm (ms) | engine (ms) | stacked (ms) | engine ÷ mlx-lm "
          "| floor ÷ W=1 | mlx-lm ÷ W=1 | engine ÷ W=1 | stacked ÷ W=1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b in rows:
        text = text_rows(runtime.tokenizer, b, 16 + max(windows))
        base = None
        for w in windows:
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            for i in range(len(PATHS) * (repeats + 1)):
                path = PATHS[i % len(PATHS)]
                with taking(path):
                    times[path] += runner.time_forward(b, w, 2, text[:, :16 + w])[1:]
            distinct = routes.distinct()
            plain, engine, stacked = (statistics.median(times[p][1:]) for p in PATHS)
            floor_bytes = other + distinct * layers * expert  # what the step must read
            if base is None:  # W = 1 at this B, each path's own: what each ratio divides by
                base = (floor_bytes, plain, engine, stacked)
            print(f"| {b} | {w} | {distinct:.1f} | {plain * 1e3:.2f} | {engine * 1e3:.2f} | {stacked * 1e3:.2f} "
                  f"| {engine / plain:.2f} | {floor_bytes / base[0]:.2f} | {plain / base[1]:.2f} "
                  f"| {engine / base[2]:.2f} | {stacked / base[3]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="tiny-moe,tiny-wide")
    ap.add_argument("--routing", default="trained", help="tiny-moe's router(s): trained,independent")
    ap.add_argument("--bits", type=int, default=None, help="quantize the target in memory (e.g. 4)")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--windows", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", action="store_true",
                    help="compare the engine's MoE path with mlx-lm's on the MoE profiles")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    for profile in args.profiles.split(","):
        for routing in (args.routing.split(",") if profile.startswith("tiny-moe") else [None]):
            runtime = load(profile, routing, args.bits)
            moe = moe_shape(runtime.target.config)
            label = profile + (f", {routing} routing" if routing else "") + (f", {args.bits}-bit" if args.bits else "")
            if moe:
                print(f"\n{label}: {routing_stats(runtime)}")
            if args.paths:
                if moe:
                    print(f"\n### {label}: the engine's path, mlx-lm's and stacking (median ms of {args.repeats} forwards each, in turn)\n")
                    path_comparison(runtime, rows, windows, args.repeats)
                continue
            s = surface(runtime, rows, windows, args.repeats)
            print(f"\n### {label}: forward time ÷ W = 1 at the same B (W = 1 in ms)\n")
            print("| B | W=1 (ms) | " + " | ".join(f"W={w}" for w in windows[1:]) + " |")
            print("|---|---|" + "---|" * (len(windows) - 1))
            for b in rows:
                one = s[b, windows[0]]
                print(f"| {b} | {one * 1e3:.1f} | " + " | ".join(f"{s[b, w] / one:.2f}" for w in windows[1:]) + " |")
            print(f"\nB = {rows[-1]} ÷ B = {rows[0]} at W = 1: {s[rows[-1], windows[0]] / s[rows[0], windows[0]]:.2f}")


if __name__ == "__main__":
    main()
