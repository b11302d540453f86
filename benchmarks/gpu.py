"""One command for a machine with an NVIDIA GPU (MLX's CUDA backend): a report in markdown + json.

Phases, each in its own process (a crash or a hang loses that phase, not the report), in order,
until --budget-s runs out:
  env       the backend, GPU name, memory and driver as MLX and nvidia-smi see them; `macspec
            doctor`; the copy bandwidth MLX reaches (read + write) beside the GPU's nominal one
  lossless  greedy spec == plain through the engine for every proposer (k = 3, fixed), each prompt
            alone and all prompts in one batch, in the GPU's dtype (bfloat16) and in float32;
            at a divergence, the plain logits' top-1 - top-2 margin there (a near-tie is
            numerics: a W-token forward rounds differently from a 1-token one)
  decode    plain decode tok/s through the engine (batch of one) and mlx_lm.stream_generate, and
            the fraction of bandwidth it reaches (bytes read per token x tok/s / bandwidth) on
            tiny-wide, tiny-moe and a widened dense target (--big-hidden)
  surface   the verify cost surface: forward time for B rows x W positions ÷ W = 1, dense vs MoE
            (MoE: the engine's path, mlx-lm's, and the sorted and stacked groupings; bfloat16 and 4-bit experts)
  prefill   a prompt's prefill (tiny-wide) through the unfused attention vs MLX's kernel (cuDNN on
            CUDA: one graph per new shape), for prompt lengths seen for the first time and again
  overhead  in-process on tiny, batch 1 and 16: tok/s of each proposer at fixed k = 0 (its
            bookkeeping alone), k = 1 and adaptive ÷ plain, and where the host's time goes (cProfile)
  serve     benchmarks/serve.py through `macspec serve`: spec on ÷ off at c = 1, 4, 16 on tiny-wide
            and tiny-moe (draft and MTP), and on tiny (DFlash, EAGLE-3, MTP)

    python benchmarks/gpu.py --out DIR [--phases env,lossless,decode,surface,prefill,overhead,serve]
        [--budget-s 480] [--serve-targets tiny,tiny-moe] [--serve-repeats 1]
        [--overhead-methods draft,mtp] [--overhead-ks k=0,adaptive] [--overhead-profiles "draft adaptive@1"]
        [--smoke]   (tiny sizes: checks the script on a CPU in a few minutes)

Writes DIR/report.md, DIR/report.json and DIR/log.txt (every phase's output), after each phase.
On a machine without network: `python benchmarks/gpu_payload.py` packs the wheels into .gpu/
(git-ignored locally), which travels with the repo; there `bash .gpu/run.sh TIMEOUT_S BUDGET_S`
installs them and runs this (on 2026-11-26: ~7 minutes on an H200, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("env", "lossless", "decode", "surface", "prefill", "overhead", "serve")
NEEDS_S = {"env": 20, "lossless": 60, "decode": 60, "surface": 40, "prefill": 20, "overhead": 30,
           "serve": 90}  # least worth starting
CAP_S = {"env": 90, "lossless": 150, "decode": 170, "surface": 110, "prefill": 90, "overhead": 240,
         "serve": 330}  # no phase starves the rest
NOMINAL_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "A100": 2.0}
MAX_TOKENS = 40


def gpu_dtype() -> str:
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def runtime_for(profile_name: str, method: str = "none", dtype: str | None = None, path: str | None = None):
    from macspec.config import load_profile
    from macspec.engine.runtime import Runtime

    profile = load_profile(profile_name)
    profile.override("speculative.method", method, "gpu bench")
    profile.override("model.dtype", dtype or gpu_dtype(), "gpu bench")
    if path:
        profile.override("model.path", path, "gpu bench")
    return Runtime.load(profile)


def release() -> None:
    import mlx.core as mx

    from benchmarks import common

    common._ENGINES.clear()
    _ENGINES.clear()
    gc.collect()
    mx.clear_cache()


# ---- env ------------------------------------------------------------------------------------
def phase_env(args) -> dict:
    import mlx.core as mx

    from macspec.monitor.memory import backend_name, device_limits

    out = {"backend": backend_name(), "default_device": str(mx.default_device()), "mlx": mx.__version__,
           "device_info": {k: (v if isinstance(v, (int, float, str)) else str(v))
                           for k, v in (mx.device_info() if hasattr(mx, "device_info") else {}).items()},
           "limits": device_limits()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        out["nvidia_smi"] = f"unavailable: {err}"
    doctor = subprocess.run([sys.executable, "-m", "macspec", "doctor", "--json", "--profile", "tiny"],
                            capture_output=True, text=True, timeout=120)
    try:
        out["doctor"] = json.loads(doctor.stdout)
    except ValueError:
        out["doctor"] = {"exit": doctor.returncode, "stdout": doctor.stdout[-2000:], "stderr": doctor.stderr[-2000:]}
    out["copy_bandwidth_tbps"] = copy_bandwidth(64 if args.smoke else 2048)
    name = out["nvidia_smi"].split(",")[0]
    out["nominal_tbps"] = next((v for k, v in NOMINAL_TBPS.items() if k in name), None)
    return out


def copy_bandwidth(mib: int) -> float:
    """TB/s of y = x + 1 over a `mib` MiB float32 array (bytes read + written), best of 10."""
    import mlx.core as mx

    x = mx.zeros((mib * 2**18,), mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(12):
        t0 = time.perf_counter()
        mx.eval(x + 1)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best / 1e12


# ---- lossless -------------------------------------------------------------------------------
def phase_lossless(args) -> dict:
    from macspec.proposers import PROPOSER_NAMES
    from macspec.sampling import SamplingParams

    from benchmarks.common import bench_prompts

    params = SamplingParams()
    count = 4 if args.smoke else 8
    results = {}
    for dtype in ([gpu_dtype()] if args.smoke else [gpu_dtype(), "float32"]):
        # One runtime, one engine: every proposer through the request's method (as `serve` does);
        # the tiny profile names the draft, and the EAGLE-3 head and MTP layer ship with the target.
        runtime = runtime_for("tiny", "none", dtype)
        prompts = bench_prompts(runtime.tokenizer, count, length=48)
        alone = [generate(runtime, [p], params)[0] for p in prompts]
        rows = {"plain batched": compare(runtime, prompts, alone, generate(runtime, prompts, params), 0)}
        for method in (PROPOSER_NAMES[:3] if args.smoke else PROPOSER_NAMES):
            single = [generate(runtime, [p], params, k=3, method=method)[0] for p in prompts]
            batched = generate(runtime, prompts, params, k=3, method=method)
            for label, got in ((f"{method} alone", single), (f"{method} batched", batched)):
                rows[label] = compare(runtime, prompts, alone, got, sum(c.stats["spec"]["drafted"] for c in got))
            save(args, "lossless", {"prompts": count, "max_tokens": MAX_TOKENS, "k": 3,
                                    "by_dtype": {**results, dtype: rows}})
            print(f"{dtype} {method}: alone {rows[f'{method} alone']['equal']}/{count}, batched "
                  f"{rows[f'{method} batched']['equal']}/{count}", flush=True)
        results[dtype] = rows
        del runtime
        release()
    return {"prompts": count, "max_tokens": MAX_TOKENS, "k": 3, "by_dtype": results}


_ENGINES: dict = {}


def generate(runtime, prompts, params, k=None, method=None):
    """Through one 8-row engine per runtime (calibrated as `serve` starts)."""
    from macspec.engine.launch import calibrated_engine

    if id(runtime) not in _ENGINES:
        _ENGINES[id(runtime)] = calibrated_engine(runtime, max_batch=8)
    done = _ENGINES[id(runtime)].generate(
        prompts, params, MAX_TOKENS, num_draft=k, adaptive=False, ignore_eos=True, method=method)
    for d in done:
        if d.error is not None:
            raise d.error
    return done


def compare(plain_rt, prompts, expected, got, drafted: int) -> dict:
    """Prompts whose tokens equal plain's; at each divergence, plain's top-1 - top-2 logit there."""
    import mlx.core as mx

    equal, margins = 0, []
    for prompt, want, have in zip(prompts, expected, got):
        if have.tokens == want.tokens:
            equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(want.tokens, have.tokens + [-1] * len(want.tokens))) if a != b)
        logits = plain_rt.target.model(mx.array(prompt + want.tokens[:at])[None])[0, -1].astype(mx.float32)
        top = mx.sort(logits)[-2:].tolist()
        margins.append({"position": at, "margin": round(top[1] - top[0], 5)})
    return {"equal": equal, "of": len(prompts), "drafted": drafted, "divergences": margins}


# ---- decode ---------------------------------------------------------------------------------
def phase_decode(args) -> dict:
    from mlx.utils import tree_flatten

    from benchmarks.common import bench_prompts, time_macspec, time_mlx_lm_plain
    from benchmarks.cost_surface import bytes_per_token
    from macspec.models.textconfig import moe_shape

    env = read_json(args.work / "env.json")
    bandwidth = (env.get("nominal_tbps") or env.get("copy_bandwidth_tbps") or 0) * 1e12
    measured = (env.get("copy_bandwidth_tbps") or 0) * 1e12
    targets = [("tiny-wide", "tiny-wide", None), ("tiny-moe", "tiny-moe", None)]
    if not args.smoke:
        targets.append((f"tiny-wide-{args.big_hidden}", "tiny-wide", f"built:tiny-wide-{args.big_hidden}"))
    rows = []
    for label, profile, path in targets:
        t0 = time.perf_counter()
        runtime = runtime_for(profile, "none", path=path)
        load_s = time.perf_counter() - t0
        model = runtime.target.model
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        moe = moe_shape(runtime.target.config)
        if moe:  # non-expert weights + top-k routed experts per MoE layer
            other, expert = bytes_per_token(runtime)
            layers = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "switch_mlp"))
            read = other + expert * moe[1] * layers
        else:
            read = sum(v.nbytes for name, v in tree_flatten(model.parameters())
                       if "embed_tokens" not in name or runtime.target.config.get("tie_word_embeddings"))
        prompts = bench_prompts(runtime.tokenizer, 2)
        tokens = 32 if args.smoke else 256
        ours = time_macspec(runtime, prompts, tokens, 0.0, None, False, "plain")
        theirs = time_mlx_lm_plain(runtime, prompts, tokens, 0.0)
        row = {"model": label, "params_m": round(params / 1e6, 1), "dtype": str(model.parameters()["model"]["norm"]["weight"].dtype).split(".")[-1],
               "bytes_per_token_mb": round(read / 1e6, 1), "load_s": round(load_s, 1),
               "engine_tok_s": round(ours["tok_s"], 1), "mlx_lm_tok_s": round(theirs["tok_s"], 1),
               "engine_bandwidth_fraction": round(read * ours["tok_s"] / bandwidth, 3) if bandwidth else None,
               "engine_fraction_of_copy": round(read * ours["tok_s"] / measured, 3) if measured else None,
               "mlx_lm_bandwidth_fraction": round(read * theirs["tok_s"] / bandwidth, 3) if bandwidth else None}
        print(row, flush=True)
        rows.append(row)
        save(args, "decode", {"tokens": tokens, "bandwidth_tbps": bandwidth / 1e12, "rows": rows})
        del runtime, model
        release()
    return {"tokens": tokens, "bandwidth_tbps": bandwidth / 1e12, "rows": rows}


# ---- surface --------------------------------------------------------------------------------
def phase_surface(args) -> dict:
    import mlx.nn as nn

    from benchmarks.cost_surface import text_rows
    from macspec.engine.runner import TargetRunner
    from macspec.models import expert_union

    rows_list = [1, 4] if args.smoke else [1, 4, 16]
    windows = [1, 2, 4] if args.smoke else [1, 2, 3, 4, 6, 8]
    repeats = 2 if args.smoke else 7
    out = {"rows": rows_list, "windows": windows, "repeats": repeats, "tables": {}}
    moe_paths = {"engine": None, "mlx-lm": expert_union.mlx_lm_path,  # the engine keeps mlx-lm's on CUDA
                 "sorted": lambda: expert_union.forced("sorted"), "stacked": lambda: expert_union.forced("stacked")}
    variants = [("tiny-wide", None, {"engine": None}), ("tiny-moe", None, moe_paths), ("tiny-moe", 4, moe_paths)]
    for profile, bits, paths in variants:
        runtime = runtime_for(profile)
        if bits:
            nn.quantize(runtime.target.model, group_size=64, bits=bits,
                        class_predicate=lambda _, m: hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding))
        runner = TargetRunner(runtime.view)
        label = profile + (f" {bits}-bit" if bits else f" {gpu_dtype()}")
        for b in rows_list:
            text = text_rows(runtime.tokenizer, b, 16 + max(windows))
            for w in windows:
                for path, context in paths.items():
                    if context is None:
                        times = runner.time_forward(b, w, repeats + 1, text[:, :16 + w])[1:]
                    else:
                        with context():
                            times = runner.time_forward(b, w, repeats + 1, text[:, :16 + w])[1:]
                    out["tables"].setdefault(f"{label} {path}", {})[f"{b}x{w}"] = statistics.median(times)
            print(label, b, "done", flush=True)
            save(args, "surface", out)
        del runtime, runner
        release()
    return out


# ---- prefill --------------------------------------------------------------------------------
def phase_prefill(args) -> dict:
    import contextlib

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.cost_surface import text_rows
    from macspec.models import window_attention

    runtime = runtime_for("tiny-wide")
    model = runtime.target.model
    lengths = [97, 203, 301] if args.smoke else [97, 131, 173, 211, 257, 301, 349, 397, 449, 503]
    long = 600 if args.smoke else 2000
    text = text_rows(runtime.tokenizer, 1, long)[0]

    def prefill(n: int) -> float:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for start in range(0, n, 512):
            logits = model(text[None, start:min(n, start + 512)], cache=cache)
            mx.eval(logits, [c.state for c in cache])
        return (time.perf_counter() - t0) * 1e3

    out = {"model": "tiny-wide", "dtype": gpu_dtype(), "lengths": lengths, "long": long, "paths": {}}
    for path, context in (("unfused", contextlib.nullcontext), ("mlx kernel", window_attention.mlx_only)):
        with context():
            prefill(64), prefill(65)  # kernels compiled once per dtype and op, not per shape
            row = {}
            for label in ("first", "again"):
                times = [prefill(n) for n in lengths]
                row[label] = {"mean_ms": round(statistics.mean(times), 2), "max_ms": round(max(times), 2)}
                row[f"long {label}_ms"] = round(prefill(long), 2)
        out["paths"][path] = row
        print(path, row, flush=True)
        save(args, "prefill", out)
    return out


# ---- overhead -------------------------------------------------------------------------------
def phase_overhead(args) -> dict:
    from benchmarks.common import bench_prompts, generate_in_batches
    from macspec.engine.launch import calibrated_engine

    runtime = runtime_for("tiny")
    out = {"queued": queued_forwards(runtime.target.model, 16 if args.smoke else 64)}
    print("forward loop, synced vs queued:", out["queued"], flush=True)
    save(args, "overhead", out)
    engine = calibrated_engine(runtime, max_batch=16)
    prompts = bench_prompts(runtime.tokenizer, 16, length=48)
    tokens = 24 if args.smoke else 64
    kinds = {"k=0": (0, False), "k=1": (1, False), "adaptive": (None, True)}
    configs = [("plain", "none", 0, False)]
    for method in args.overhead_methods.split(","):
        configs += [(f"{method} {kind}", method, *kinds[kind]) for kind in args.overhead_ks.split(",")]
    configs.append(("plain again", "none", 0, False))

    def run(batch: int, method, k, adaptive) -> float:
        """tok/s over 16 prompts, `batch` at a time, every answer `tokens` long."""
        t0 = time.perf_counter()
        made = generate_in_batches(engine, prompts, batch, tokens, method, k, adaptive)
        return made / (time.perf_counter() - t0)

    out.update({"tokens": tokens, "rows": {}, "parts": {}, "profiles": {}})
    for batch in (1, 16):
        for label, method, k, adaptive in configs:
            run(batch, method, k, adaptive)  # the first pass learns costs and builds kernels
            before = (dict(engine.stats.time_s), engine.stats.totals["steps"])
            drafted = speculated(engine, method)
            out["rows"].setdefault(label, {})[f"B={batch}"] = round(run(batch, method, k, adaptive), 1)
            out["parts"].setdefault(label, {})[f"B={batch}"] = step_parts(engine.stats, *before, len(prompts))
            out["parts"][label][f"B={batch}"].update(
                {key: value - drafted[key] for key, value in speculated(engine, method).items()})
            if adaptive:  # what the policy measured and decided
                out.setdefault("policy", {})[f"{label}, B={batch}"] = engine.speculator.policy.as_dict()
            print(batch, label, out["rows"][label][f"B={batch}"], out["parts"][label][f"B={batch}"], flush=True)
            save(args, "overhead", out)
    by_label = {c[0]: c[1:] for c in configs}
    for item in filter(None, args.overhead_profiles.split(",")):
        label, batch = item.rsplit("@", 1)
        if label not in by_label:
            continue
        method, k, adaptive, batch = *by_label[label], int(batch)
        out["profiles"][f"{label}, B={batch}"] = profiled(lambda: run(batch, method, k, adaptive))
        save(args, "overhead", out)
    return out


def speculated(engine, method: str) -> dict:
    """The method's drafted and accepted tokens so far (the engine's totals)."""
    totals = engine.speculator.totals.get(method)
    return {"drafted": getattr(totals, "num_drafted", 0), "accepted": getattr(totals, "num_accepted", 0)}


def step_parts(stats, time_s: dict, steps: int, requests: int) -> dict:
    """ms per decode step of each part (plan, build, sync, commit, close) since `time_s`, and
    prefill ms per request (a proposer's start runs in it)."""
    n = max(1, stats.totals["steps"] - steps)
    parts = {p: round((v - time_s[p]) * 1e3 / n, 3) for p, v in stats.time_s.items() if p != "prefill"}
    parts["prefill per request"] = round((stats.time_s["prefill"] - time_s["prefill"]) * 1e3 / requests, 2)
    parts["steps"] = n
    return parts


def profiled(fn) -> str:
    """cProfile of fn(): the top functions by own time, then by cumulative time."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()[-16000:]


def queued_forwards(model, steps: int) -> dict:
    """ms per token of a greedy forward loop that reads each token before building the next step
    (the engine's shape) against one that queues step n + 1 before reading step n (mlx-lm's
    mx.async_eval), at B = 1 and 16: what overlapping the host with the GPU would be worth."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def step(y, cache):
        return mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)

    out = {}
    for batch in (1, 16):
        for mode in ("synced", "queued"):
            cache, y = make_prompt_cache(model), mx.zeros((batch,), dtype=mx.int32)
            mx.eval(step(y, cache))  # kernels built for this shape before the clock starts
            t0 = time.perf_counter()
            if mode == "synced":
                for _ in range(steps):
                    y = step(y, cache)
                    y.tolist()
            else:
                y = step(y, cache)
                mx.async_eval(y)
                for _ in range(steps):
                    after = step(y, cache)
                    mx.async_eval(after)
                    y.tolist()
                    y = after
                y.tolist()
            out[f"B={batch} {mode} ms"] = round((time.perf_counter() - t0) * 1e3 / steps, 3)
    return out


