"""Long-prompt prefill on SmolLM2-135M (float32): macspec's CPU prefill path vs MLX alone.

Four parts, one after another in one run (the ratios are measured side by side):
  1. one layer's attention, 512 queries over 4,096 positions (SmolLM2's shapes: 9 query heads,
     3 KV heads, 64 dims): MLX's SDPA and its parts (Q·Kᵀ, softmax, P·V) against macspec's;
  2. the model prefilled chunk by chunk in-process (512 tokens per chunk, kv.prefill_chunk's
     default): ms and tok/s per chunk, both attentions;
  3. the whole prompt's prefill at chunk sizes 256…2048 (the chunk size for this path);
  4. TTFT through `serve` for each --lengths prompt (completions, max_tokens 1, a distinct first
     line so no prefix cache helps): macspec with `model.cpu_prefill` on and off, and
     mlx_lm.server, each with its own fresh server;
and the compute floor: the prompt's linear-layer and attention FLOPs at the sgemm rate measured
here on a 512×576×1536 product.

    python benchmarks/prefill.py [--lengths 1000,4000,8000] [--repeats 1] [--no-serve] [--no-mlx-lm]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import macspec  # noqa: E402,F401  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from macspec.models import cpu_prefill  # noqa: E402
from macspec.models.cpu_prefill import attend, gated_silu, mlx_only  # noqa: E402


def best_ms(fn, repeats: int = 3) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def one_layer() -> None:
    q = mx.random.normal((1, 9, 512, 64))
    k, v = mx.random.normal((1, 3, 4096, 64)), mx.random.normal((1, 3, 4096, 64))
    qg = (q * 0.125).reshape(1, 3, 3 * 512, 64)
    scores = qg @ k.swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1)
    mx.eval(scores, probs)
    rows = {
        "MLX SDPA (mx.fast)": best_ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")),
        "  Q·Kᵀ (batched matmul)": best_ms(lambda: qg @ k.swapaxes(-1, -2)),
        "  softmax": best_ms(lambda: mx.softmax(scores, axis=-1)),
        "  mx.exp alone": best_ms(lambda: mx.exp(scores)),
        "  P·V": best_ms(lambda: probs @ v),
        "macspec CPU attention": best_ms(lambda: attend(q, k, v, 0.125, "causal")),
    }
    print("\n## One layer's attention: 512 queries over 4,096 positions (9 query heads, 3 KV heads, 64 dims)")
    print("| path | ms |\n|---|---:|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} |")
    print(f"macspec ÷ MLX: {rows['MLX SDPA (mx.fast)'] / rows['macspec CPU attention']:.2f}x faster")
    from mlx_lm.models.activations import swiglu

    gate, up = mx.random.normal((1, 512, 1536)), mx.random.normal((1, 512, 1536))
    weight = mx.random.normal((1536, 576))
    mx.eval(gate, up, weight)
    theirs, ours = best_ms(lambda: swiglu(gate, up)), best_ms(lambda: gated_silu(gate, up))
    print(f"\nThe MLP's SiLU·up for 512 positions (1,536 wide): MLX {theirs:.1f} ms, macspec {ours:.1f} ms "
          f"({theirs / ours:.1f}x); its three matmuls: {best_ms(lambda: gate @ weight) * 3:.1f} ms")


def prompt_tokens(tokenizer, count: int, tag: int) -> list[int]:
    from macspec import corpus

    text = "\n".join(corpus.read_texts(heldout=True))
    ids = tokenizer.encode(f"# request {tag}\n" + text, add_special_tokens=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def chunked_prefill(model, ids: list[int], chunk: int) -> list[float]:
    """Seconds per chunk, as the engine prefills: hidden states, the last position's logits."""
    from mlx_lm.models.cache import make_prompt_cache

    from macspec.models.view import ModelView

    view, cache = ModelView(model), make_prompt_cache(model)
    seconds = []
    for start in range(0, len(ids), chunk):
        t0 = time.perf_counter()
        hidden = view.hidden(mx.array(ids[start:start + chunk])[None], cache)
        mx.eval(view.logits(hidden[0, -1:]), [c.state for c in cache])
        seconds.append(time.perf_counter() - t0)
    return seconds


