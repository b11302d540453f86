"""SmolLM2-135M-Instruct with one of its shipped heads (MTP or EAGLE-3), through the engine.

Held-out chat prompts (forge/chat_prompts.py: never trained on), the smollm2 profile's sampling
(repetition penalty 1.1), greedy and T = 0.7: acceptance per draft position and tokens per target
forward at fixed k = 1..6. Acceptance at position i is the share of steps whose drafts 1..i were
all accepted (the engine's `acceptance_by_position`), averaged over requests weighted by their
speculative steps. `--run` also times `macspec run` (batch of one, what a user sees) on three
prompts with speculation on (the head's method) and off (`--method none`); `--new-prompts`
times three prompts that are in no training set instead.

    python benchmarks/smollm2_head.py                 # ~15 min on 2 cores (T = 0.7 is 2/3)
    python benchmarks/smollm2_head.py --run           # + the `macspec run` timing (~2 min)
    python benchmarks/smollm2_head.py --method eagle3 --run --new-prompts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_PROMPTS = ["Explain what RDMA is in two sentences.", "What is a hash table?",
               "Write a Python function that reverses a string."]
# The profile's k is the MTP head's best (k = 1, fixed); the EAGLE-3 head's chain is trained to
# 3 steps, so it runs up to 3 with the adaptive controller.
RUN_SPEC_ARGS = {"eagle3": ["--num-draft", "3", "--adaptive"]}
# In no recipe's prompts (chat_prompts.build_prompts): what a new user might type first.
NEW_PROMPTS = ["Explain what a CPU cache is in two sentences.",
               "Give me three tips for writing readable code.",
               "What does a database transaction guarantee?"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="mtp", choices=["mtp", "eagle3"], help="which shipped head")
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=24, help="held-out prompts per configuration")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="engine max_batch (acceptance does not depend on it)")
    ap.add_argument("--run", action="store_true", help="also time `macspec run`, spec on vs off")
    ap.add_argument("--new-prompts", action="store_true", help="time `macspec run` on NEW_PROMPTS")
    ap.add_argument("--skip-acceptance", action="store_true", help="only the `macspec run` timing")
    ap.add_argument("--json-out", help="also write the rows as JSON here")
    return ap.parse_args(argv)


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    from macspec.forge import chat_prompts
    from macspec.forge.smollm2 import RECIPES

    _, heldout = chat_prompts.split(chat_prompts.build_prompts(RECIPES["full"].num_prompts))
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
            for p in heldout[:count]]


def summarize(done: list, k: int, temp: float, seconds: float) -> dict:
    stats = [c.stats for c in done]
    forwards = sum(s["spec"]["target_forwards"] for s in stats)
    emitted = sum(s["spec"]["tokens_per_forward"] * s["spec"]["target_forwards"] for s in stats)
    steps = [s["spec"]["speculative_steps"] for s in stats]
    by_pos = []
    for i in range(k):
        pairs = [(s["spec"]["acceptance_by_position"][i], n) for s, n in zip(stats, steps)
                 if len(s["spec"]["acceptance_by_position"]) > i]
        by_pos.append(sum(a * n for a, n in pairs) / max(sum(n for _, n in pairs), 1))
    return {"temperature": temp, "k": k, "tokens_per_forward": emitted / max(forwards, 1),
            "acceptance": sum(s["spec"]["accepted"] for s in stats) / max(sum(s["spec"]["drafted"] for s in stats), 1),
            "acceptance_by_position": by_pos, "tokens": sum(s["generated_tokens"] for s in stats),
            "seconds": seconds}


def measure(args) -> list[dict]:
    sys.path.insert(0, ROOT)
    import macspec  # noqa: F401  (BLAS first)
    from dataclasses import replace

    from macspec.config import load_profile
    from macspec.engine.engine import Engine
    from macspec.engine.runtime import Runtime
    from macspec.sampling import SamplingParams

    profile = load_profile("smollm2")
    runtime = Runtime.load(profile)
    engine = Engine(runtime, max_batch=args.batch)
    prompts = heldout_prompts(runtime.tokenizer, args.prompts)
    base = SamplingParams.from_config(profile.sampling)
    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        params = [replace(base, temperature=temp, seed=i) for i in range(len(prompts))]
        for k in [int(k) for k in args.ks.split(",")]:
            start = time.perf_counter()
            done = engine.generate(prompts, params, args.max_tokens, method=args.method, num_draft=k,
                                   adaptive=False)
            for c in done:
                if c.error is not None:
                    raise c.error
            rows.append(summarize(done, k, temp, time.perf_counter() - start))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def time_run(method: str, prompts: list[str]) -> list[dict]:
    """`macspec run` per prompt with the head's method (the profile's k) and with --method none:
    decode tok/s. Results are keyed "mtp" for the speculative run, whichever head it is."""
    out = []
    for prompt in prompts:
        row = {"prompt": prompt}
        for label, extra in (("mtp", ["--method", method, *RUN_SPEC_ARGS.get(method, [])]),
                             ("none", ["--method", "none"])):
            cmd = ["macspec", "run", prompt, "--profile", "smollm2", "--json", *extra]
            result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            row[label] = {"tok_s": result["decode_tokens_per_s"], "tokens": result["generated_tokens"],
                          "tokens_per_forward": result["tokens_per_forward"],
                          "mean_k": result["spec"]["mean_k"], "token_ids": result["token_ids"]}
        row["same_text"] = row["mtp"].pop("token_ids") == row["none"].pop("token_ids")
        out.append(row)
    return out


def print_tables(rows: list[dict], runs: list[dict] | None) -> None:
    ks = sorted({r["k"] for r in rows})
    for temp in sorted({r["temperature"] for r in rows}):
        print(f"\n## T={temp}: acceptance per draft position, tokens per target forward")
        print("| k | " + " | ".join(f"pos {i + 1}" for i in range(max(ks))) + " | overall | tokens/forward |")
        print("|---:|" + "---:|" * (max(ks) + 2))
        for r in (r for r in rows if r["temperature"] == temp):
            cells = [f"{a:.2f}" for a in r["acceptance_by_position"]] + [""] * (max(ks) - r["k"])
            print(f"| {r['k']} | " + " | ".join(cells) + f" | {r['acceptance']:.2f} | {r['tokens_per_forward']:.2f} |")
    if runs:
        print("\n## `macspec run --profile smollm2` (decode tok/s, batch of one)")
        print("| prompt | spec tok/s | none tok/s | speedup | tokens/forward | mean k | same tokens |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for r in runs:
            print(f"| {r['prompt']} | {r['mtp']['tok_s']:.1f} | {r['none']['tok_s']:.1f} | "
                  f"{r['mtp']['tok_s'] / r['none']['tok_s']:.2f}x | {r['mtp']['tokens_per_forward']:.2f} | "
                  f"{r['mtp']['mean_k']:.2f} | {r['same_text']} |")
        mtp = sum(r["mtp"]["tokens"] for r in runs) / sum(r["mtp"]["tokens"] / r["mtp"]["tok_s"] for r in runs)
        none = sum(r["none"]["tokens"] for r in runs) / sum(r["none"]["tokens"] / r["none"]["tok_s"] for r in runs)
        print(f"\noverall: {mtp:.1f} vs {none:.1f} tok/s = {mtp / none:.2f}x")


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    rows = [] if args.skip_acceptance else measure(args)
    runs = time_run(args.method, NEW_PROMPTS if args.new_prompts else RUN_PROMPTS) if args.run else None
    print_tables(rows, runs)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