# ---- serve ----------------------------------------------------------------------------------
def phase_serve(args) -> dict:
    out = {}
    levels = "1,4" if args.smoke else "1,4,16"
    runs = [("tiny-wide", "--fixed-k", "1,2,3"), ("tiny-moe", "--methods", "mtp"), ("tiny", "--methods", "dflash,eagle3,mtp")]
    chosen = [r for r in runs if r[0] in args.serve_targets.split(",")] if args.serve_targets else runs
    for target, flag, value in chosen[:1] if args.smoke else chosen:
        json_out = args.work / f"serve-{target}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "--target", target, "--no-mlx-lm",
               "--dtype", gpu_dtype(), "--concurrency", levels, "--repeats", str(args.serve_repeats), "--rounds", "1",
               "--max-tokens", "32" if args.smoke else "64", flag, value, "--json-out", str(json_out)]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=False)
        out[target] = read_json(json_out)
        save(args, "serve", out)
    return out


# ---- the report -----------------------------------------------------------------------------
def save(args, phase: str, result: dict) -> None:
    """The phase's result so far: a phase stopped at its budget keeps what it measured."""
    (args.work / f"{phase}.json").write_text(json.dumps(result, indent=2, default=str))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def render(report: dict) -> str:
    lines = [f"# macspec on {report.get('gpu', 'this machine')}", ""]
    env = report["phases"].get("env", {})
    if "backend" in env:
        lines += [f"- backend `{env['backend']}` ({env['default_device']}), MLX {env['mlx']}; nvidia-smi: "
                  f"{env.get('nvidia_smi')}", f"- MLX device_info: {env.get('device_info')}",
                  f"- copy bandwidth (read + write) {env.get('copy_bandwidth_tbps', 0):.3g} TB/s; nominal "
                  f"{env.get('nominal_tbps')} TB/s",
                  "- doctor: " + "; ".join(f"{c.get('name')}: {c.get('status')} ({c.get('detail')})"
                                            for c in env.get("doctor", {}).get("checks", [])[:6]), ""]
    loss = report["phases"].get("lossless", {})
    for dtype, rows in loss.get("by_dtype", {}).items():
        lines += [f"## Lossless, {dtype}: greedy spec == plain (k = {loss['k']}, {loss['max_tokens']} tokens)", "",
                  "| case | equal | drafted | divergences (position, plain's top-1 - top-2 logit) |", "|---|---|---|---|"]
        for name, r in rows.items():
            div = ", ".join(f"({d['position']}, {d['margin']})" for d in r["divergences"]) or "none"
            lines.append(f"| {name} | {r['equal']}/{r['of']} | {r['drafted']} | {div} |")
        lines.append("")
    dec = report["phases"].get("decode", {})
    if dec.get("rows"):
        lines += [f"## Plain decode, batch of one ({dec['tokens']} tokens; bandwidth {dec['bandwidth_tbps']:.3g} TB/s)", "",
                  "| model | params (M) | dtype | MB read/token | engine tok/s | mlx-lm tok/s | engine: fraction of "
                  "bandwidth | of copy bandwidth | mlx-lm: fraction |", "|---|---|---|---|---|---|---|---|---|"]
        for r in dec["rows"]:
            lines.append(f"| {r['model']} | {r['params_m']} | {r['dtype']} | {r['bytes_per_token_mb']} | "
                         f"{r['engine_tok_s']} | {r['mlx_lm_tok_s']} | {r['engine_bandwidth_fraction']} | "
                         f"{r['engine_fraction_of_copy']} | {r['mlx_lm_bandwidth_fraction']} |")
        lines.append("")
    surf = report["phases"].get("surface", {})
    if surf.get("tables"):
        windows = surf["windows"]
        lines += ["## Verify cost surface: forward time ÷ W = 1 at the same B (W = 1 in ms; median of "
                  f"{surf['repeats']})", "", "| target, path | B | W=1 ms | " + " | ".join(f"W={w}" for w in windows[1:]) + " |",
                  "|---|---|---|" + "---|" * (len(windows) - 1)]
        for name, cells in surf["tables"].items():
            for b in surf["rows"]:
                one = cells.get(f"{b}x1")
                if one:
                    lines.append(f"| {name} | {b} | {one * 1e3:.2f} | " + " | ".join(
                        f"{cells[f'{b}x{w}'] / one:.2f}" if f"{b}x{w}" in cells else "" for w in windows[1:]) + " |")
        lines.append("")
    pre = report["phases"].get("prefill", {})
    if pre.get("paths"):
        lines += [f"## Prefill, {pre['model']} {pre['dtype']}: ms per prompt ({len(pre['lengths'])} lengths "
                  f"{pre['lengths'][0]}-{pre['lengths'][-1]} tokens; one of {pre['long']} tokens in 512-token chunks)", "",
                  "| attention | first time: mean ms | max | again: mean ms | max | long, first | long, again |",
                  "|---|---|---|---|---|---|---|"]
        for path, r in pre["paths"].items():
            lines.append(f"| {path} | {r['first']['mean_ms']} | {r['first']['max_ms']} | {r['again']['mean_ms']} | "
                         f"{r['again']['max_ms']} | {r['long first_ms']} | {r['long again_ms']} |")
        lines.append("")
    over = report["phases"].get("overhead", {})
    if over.get("rows"):
        plain = over["rows"]["plain"]
        lines += [f"## In-process on tiny: tok/s ÷ plain ({over['tokens']} tokens, 16 prompts, B at a time)", "",
                  "| config | " + " | ".join(plain) + " |", "|---|" + "---|" * len(plain)]
        for label, row in over["rows"].items():
            lines.append(f"| {label} | " + " | ".join(f"{row[b]} ({row[b] / plain[b]:.2f}x)" for b in plain if b in row) + " |")
        lines += ["", f"Forward loop, ms per token: {over.get('queued')}", ""]
        for label, cells in over.get("parts", {}).items():
            lines.append(f"- {label}: " + "; ".join(f"{b} {parts}" for b, parts in cells.items()))
        lines.append("")
    for target, table in report["phases"].get("serve", {}).items():
        if not isinstance(table, dict) or "macspec spec off" not in table:
            continue
        base = table["macspec spec off"]
        levels = list(base)
        lines += [f"## serve, {target}: tok/s (÷ spec off)", "", "| config | " + " | ".join(f"c={c}" for c in levels) + " |",
                  "|---|" + "---|" * len(levels)]
        for name, rows in table.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{rows[c]['tok_per_s']} ({rows[c]['tok_per_s'] / max(base[c]['tok_per_s'], 1e-9):.2f}x)"
                for c in levels if c in rows) + " |")
        lines.append("")
    for name, phase in report["phases"].items():
        if "error" in phase or "skipped" in phase:
            lines.append(f"- phase {name}: {phase.get('error') or phase.get('skipped')}")
    return "\n".join(lines) + "\n"


