"""Speculative decoding benchmark: ratios measured side by side in one run.

For the embedded target and its bandwidth-bound stand-in (the target widened to ~200M
parameters, same logits), on held-out stdlib prompts, all through the engine `serve` uses
(batch of one): tokens per target forward and decode tok/s for plain decoding (and
mlx_lm.stream_generate on the same model, the outside reference), macspec with each proposer
at fixed k and adaptive, and mlx-lm's
speculative_generate_step on the same pair, at T = 0 and T = 0.7, with OpenBLAS on and off
(each BLAS in its own process, since the choice is made before mlx is imported).

    python benchmarks/spec.py                  # full table (~15 min on 2 cores)
    python benchmarks/spec.py --quick          # fewer configurations
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="k in {2,4}")
    ap.add_argument("--ks", default="1,2,3,4,6,8", help="fixed k values to measure")
    ap.add_argument("--blas", choices=["both", "openblas", "reference"], default="both")
    ap.add_argument("--models", default="tiny,wide", help="comma list of tiny, wide")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--wide-hidden", type=int, default=1664, help="stand-in hidden size (~200M params)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", help="also write the rows as JSON here")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- child (one BLAS)

def child(args) -> list[dict]:
    sys.path.insert(0, ROOT)
    import macspec  # noqa: F401  (BLAS first)
    from macspec.blas import blas_info

    import mlx.core as mx

    from benchmarks.common import bench_prompts, load_family, time_macspec, time_mlx_lm, time_mlx_lm_plain

    family = load_family(args.wide_hidden, [m for m in args.models.split(",") if m])
    prompts = bench_prompts(family["tokenizer"], args.prompts)
    ks = [2, 4] if args.quick else [int(k) for k in args.ks.split(",")]
    rows = []
    blas = blas_info().name
    for model_name, runtimes in family["targets"].items():
        for temp in [float(t) for t in args.temperatures.split(",")]:
            base = dict(blas=blas, model=model_name, temperature=temp)

            def add(row):
                rows.append({**base, **row})
                print(json.dumps(rows[-1]), flush=True)
                print(f"#   {model_name} T={temp} {row['config']}: {row['tok_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)

            add(time_macspec(runtimes["none"], prompts, args.max_tokens, temp, None, False, "plain"))
            add(time_mlx_lm_plain(runtimes["none"], prompts, args.max_tokens, temp))
            for method in ("draft", "mtp", "ngram"):
                for k in ks:
                    add(time_macspec(runtimes[method], prompts, args.max_tokens, temp, k, False, f"{method} k={k}"))
                add(time_macspec(runtimes[method], prompts, args.max_tokens, temp, max(ks), True,
                                 f"{method} adaptive"))
            for k in ([2, 4] if args.quick else [2, 4, 6]):
                add(time_mlx_lm(runtimes["draft"], prompts, args.max_tokens, temp, k))
            mx.clear_cache()
    return rows


# ---------------------------------------------------------------- parent (table)

def run_children(args) -> list[dict]:
    modes = ["openblas", "reference"] if args.blas == "both" else [args.blas]
    rows = []
    for mode in modes:
        env = {**os.environ, "MACSPEC_BLAS": mode if mode == "reference" else "auto"}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--blas", mode,
               "--models", args.models, "--temperatures", args.temperatures,
               "--wide-hidden", str(args.wide_hidden), "--prompts", str(args.prompts),
               "--max-tokens", str(args.max_tokens), "--ks", args.ks,
               *(["--quick"] if args.quick else [])]
        print(f"# running {mode} BLAS ...", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # progress on stderr
        if out.returncode:
            raise SystemExit(f"bench child ({mode}) failed")
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return rows


def print_table(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["blas"], r["model"], r["temperature"]), []).append(r)
    for (blas, model, temp), group in groups.items():
        plain = next(r for r in group if r["config"] == "plain")
        best = max((r for r in group if r["config"] != "plain"), key=lambda r: r["tok_s"])
        print(f"\n## {model} target, T={temp}, BLAS={blas}  (plain {plain['tok_s']:.1f} tok/s; "
              f"best {best['config']} {best['tok_s'] / plain['tok_s']:.2f}x)")
        print(f"| config | tok/s | x plain | tokens/forward | acceptance | mean k |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in group:
            print(f"| {r['config']} | {r['tok_s']:.1f} | {r['tok_s'] / plain['tok_s']:.2f} | "
                  f"{r['tokens_per_forward']:.2f} | {r['acceptance']:.2f} | {r['mean_k']:.2f} |")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    start = time.perf_counter()
    rows = run_children(args)
    print_table(rows)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
