"""What a head's join costs and what its drafts keep, by how much of a request's context it joins
with (speculative.head_context): a profile's target (SmolLM2 by default) with each head, in one
process, on the agents' prompts (benchmarks/agents.py) and on a long variant of its tools workload (a file read back that
is several functions long, ~750-840 tokens). Per head, workload and context: the acceptance of
fixed-k drafts, the positions the joins fed and their seconds (the engine's catch_up_s), greedy;
every run's text is checked against spec off's. The contexts alternate --repeats times.

    python benchmarks/head_context.py [--profile smollm2] [--methods mtp,eagle3,dflash] [--contexts 0,64,256]
        [--workloads tools,long,edit,json,chat] [--k 1] [--tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def requests() -> dict[str, list[dict]]:
    """The agents' workloads and `long`: the tools loop with a file of many functions."""
    from benchmarks.agents import FUNCTIONS, tool_loop, workloads

    out = workloads()
    out["long"] = [tool_loop(i, f"src/m{i}.py", "\n\n".join((FUNCTIONS * 4)[i:])) for i in range(3)]
    return out


def prompt_ids(tokenizer, bodies: list[dict]) -> list[list[int]]:
    """Each body as the server renders it (its tools in the system message where the template
    has none)."""
    from macspec.server.tool_prompt import probe_template, with_tool_prompt

    if not getattr(tokenizer, "chat_template", None):  # a base model: the messages' text in turn
        return [tokenizer.encode("\n\n".join(m.get("content") or json.dumps(m.get("tool_calls"))
                                              for m in b["messages"])) for b in bodies]
    support = probe_template(tokenizer)
    return [list(tokenizer.apply_chat_template(with_tool_prompt(b["messages"], b.get("tools"), support),
                                               add_generation_prompt=True, tokenize=True)) for b in bodies]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smollm2")
    ap.add_argument("--methods", default="mtp,eagle3,dflash")
    ap.add_argument("--contexts", default="0,64,256")
    ap.add_argument("--workloads", default="tools,long,edit,json,chat")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import macspec  # noqa: F401  (BLAS before mlx)
    from benchmarks.gpu import runtime_for
    from macspec.engine.engine import Engine
    from macspec.sampling import SamplingParams

    contexts = [int(c) for c in args.contexts.split(",")]
    bodies = requests()
    print(f"{args.profile}, fixed k = {args.k}, {args.tokens} tokens at most, greedy; each workload's "
          f"prompts batched together; {args.repeats} repeats")
    print("| head | workload | prompt tokens | head_context | acceptance | positions joined | join s | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for method in args.methods.split(","):
        runtime = runtime_for(args.profile, method)
        for workload in args.workloads.split(","):
            prompts = prompt_ids(runtime.tokenizer, bodies[workload])
            plain = [d.tokens for d in Engine(runtime, max_batch=len(prompts)).generate(
                prompts, SamplingParams(), args.tokens, method="none")]
            totals: dict[int, dict] = defaultdict(lambda: defaultdict(float))
            for repeat in range(args.repeats):
                shift = repeat % len(contexts)
                for context in contexts[shift:] + contexts[:shift]:
                    runtime.profile.speculative.head_context = context
                    engine = Engine(runtime, max_batch=len(prompts))  # a fresh group: this context
                    done = engine.generate(prompts, SamplingParams(), args.tokens, method=method,
                                           num_draft=args.k, adaptive=False)
                    status = engine.status()
                    cell = totals[context]
                    cell["accepted"] += sum(d.stats["spec"]["accepted"] for d in done)
                    cell["drafted"] += sum(d.stats["spec"]["drafted"] for d in done)
                    cell["joined"] += status["proposers"][method]["joined_positions"]
                    cell["join_s"] += status["catch_up_s"]
                    cell["differ"] += sum(d.tokens != p for d, p in zip(done, plain))
            lengths = f"{min(map(len, prompts))}-{max(map(len, prompts))}"
            for context in contexts:
                c = totals[context]
                print(f"| {method} | {workload} | {lengths} | {context or 'all'} | "
                      f"{c['accepted'] / max(1, c['drafted']):.3f} ({int(c['accepted'])}/{int(c['drafted'])}) | "
                      f"{int(c['joined'])} | {c['join_s']:.3f} | {'yes' if not c['differ'] else 'NO'} |")


if __name__ == "__main__":
    main()
