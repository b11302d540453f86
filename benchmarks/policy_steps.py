"""Where adaptive speculation's decode time goes, step by step, against spec off and fixed k, in
one process on one engine: a serve row that misses by a few percent is either the policy's
choices or the machine's load, and this tells them apart.

Variants (spec off, adaptive, each fixed k) alternate --repeats times, the order rotated each
time, each decoding the same prompts --batch at a time. Per variant it prints the paired tok/s
ratio to spec off (wall clock: prefill, the batch draining and the load included), then the
engine's own decode steps at the full batch by window: how many, their mean ms, the tokens a
row committed, and what those steps made per second against spec off's plain steps (the
policy's choices at that batch size, priced at its own steps' cost), and the seconds it spent
catching proposers up apart from the steps (take-ons and backlogs: base.start_rows).

    python benchmarks/policy_steps.py --profile smollm2 --method eagle3 --batch 16 --fixed-k 1
    python benchmarks/policy_steps.py --profile tiny-wide --method draft --draft random --batch 16
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_runtime(profile_name: str, method: str, draft: str):
    from benchmarks.gpu import runtime_for

    if draft != "random":
        return runtime_for(profile_name, method)
    from macspec.config import load_profile
    from macspec.engine.runtime import Runtime
    from macspec.models.loader import resolve_path
    from macspec.servebench.launch import float32_copy, random_weights_copy

    work = Path(tempfile.mkdtemp(prefix="policy-steps-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the copies live as long as the run
    path = random_weights_copy(float32_copy(resolve_path("embedded:tiny-draft"), work / "draft"), work / "random", seed=0)
    profile = load_profile(profile_name)
    profile.override("speculative.method", "draft", "policy_steps")
    profile.override("speculative.draft_model", str(path), "policy_steps")
    return Runtime.load(profile)


def prompt_ids(profile_name: str, tokenizer, count: int) -> list[list[int]]:
    from benchmarks.serve import chat_prompts, prompts

    texts = chat_prompts(tokenizer, count) if profile_name == "smollm2" else prompts(count)
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


class StepLog:
    """Every decode step the policy observes: (variant, rows, window, seconds, tokens), its seconds
    already less the catch-up the speculator timed apart (Speculator.observe_step)."""

    def __init__(self, policy_cls):
        self.variant = "warm-up"
        self.steps: list[tuple[str, int, int, float, int]] = []
        observe = policy_cls.observe_step
        log = self

        def observed(policy, rows, ks, seconds, tokens):
            log.steps.append((log.variant, len(ks), max(ks, default=0) + 1, seconds, sum(tokens)))
            return observe(policy, rows, ks, seconds, tokens)

        policy_cls.observe_step = observed


def by_window(steps, variant: str, rows: int) -> dict[int, tuple[int, float, float]]:
    """window -> (steps, mean seconds, tokens per row) of `variant`'s steps at `rows` rows."""
    cells: dict[int, list] = defaultdict(list)
    for name, r, window, seconds, tokens in steps:
        if name == variant and r == rows:
            cells[window].append((seconds, tokens / rows))
    return {w: (len(v), statistics.mean(s for s, _ in v), statistics.mean(t for _, t in v)) for w, v in sorted(cells.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smollm2")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--draft", choices=["profile", "random"], default="profile",
                    help="random: the profile's draft model with random weights (tiny-wide)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fixed-k", default="1", help="fixed draft lengths to compare (comma list)")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    import macspec  # noqa: F401  (BLAS before mlx)
    from benchmarks.common import generate_in_batches
    from macspec.engine.launch import calibrated_engine
    from macspec.speculative.policy import Policy

    log = StepLog(Policy)
    runtime = load_runtime(args.profile, args.method, args.draft)
    engine = calibrated_engine(runtime, max_batch=args.batch)
    prompts = prompt_ids(args.profile, runtime.tokenizer, args.prompts)
    variants = [("spec off", "none", 0, False), ("adaptive", args.method, None, True)]
    variants += [(f"k={k}", args.method, int(k), False) for k in args.fixed_k.split(",") if k]
    for name, method, k, adaptive in variants:  # untimed: every shape built, every prompt seen once
        generate_in_batches(engine, prompts[:args.batch], args.batch, 16, method, k, adaptive)
    log.steps.clear()
    rates: dict[str, list[float]] = defaultdict(list)
    catch_up_s: dict[str, float] = defaultdict(float)  # /v1/status's catch_up_s, per variant
    for repeat in range(args.repeats):
        shift = repeat % len(variants)  # rotated: no variant always runs next to the same one
        for name, method, k, adaptive in variants[shift:] + variants[:shift]:
            log.variant = name
            started, caught_up = time.perf_counter(), engine.speculator.catch_up_s
            made = generate_in_batches(engine, prompts, args.batch, args.tokens, method, k, adaptive)
            rates[name].append(made / (time.perf_counter() - started))
            catch_up_s[name] += engine.speculator.catch_up_s - caught_up
    plain = by_window(log.steps, "spec off", args.batch).get(1)
    print(f"{args.profile}, {args.method}{' (random draft)' if args.draft == 'random' else ''}: "
          f"{args.prompts} prompts {args.batch} at a time, {args.tokens} tokens each, {args.repeats} repeats")
    print(f"| variant | tok/s | ÷ spec off (paired) | steps at {args.batch} rows: window: n, ms, tok/row "
          f"| their tok/s ÷ spec off's | catch-up s |")
    print("|---|---|---|---|---|---|")
    for name, *_ in variants:
        ratios = [r / base for r, base in zip(rates[name], rates["spec off"])]
        error = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
        cells = by_window(log.steps, name, args.batch)
        text = "; ".join(f"W{w}: {n}, {1e3 * s:.1f}, {t:.2f}" for w, (n, s, t) in cells.items())
        by_steps = "-"
        if plain and cells:  # tokens a row per second of its steps, against spec off's plain steps
            rate = sum(n * t for n, _, t in cells.values()) / sum(n * s for n, s, _ in cells.values())
            by_steps = f"{rate * plain[1]:.3f}"
        print(f"| {name} | {statistics.mean(rates[name]):.1f} | {statistics.mean(ratios):.3f} ±{error:.3f} "
              f"| {text} | {by_steps} | {catch_up_s[name]:.2f} |")
    policy = engine.speculator.policy.as_dict()
    print(f"guards: {policy['guards']}; steps held by the pace: {policy['steps_held_by_pace']}")
    # The table's cells at the full batch beside the steps' own means: a guard reads its steps
    # through these (at the table's load), so a cell off from its steps misjudges them.
    print(f"step table at {args.batch} rows (ms by window): " + "; ".join(
        f"{chain}: {by_rows[str(args.batch)]}" for chain, by_rows in policy["step_ms"].items() if str(args.batch) in by_rows))


if __name__ == "__main__":
    main()
