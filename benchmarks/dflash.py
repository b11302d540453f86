"""DFlash beside the other model proposers: acceptance by position, tokens per target forward
and decode tok/s at fixed k, ÷ plain decoding, through the engine `serve` runs (batch of one,
greedy). Targets: the embedded tiny one (every proposer trained on its corpus; held-out stdlib
prompts) or SmolLM2-135M-Instruct (its shipped MTP head, EAGLE-3 head and DFlash drafter, all
trained on its own answers; the held-out chat prompts, with the profile's repetition penalty).
Rounds alternate the configurations (this machine's load drifts); --repeats rounds, mean reported.

    python benchmarks/dflash.py [--target tiny|smollm2] [--methods draft,mtp,eagle3,dflash]
                                [--ks '1,3,7;dflash:3,7,15'] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import macspec  # noqa: E402,F401  (BLAS before mlx)
from benchmarks.common import bench_prompts  # noqa: E402
from macspec.config import load_profile  # noqa: E402
from macspec.engine.launch import calibrated_engine  # noqa: E402
from macspec.engine.runtime import Runtime  # noqa: E402
from macspec.sampling import SamplingParams  # noqa: E402


def one_round(engine, prompts, method: str, k: int, max_tokens: int, params: SamplingParams) -> dict:
    tokens = forwards = drafted = 0
    seconds = 0.0
    hits: list[float] = []
    for prompt in prompts:
        [done] = engine.generate([prompt], params, max_tokens, num_draft=k or None,
                                 adaptive=False, method=method)
        if done.error is not None:
            raise done.error
        s = done.stats
        tokens += s["generated_tokens"] - 1
        seconds += s["decode_s"]
        forwards += s["spec"]["target_forwards"]
        drafted += s["spec"]["drafted"]
        by_position = s["spec"].get("acceptance_by_position") or []
        hits = [a + b for a, b in zip(hits, by_position)] + by_position[len(hits):] if hits else list(by_position)
    return {"tok_s": tokens / seconds, "tokens_per_forward": tokens / max(forwards, 1),
            "step_ms": 1e3 * seconds / max(forwards, 1), "by_position": [h / len(prompts) for h in hits]}


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The chat prompts every SmolLM2 head held out, in the model's template."""
    from macspec.forge import chat_prompts as source
    from macspec.forge.smollm2 import RECIPES

    _, heldout = source.split(source.build_prompts(RECIPES["full"].num_prompts))
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
            for text in heldout[:count]]


def ks_for(spec: str, method: str) -> list[int]:
    """--ks: "1,3,7" for every method, or with "METHOD:K,K" entries (';'-separated) for one."""
    default, own = [], {}
    for part in spec.split(";"):
        name, _, ks = part.rpartition(":")
        (own.setdefault(name, []) if name else default).extend(int(k) for k in ks.split(","))
    return own.get(method, default)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny", choices=("tiny", "smollm2"))
    ap.add_argument("--methods", default=None, help="default: draft,mtp,eagle3,dflash (tiny), "
                    "mtp,eagle3,dflash (smollm2)")
    ap.add_argument("--ks", default="1,3,7", help="fixed k for every method; METHOD:K,K entries "
                    "separated by ';' set one method's, e.g. '1,3;dflash:3,7,15'")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dflash-drafter", default=None, help="a drafter dir to measure instead of the "
                    "one shipped with the target (e.g. a `macspec forge smollm2-dflash --out DIR`)")
    args = ap.parse_args()
    profile = load_profile(args.target)
    profile.override("speculative.method", "none", "bench")
    if args.dflash_drafter:
        profile.override("speculative.dflash_drafter", args.dflash_drafter, "bench")
    runtime = Runtime.load(profile)
    engine = calibrated_engine(runtime, max_batch=1)
    if args.target == "smollm2":
        prompts, params = chat_prompts(runtime.tokenizer, args.prompts), SamplingParams.from_config(profile.sampling)
    else:
        prompts, params = bench_prompts(runtime.tokenizer, args.prompts), SamplingParams()
    args.methods = args.methods or ("mtp,eagle3,dflash" if args.target == "smollm2" else "draft,mtp,eagle3,dflash")
    configs = [("none", 0)] + [(m, k) for m in args.methods.split(",") for k in ks_for(args.ks, m)]
    for method, k in configs:  # untimed: loads each proposer, first shapes
        one_round(engine, prompts[:1], method, k, 8, params)
    rows: dict = {c: [] for c in configs}
    for repeat in range(args.repeats):
        for config in (configs if repeat % 2 == 0 else configs[::-1]):
            rows[config].append(one_round(engine, prompts, *config, args.max_tokens, params))
            print(f"# round {repeat}: {config} {rows[config][-1]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    plain = statistics.mean(r["tok_s"] for r in rows[("none", 0)])
    print(f"{args.target} target, batch of one, greedy, {args.prompts} held-out prompts x {args.max_tokens} tokens, "
          f"{args.repeats} alternating rounds (mean)\n")
    plain_ms = statistics.mean(r["step_ms"] for r in rows[("none", 0)])
    print("| method | k | acceptance by position | tokens per forward | step ms (÷ plain's) | tok/s | ÷ plain |")
    print("|---|---|---|---|---|---|---|")
    for (method, k), runs in rows.items():
        tok_s = statistics.mean(r["tok_s"] for r in runs)
        step_ms = statistics.mean(r["step_ms"] for r in runs)
        positions = [statistics.mean(p) for p in zip(*(r["by_position"] for r in runs))] if k else []
        print(f"| {method} | {k or '-'} | {', '.join(f'{p:.2f}' for p in positions) or '-'} | "
              f"{statistics.mean(r['tokens_per_forward'] for r in runs):.2f} | {step_ms:.1f} ({step_ms / plain_ms:.2f}) | "
              f"{tok_s:.1f} | {tok_s / plain:.2f}x |")


if __name__ == "__main__":
    main()
