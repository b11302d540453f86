"""Agent workloads on SmolLM2 through the engine: what speculation buys when the answer restates
its context. Four workloads, prompts written here (chat template, greedy, no repetition penalty:
an agent restating code must be free to repeat it):

  edit   a function is given; the answer rewrites it (rename, add a parameter, a docstring)
  tools  a tool loop replayed as an agent sends it: tool definitions, a file read back as the
         tool's result, the model's next call (its shape repeats the earlier turn's)
  json   a short document; the answer restates its fields as JSON
  chat   plain questions (the control: nothing to copy)

Per workload and method (none, ngram, suffix, mtp, mtp+suffix), the same requests at c = 1 (one at a time)
and c = 4 (batched), each run starting from fresh proposer groups (suffix decoding's recent
answers hold only that run's earlier requests): tokens per target forward, acceptance, mean draft length, tok/s, and
tok/s ÷ none measured in the same run.

    python benchmarks/agents.py [--methods none,ngram,suffix,mtp,mtp+suffix] [--concurrency 1,4] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import macspec  # noqa: E402,F401  (BLAS first)

FUNCTIONS = [
    '''def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        raise ValueError("mean of an empty list")
    return total / count
''',
    '''def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None
''',
    '''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
''',
]
EDITS = ["Rename the function to `{new}` and return the same result. Reply with the whole function.",
         "Add a docstring to this function. Reply with the whole function.",
         "Add type hints to this function. Reply with the whole function."]
DOCUMENTS = [
    "Order 4471 was placed by Maria Lopez on 2026-03-14 for 3 units of the blue kettle at 24.50 "
    "each, shipped to 12 Harbour Street, Leith, with express delivery.",
    "The meeting of the garden committee is on Tuesday 9 June at 18:30 in the library annex; "
    "Tom Reyes chairs it and the budget item is 450 euros for new tools.",
    "Flight BA 117 from London Heathrow to New York JFK departs at 08:25 from terminal 5, gate "
    "B42, and arrives at 11:10 local time; the aircraft is a Boeing 777.",
]
QUESTIONS = ["What is a hash table?", "Why is the sky blue?", "Give three tips for writing clear emails."]
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                          "parameters": {"type": "object",
                                                         "properties": {"path": {"type": "string"}},
                                                         "required": ["path"]}}}


def chat(tokenizer, messages, tools=None) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    edit = [chat(tokenizer, [{"role": "user", "content": f"```python\n{code}```\n\n"
                              + EDITS[i % 3].format(new=f"compute_{i}")}])
            for i, code in enumerate(FUNCTIONS)]
    tools = []
    for i, code in enumerate(FUNCTIONS):
        path = f"src/util_{i}.py"
        call = json.dumps({"name": "read_file", "arguments": {"path": path}})
        tools.append(chat(tokenizer, [
            {"role": "user", "content": f"Fix the bug in {path} and show the fixed file."},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": code},
            {"role": "user", "content": "Now show the whole file again with the fix."}], [TOOL]))
    extract = [chat(tokenizer, [{"role": "user", "content": f"{doc}\n\nRestate every fact above as one JSON "
                                 "object with descriptive keys."}]) for doc in DOCUMENTS]
    plain = [chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return {"edit": edit, "tools": tools, "json": extract, "chat": plain}


def run(engine, prompts, method, concurrency, max_tokens):
    from macspec.sampling import SamplingParams

    engine.speculator.reset()  # fresh proposer groups: no earlier run's answers to draft from
    done, t0 = [], time.perf_counter()
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start:start + concurrency]
        # MTP at its measured best for this model (fixed k = 1, the smollm2 profile's); n-gram up
        # to 4; suffix and the hybrid up to suffix_max_tokens (their model part up to k = 1).
        options = {"mtp": {"num_draft": 1, "adaptive": False}, "ngram": {"num_draft": 4}}.get(method, {})
        done += engine.generate(batch, SamplingParams(), max_tokens, method=method, **options)
    seconds = time.perf_counter() - t0
    for c in done:
        if c.error is not None:
            raise c.error
    stats = [c.stats["spec"] for c in done]
    tokens = sum(len(c.tokens) for c in done)
    forwards = sum(s["target_forwards"] for s in stats)
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    steps = sum(s["speculative_steps"] for s in stats)
    return {"tok_s": tokens / seconds, "tokens": tokens, "tokens_per_forward": tokens / max(forwards, 1),
            "acceptance": accepted / max(drafted, 1), "mean_draft": drafted / max(steps, 1),
            "outputs": [c.tokens for c in done]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ngram,suffix,mtp,mtp+suffix")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--workloads", default="edit,tools,json,chat")
    args = ap.parse_args(argv)
    from macspec.engine.launch import calibrated_engine
    from macspec.blas import blas_info
    from macspec.config import load_profile
    from macspec.engine.runtime import Runtime

    profile = load_profile("smollm2")
    profile.sampling.repetition_penalty = 1.0
    profile.speculative.adaptive = True
    runtime = Runtime.load(profile)
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = calibrated_engine(runtime, max_batch=max(levels))
    prompts = workloads(runtime.tokenizer)
    methods = args.methods.split(",")
    print(f"BLAS {blas_info().name}; SmolLM2 float32 through the engine, greedy, {args.max_tokens} tokens, "
          f"adaptive k (suffix and mtp+suffix up to {profile.speculative.suffix_max_tokens}, ngram up to 4; "
          "mtp fixed k = 1, its measured best)")
    print("| workload | c | method | tok/s | ÷ none | tokens/forward | acceptance | mean draft | same text |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for name in args.workloads.split(","):
        for c in levels:
            rows = {m: run(engine, prompts[name], m, c, args.max_tokens) for m in methods}
            base = rows.get("none")
            for m, r in rows.items():
                ratio = f"{r['tok_s'] / base['tok_s']:.2f}" if base else "-"
                same = "yes" if base and r["outputs"] == base["outputs"] else ("-" if not base else "no")
                print(f"| {name} | {c} | {m} | {r['tok_s']:.1f} | {ratio} | {r['tokens_per_forward']:.2f} | "
                      f"{r['acceptance']:.2f} | {r['mean_draft']:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