def in_process(loaded, length: int) -> dict:
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = prompt_tokens(tokenizer, length, 0)
    chunked_prefill(model, ids[:600], 512)  # first-time shapes
    with mlx_only():
        theirs = chunked_prefill(model, ids, 512)
    ours = chunked_prefill(model, ids, 512)
    print(f"\n## Prefill of {length} tokens in-process, 512 per chunk")
    print("| chunk | MLX only ms | tok/s | CPU prefill ms | tok/s |\n|---:|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(theirs, ours)):
        n = min(512, length - 512 * i)
        print(f"| {i + 1} | {a * 1e3:.0f} | {n / a:.0f} | {b * 1e3:.0f} | {n / b:.0f} |")
    print(f"| total | {sum(theirs):.2f} s | {length / sum(theirs):.0f} | {sum(ours):.2f} s | "
          f"{length / sum(ours):.0f} |")
    sizes = {}
    for chunk in (256, 512, 1024, 2048):
        sizes[chunk] = sum(chunked_prefill(model, ids, chunk))
    print("\n| chunk size | prefill s (CPU prefill) |\n|---:|---:|")
    for chunk, s in sizes.items():
        print(f"| {chunk} | {s:.2f} |")
    return {"mlx_s": sum(theirs), "macspec_s": sum(ours), "chunk_sizes": sizes}


def floor_seconds(model, length: int) -> tuple[float, float]:
    """-> (the prompt's FLOPs at the sgemm rate measured here, GFLOPS)."""
    from mlx.utils import tree_flatten

    a, b = mx.random.normal((512, 576)), mx.random.normal((576, 1536))
    gflops = 2 * 512 * 576 * 1536 / best_ms(lambda: a @ b, 5) / 1e6
    args = model.args
    linear = sum(v.size for k, v in tree_flatten(model.parameters()) if "embed" not in k)
    heads, dims, layers = args.num_attention_heads, args.hidden_size // args.num_attention_heads, args.num_hidden_layers
    flops = 2 * linear * length + 2 * heads * dims * layers * length ** 2  # causal: QKᵀ and PV, half each
    return flops / (gflops * 1e9), gflops


def serve_ttft(target: Path, lengths: list[int], repeats: int, with_mlx_lm: bool, tokenizer) -> dict:
    from macspec.servebench.launch import LaunchedServer

    results: dict[str, dict[int, float]] = {}
    work = Path(tempfile.mkdtemp(prefix="macspec-prefill-"))
    variants = [("macspec, CPU prefill", "true"), ("macspec, MLX only", "false")]
    servers = [(name, lambda w, flag=flag: LaunchedServer.macspec(str(profile(work, target, flag, max(lengths))), w))
               for name, flag in variants]
    if with_mlx_lm:
        servers.append(("mlx_lm.server", lambda w: LaunchedServer.mlx_lm(target, w)))
    tag = 1
    for name, start in servers:
        server = start(work / name.replace(" ", "_").replace(",", ""))
        try:
            server.wait_ready("/health" if name.startswith("macspec") else "/v1/models", timeout=600)
            complete(server.url, tokenizer.decode(prompt_tokens(tokenizer, 64, 999)))  # warm
            for length in lengths:
                times = []
                for _ in range(repeats):
                    tag += 1
                    text = tokenizer.decode(prompt_tokens(tokenizer, length, tag))
                    t0 = time.perf_counter()
                    complete(server.url, text)
                    times.append(time.perf_counter() - t0)
                results.setdefault(name, {})[length] = min(times)
                print(f"{name:24s} {length:6d} tokens: TTFT {min(times):.1f} s", flush=True)
        finally:
            server.stop()
    return results


def profile(work: Path, target: Path, flag: str, longest: int) -> Path:
    path = work / f"prefill-{flag}.toml"
    path.write_text(f'name = "prefill"\n[model]\npath = "{target}"\ndtype = "float32"\nchat = false\n'
                    f'cpu_prefill = {flag}\n[speculative]\nmethod = "none"\n'
                    f'[kv]\nmax_context = {longest + 512}\n[server]\nmax_batch = 1\n')
    return path


def complete(url: str, text: str) -> None:
    body = json.dumps({"prompt": text, "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as reply:
        reply.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,4000,8000")
    ap.add_argument("--repeats", type=int, default=1, help="requests per length and server (the best is kept)")
    ap.add_argument("--no-serve", action="store_true", help="only the in-process parts")
    ap.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server rows")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    from macspec.models.loader import load_model, resolve_path

    target = resolve_path("pulled:smollm2")
    loaded = load_model(str(target), "float32")
    cpu_prefill.enable(True)
    one_layer()
    in_process(loaded, 4096 if 4000 in lengths else max(lengths))
    if not args.no_serve:
        print("\n## TTFT through serve (completions, max_tokens 1)")
        results = serve_ttft(target, lengths, args.repeats, not args.no_mlx_lm, loaded.tokenizer)
        print("\n| prompt tokens | " + " | ".join(results) + " | compute floor | CPU prefill ÷ floor |")
        print("|---:|" + "---:|" * (len(results) + 2))
        for length in lengths:
            floor, gflops = floor_seconds(loaded.model, length)
            ours = results["macspec, CPU prefill"][length]
            print(f"| {length} | " + " | ".join(f"{r[length]:.1f} s" for r in results.values())
                  + f" | {floor:.1f} s | {ours / floor:.2f}x |")
        print(f"(floor: the prompt's linear and attention FLOPs at {gflops:.0f} GFLOPS, sgemm measured here)")


if __name__ == "__main__":
    main()
