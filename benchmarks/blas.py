"""Which CPU BLAS, and how many threads: forward and decode cost on the 206M stand-in.

Each library runs in its own child process (a BLAS must be loaded before MLX, once per process):
the one macspec picks (`auto`: scipy-openblas32, renamed and checked), MLX's reference BLAS, and
any OpenBLAS given with --library (standard symbol names, e.g. a cmeel-openblas build). For each,
at each thread count: the median time of one target forward of W tokens on `built:tiny-wide`
(W = 1 and 8) and plain greedy decode tok/s through the engine.

    python benchmarks/blas.py [--library /path/libopenblas.so ...] [--threads 1,2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(args) -> None:
    import macspec  # noqa: F401  (loads the BLAS chosen by MACSPEC_BLAS first)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from macspec.blas import blas_info, set_threads
    from macspec.models.loader import load_model

    info = blas_info()
    if args.threads_now and info.name == "openblas":
        set_threads(args.threads_now)
    wide = load_model("built:tiny-wide", dtype="float32")
    prompt = mx.array([list(range(1, 65))])
    forward_ms = {}
    for window in (1, 8):
        cache = make_prompt_cache(wide.model)
        mx.eval(wide.model(prompt, cache=cache))
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            mx.eval(wide.model(mx.array([[7] * window]), cache=cache))
            times.append(time.perf_counter() - t0)
            for c in cache:
                c.trim(window)
        forward_ms[window] = statistics.median(times) * 1e3
    tok_s = decode_tok_s(wide, args.tokens)
    print(json.dumps({"blas": info.name, "core": info.core, "config": info.config,
                      "threads": info.threads, "forward_ms": forward_ms, "decode_tok_s": tok_s}))


def decode_tok_s(target, tokens: int) -> float:
    from macspec.config import load_profile
    from macspec.engine.launch import calibrated_engine
    from macspec.engine.runtime import Runtime
    from macspec.sampling import SamplingParams

    runtime = Runtime(load_profile("tiny-wide"), target, "none")
    engine = calibrated_engine(runtime, max_batch=1)
    prompt = list(range(5, 40))
    engine.generate([prompt], SamplingParams(), 8)  # warm-up
    [done] = engine.generate([prompt], SamplingParams(), tokens)
    return (done.stats["generated_tokens"] - 1) / done.stats["decode_s"]


def measure(library: str, threads: int, args) -> dict:
    env = {**os.environ, "MACSPEC_BLAS": library}
    env.pop("OPENBLAS_NUM_THREADS", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads-now", str(threads),
           "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--library", action="append", default=[], help="another OpenBLAS to compare")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--reference", action="store_true", help="also MLX's reference BLAS (slow)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads-now", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    libraries = ["auto", *args.library] + (["reference"] if args.reference else [])
    print("| BLAS | kernels | threads | forward W=1 ms | W=8 ms | W=8 ÷ W=1 | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for library in libraries:
        for threads in [int(t) for t in args.threads.split(",")]:
            r = measure(library, threads, args)
            if "error" in r:
                print(f"| {library} | error: {r['error']} | {threads} | | | | |", flush=True)
                continue
            name = "scipy-openblas32" if library == "auto" else r["blas"] if library == "reference" else library
            f1, f8 = r["forward_ms"]["1"], r["forward_ms"]["8"]
            print(f"| {name} | {r['core'] or '-'} | {r['threads'] or '-'} | {f1:.1f} | {f8:.1f} | "
                  f"{f8 / f1:.2f} | {r['decode_tok_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