def run_phases(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
    deadline = time.monotonic() + args.budget_s
    log = out / "log.txt"
    for phase in args.phases.split(","):
        left = deadline - time.monotonic()
        if left < NEEDS_S[phase] * (0.2 if args.smoke else 1):
            report["phases"][phase] = {"skipped": f"{left:.0f} s of the budget left"}
            continue
        left = min(left, CAP_S.get(phase, left) * (4 if args.smoke else 1))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--out", str(out),
               "--work", str(args.work), "--big-hidden", str(args.big_hidden),
               "--serve-targets", args.serve_targets, "--serve-repeats", str(args.serve_repeats),
               "--overhead-methods", args.overhead_methods, "--overhead-ks", args.overhead_ks,
               "--overhead-profiles", args.overhead_profiles] + (["--smoke"] if args.smoke else [])
        t0 = time.perf_counter()
        with log.open("a") as sink:
            sink.write(f"\n==== {phase} ====\n")
            sink.flush()
            try:
                proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=left)
                error = None if proc.returncode == 0 else f"exit {proc.returncode} (see log.txt)"
            except subprocess.TimeoutExpired:
                error = f"stopped at the budget after {left:.0f} s"
        result = read_json(args.work / f"{phase}.json")
        if error:
            result["error"] = error
        result["seconds"] = round(time.perf_counter() - t0, 1)
        report["phases"][phase] = result
        if phase == "env":
            report["gpu"] = (result.get("nvidia_smi") or "").split(",")[0] or result.get("backend")
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "report.md").write_text(render(report))
        print(f"{phase}: {error or 'ok'} in {result['seconds']} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--big-hidden", type=int, default=4096, help="the widened dense target for decode")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--serve-targets", default="", help="serve only these, e.g. tiny,tiny-moe")
    ap.add_argument("--serve-repeats", type=int, default=1)
    ap.add_argument("--overhead-methods", default="draft,mtp,eagle3,dflash", help="phase overhead's proposers")
    ap.add_argument("--overhead-ks", default="k=0,k=1,adaptive", help="phase overhead's configs per proposer")
    ap.add_argument("--overhead-profiles", default="plain@16,dflash k=0@16,draft k=0@1,mtp adaptive@16,eagle3 k=0@16",
                    help="phase overhead's configs profiled, label@B")
    ap.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in this process
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work = args.work or Path(tempfile.mkdtemp(prefix="macspec-gpu-"))
    if args.phase is None:
        run_phases(args)
        return
    import macspec  # noqa: F401  (BLAS before mlx)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = globals()[f"phase_{args.phase}"](args)
    (args.work / f"{args.phase}.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
