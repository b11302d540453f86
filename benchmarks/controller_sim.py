"""The controller and planner on a simulated device: adaptive k against every fixed k, with no
machine noise (a real serve run carries ±15 %, larger than the differences a change to the
controller makes). One row decodes `--steps` steps; the step costs are measured figures (below)
and acceptance is drawn per draft position, either independently or in easy and hard stretches
(real text: a run of boilerplate, then a hard word), shifted per request by up to ±0.2.

    python benchmarks/controller_sim.py [--requests 200] [--steps 128]

Prints tokens per second ÷ plain decoding's for fixed k = 1..3 and adaptive (k <= 4), each the
mean over the same seeded requests, and adaptive ÷ the best fixed k.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from macspec.speculative.controller import RowController  # noqa: E402
from macspec.speculative.planner import BatchPlanner  # noqa: E402

# Step time (ms) by window, and one draft-chain step (ms). "smollm2": SmolLM2-135M with its
# EAGLE-3 head through serve on the 2-core dev machine (2026-11-25 /v1/status cost model and
# fixed-k runs); "moe": tiny-moe at one row (docs/benchmarks.md cost surface).
DEVICES = {
    "smollm2": ({1: 50.0, 2: 58.0, 3: 61.0, 4: 64.0, 5: 68.0}, 3.0),
    "moe": ({1: 24.0, 2: 34.0, 3: 43.0, 4: 52.0, 5: 63.0}, 3.0),
}
# Conditional acceptance per draft position (position i given 1..i-1 accepted).
HEADS = {
    "useless": (0.0, 0.0, 0.0, 0.0),
    "weak": (0.3, 0.3, 0.3, 0.3),
    "eagle3": (0.45, 0.42, 0.47, 0.40),  # the SmolLM2 head's held-out figures
    "good": (0.75, 0.6, 0.6, 0.6),  # tiny-moe's MTP head
}


def simulate(device: str, head: str, bursty: bool, seed: int, steps: int, k: int | None) -> float:
    """Tokens per ms of one request; k None = adaptive up to 4."""
    window_ms, chain_ms = DEVICES[device]
    rng = random.Random(seed)
    shift = rng.uniform(-0.2, 0.2) if HEADS[head][0] else 0.0
    alphas = [min(0.95, max(0.0, a + shift)) for a in HEADS[head]]
    planner = BatchPlanner()
    for _ in range(3):  # what start-up calibration measures: windows 1 and k_max + 1
        for window in (1, 5):
            planner.forward.observe(1, window, window_ms[window] / 1e3)
    planner.calibrate_proposer("sim", chain_ms / 1e3, 4, 1.3 * chain_ms / 1e3)
    row = RowController(4, True, "sim") if k is None else RowController(k, False, "sim")
    hard, spent, tokens = False, 0.0, 0
    for _ in range(steps):
        if bursty and rng.random() < 0.1:
            hard = not hard
        swing = (-0.3 if hard else 0.3) if bursty else 0.0  # a useless head stays useless
        drafts = planner.plan([row])[0]
        accepted = 0
        for i in range(drafts):
            alpha = min(1.0, max(0.0, alphas[i] + swing)) if alphas[i] else 0.0
            if rng.random() >= alpha:
                break
            accepted += 1
        seconds = window_ms[drafts + 1] + chain_ms * drafts + rng.gauss(0, 1.0)
        spent += seconds
        tokens += accepted + 1
        planner.observe_step(1, drafts + 1, (seconds - chain_ms * drafts) / 1e3, 0.0)
        row.observe(drafts, accepted, planner.pays_alone(row))
    return tokens / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    print("| device | head | acceptance | k=1 | k=2 | k=3 | adaptive | adaptive ÷ best fixed |")
    print("|---|---|---|---|---|---|---|---|")
    for device in DEVICES:
        for head in HEADS:
            for bursty in (False, True):
                def mean(k):
                    return sum(simulate(device, head, bursty, s, args.steps, k)
                               for s in range(args.requests)) / args.requests
                plain = mean(0)
                fixed = [mean(k) / plain for k in (1, 2, 3)]
                adaptive = mean(None) / plain
                print(f"| {device} | {head} | {'stretches' if bursty else 'independent'} | "
                      + " | ".join(f"{r:.3f}" for r in fixed)
                      + f" | {adaptive:.3f} | {adaptive / max(1.0, *fixed):.3f} |")


if __name__ == "__main__":
    main()
