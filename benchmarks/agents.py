"""Agent workloads on SmolLM2 through `macspec serve`: what speculation buys when the answer
restates its context. Five workloads, prompts written here, sent as an agent sends them (OpenAI
chat completions: messages, tool definitions, tool calls and results, response_format):

  edit         a function is given; the answer rewrites it (rename, a docstring, type hints)
  tools        a tool loop replayed: tool definitions, the model's earlier read_file call, the
               file as the tool's result, then "show the whole file again with the fix"
  json         a short document; the answer restates its facts as one JSON object
  json-schema  the same with response_format json_schema (a grammar constrains every token)
  chat         plain questions (the control: nothing to copy)

Each repeat of a (concurrency, temperature) starts a fresh server per method (per group of
workloads: workloads that share text do not share a server): suffix decoding's recent answers
then hold only that run's earlier requests (the same requests sent again would be drafted whole
from the last run's answers), and every method starts cold (the servers started in an order
that rotates by repeat). The methods take turns batch by batch (c = 1 sends a workload's
requests one at a time, c = 4 all at once), so a neighbour's burst on this shared machine slows
them alike. Per run: tok/s (completion tokens ÷ the seconds of the method's own batches), and
from the server's /v1/status the method's tokens per target forward, acceptance and mean draft
length (a row under 0.97 of spec off is listed after the table with the engine's decode and
prefill seconds and its steps by batch size and window, over its repeats); "same text" compares
each answer with spec off's (greedy only; a sampled answer is equal in distribution, not token
for token). Each server's profile is smollm2's with the method it serves (its proposer loaded
at start-up, as a user's) and without the repetition penalty (an agent restating code must be
free to repeat it); mtp runs as the shipped profile does (adaptive, k <= 1), ngram up to 4,
suffix and mtp+suffix up to suffix_max_tokens. `control` is a second spec-off server taking its
turns as a method does (an A/A comparison): how far its ratio to none strays is what a cell's
ratio can stray by noise alone, and it is not held to the bar; after the table each method's
per-repeat ratios are pooled over the workloads (mean ± standard error), the control's beside
them. Two servers' plain steps here differ by up to 10-15 % at three rows (2026-12-06), and
that is in every ratio between servers:
`--baseline own` divides each method by spec-off requests sent to its own server instead, taking
turns with its own (the prefix cache off, so neither arm's prompts are the other's cache hits;
a lookup's recent answers hold only its own requests').

    python benchmarks/agents.py [--methods none,control,ngram,suffix,mtp,mtp+suffix] [--concurrency 1,4]
        [--temperatures 0,0.7] [--workloads edit,tools,json,json-schema,chat] [--max-tokens 128]
        [--repeats 1]   (> 1: fresh servers per repeat; median tok/s, and ÷ none the median of
                         the per-repeat ratios ± their standard error) [--baseline server|own]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from macspec.servebench.launch import LaunchedServer  # noqa: E402
from macspec.servebench.report import spread  # noqa: E402
from macspec.servebench.steps import engine_seconds, merge, window_line, window_mix  # noqa: E402

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


FACTS_SCHEMA = {"type": "object", "additionalProperties": {"type": ["string", "number"]}}
# Per method: the request's `speculative` settings (see the module doc).
CONTROL = "control"  # a second spec-off server, run as a method is: its ratio is the benchmark's own noise
SPECULATIVE = {"none": {"method": "none"}, CONTROL: {"method": "none"},
               "ngram": {"method": "ngram", "num_draft_tokens": 4}}


def speculative(method: str) -> dict:
    """A method's requests' `speculative` settings (its profile names their method)."""
    return SPECULATIVE.get(method, {"method": method})


def workloads() -> dict[str, list[dict]]:
    """Workload -> its requests' bodies (without the sampling and speculative fields)."""
    edit = [{"messages": [{"role": "user", "content": f"```python\n{code}```\n\n"
                           + EDITS[i % 3].format(new=f"compute_{i}")}]} for i, code in enumerate(FUNCTIONS)]
    tools = [tool_loop(i, f"src/util_{i}.py", code) for i, code in enumerate(FUNCTIONS)]
    extract = [{"messages": [{"role": "user", "content": f"{doc}\n\nRestate every fact above as one JSON "
                              "object with descriptive keys."}]} for doc in DOCUMENTS]
    schema = [{**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "facts", "schema": FACTS_SCHEMA}}} for body in extract]
    plain = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS]
    return {"edit": edit, "tools": tools, "json": extract, "json-schema": schema, "chat": plain}


def tool_loop(i: int, path: str, code: str) -> dict:
    """A tool loop replayed: the model read `path` (its call i), the tool returned `code`, and
    the user asks for the whole file again with the fix."""
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}
    return {"tools": [TOOL], "messages": [
        {"role": "user", "content": f"Fix the bug in {path} and show the fixed file."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": code},
        {"role": "user", "content": "Now show the whole file again with the fix."}]}


async def post(session, url: str, body: dict) -> dict:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        reply = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {reply}")
        return reply


async def send_all(url: str, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    """The requests `concurrency` at a time -> (replies in order, wall seconds)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        replies, t0 = [], time.perf_counter()
        for start in range(0, len(bodies), concurrency):
            replies += await asyncio.gather(*(post(session, url, b) for b in bodies[start:start + concurrency]))
        return replies, time.perf_counter() - t0


def speculation(url: str, method: str) -> dict:
    """The method's running totals from /v1/status (zeros before its first row), the engine's
    prefill and decode seconds (of which `catch_up_s`: proposers joining a request's context at
    its first draft, or feeding what plain steps left them) and its steps by batch size and window."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/status", timeout=30) as resp:
        engine = json.loads(resp.read())["engine"]
    spec = engine["speculation"].get(method, {})
    forwards = spec.get("target_forwards", 0)
    prefill_s, decode_s = engine_seconds(engine)
    return {"forwards": forwards, "emitted": spec.get("tokens_per_forward", 0.0) * forwards,
            **{key: spec.get(key, 0) for key in ("drafted", "accepted", "speculative_steps")},
            "prefill_s": prefill_s, "decode_s": decode_s, "catch_up_s": engine["catch_up_s"],
            "steps_by_window": engine["steps_by_window"]}


def answer(reply: dict) -> str:
    """What the client reads: the text and any tool calls."""
    message = reply["choices"][0]["message"]
    return json.dumps([message.get("content"), message.get("tool_calls") and
                       [c["function"] for c in message["tool_calls"]]])


def profile_for(method: str, work: Path, prefix_cache: bool = True) -> Path:
    """The profile a user of `method` serves with: its proposer loaded at start-up, as `macspec
    serve --profile` does (spec off loads none). A method a request asks for first loaded its head
    inside the first timed batch, and the tapped heads' first prefills there ran ~0.3 s a run slower
    than spec off's (SmolLM2, chat at four clients): a start-up's cost, not speculation's.
    `prefix_cache` False: where two arms send the same prompts to one server, neither is the
    other's cache hit."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"agents-{method.replace('+', '-')}.toml"
    path.write_text('name = "agents"\n[model]\npath = "pulled:smollm2"\ndtype = "float32"\nchat = true\n'
                    f'[speculative]\nmethod = "{speculative(method)["method"]}"\n'
                    'num_draft_tokens = 1\n[sampling]\nrepetition_penalty = 1.0\n[server]\nmax_batch = 4\n'
                    + ("" if prefix_cache else "[kv]\nprefix_cache_mb = 0\n"))
    return path


def start(work: Path, methods: list[str], prefix_cache: bool = True) -> dict[str, LaunchedServer]:
    """A fresh server per method, started one after another (a start is CPU-heavy), each sent an
    untimed plain request on another question: first-time shapes, nothing for a proposer to keep;
    and one with a JSON schema: a server's first structured request builds its grammar machinery
    (~0.55 s here, a start-up's cost), which --baseline own charged to whichever arm sent first
    (json-schema at four clients: that arm's wall 0.55 s over its engine's seconds, the other's 0.03)."""
    servers = {}
    try:
        for m in methods:
            servers[m] = LaunchedServer.macspec(str(profile_for(m, work, prefix_cache)), work / m)
            servers[m].wait_ready(timeout=600)
            hello = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                     "speculative": {"method": "none"}}
            schema = {"type": "json_schema", "json_schema": {"name": "greeting", "schema": FACTS_SCHEMA}}
            asyncio.run(send_all(servers[m].url, [hello, {**hello, "response_format": schema}], 1))
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: dict[str, LaunchedServer]) -> None:
    for server in servers.values():
        server.stop()


OWN = ":off"  # an arm of spec-off requests on a method's own server (--baseline own)


def arms_of(methods: list[str], own: bool) -> list[tuple[str, str, dict]]:
    """(arm, its server, its requests' `speculative` settings): each method on its own server,
    and with `own` each speculating method's spec-off requests on that server too."""
    arms = [(m, m, speculative(m)) for m in methods]
    return arms + [(m + OWN, m, {"method": "none"}) for m in methods if own and m != "none"]


def measure(servers: dict[str, LaunchedServer], arms: list[tuple[str, str, dict]], group: dict[str, list[dict]],
            concurrency: int, temperature: float, max_tokens: int, turn: int) -> dict[str, dict[str, dict]]:
    """Every arm runs `group`'s workloads, `concurrency` requests at a time, the arms taking turns
    batch by batch (their order rotating): a neighbour's burst on this shared machine then slows
    every arm's batches alike, where minutes apart it moved a cell by up to 0.22. -> per arm, per
    workload: throughput (tokens ÷ the seconds of its own batches), its speculation figures and
    engine seconds over its own batches, the answers."""
    out: dict[str, dict[str, dict]] = {arm: {} for arm, _, _ in arms}
    for name, bodies in group.items():
        spent = {arm: {"seconds": 0.0, "replies": [], "figures": {}, "steps": []} for arm, _, _ in arms}
        for b, first in enumerate(range(0, len(bodies), concurrency)):
            shift = (turn + b) % len(arms)
            for arm, server, settings in (arms[shift:] + arms[:shift])[::-1 if turn % 2 else 1]:
                url, sums = servers[server].url, spent[arm]
                sent = [{**body, "max_tokens": max_tokens, "temperature": temperature, "speculative": settings,
                         **({"seed": 1000 + i} if temperature else {})}
                        for i, body in enumerate(bodies[first:first + concurrency], first)]
                before = speculation(url, settings["method"])
                got, took = asyncio.run(send_all(url, sent, concurrency))
                after = speculation(url, settings["method"])
                sums["steps"].append(window_mix(before.pop("steps_by_window"), after.pop("steps_by_window")))
                for key, value in after.items():
                    sums["figures"][key] = sums["figures"].get(key, 0) + value - before[key]
                sums["replies"] += got
                sums["seconds"] += took
        for arm, sums in spent.items():
            spec, replies = sums["figures"], sums["replies"]
            tokens = sum(r["usage"]["completion_tokens"] for r in replies)
            out[arm][name] = {"tok_s": tokens / sums["seconds"], "tokens": tokens,
                              "tokens_per_forward": spec["emitted"] / spec["forwards"] if spec["forwards"] else 1.0,
                              "acceptance": spec["accepted"] / max(spec["drafted"], 1),
                              "mean_draft": spec["drafted"] / max(spec["speculative_steps"], 1),
                              "prefill_s": spec["prefill_s"], "decode_s": spec["decode_s"],
                              "catch_up_s": spec["catch_up_s"],
                              "steps": merge(sums["steps"]), "answers": [answer(r) for r in replies]}
    return out


BAR = 0.97  # issue 38's: a row under it is reported with what the engine did


def miss_line(name: str, c: int, method: str, runs: list[dict], base: list[dict]) -> str:
    """A row under the bar: its engine seconds against spec off's over the repeats, with its
    proposer's joins and catch-ups among them (once per request that drafts, and per plain stretch:
    SmolLM2's heads join a 400-token prompt in 9-36 ms), and its steps."""
    def seconds(rs: list[dict], key: str) -> float:
        return sum(r[name][key] for r in rs)

    return (f"- {name}, c = {c}, {method}: engine decode {seconds(runs, 'decode_s'):.2f} s (spec off "
            f"{seconds(base, 'decode_s'):.2f}; joins and catch-ups {seconds(runs, 'catch_up_s'):.2f}), "
            f"prefill {seconds(runs, 'prefill_s'):.2f} s ({seconds(base, 'prefill_s'):.2f}), over "
            f"{len(runs)} run(s); steps: {window_line(merge([r[name]['steps'] for r in runs]))}")


def pooled_lines(table: list[dict]) -> list[str]:
    """Each method's per-repeat ratios over every workload at a (temperature, concurrency), their
    mean ± standard error: one cell's three repeats stray as far as the bar is from 1 (the control's
    ran 0.89-1.32 at four clients, 2026-12-07 night), the pooled mean is what a method costs there."""
    pooled: dict[tuple, list[float]] = {}
    for row in table:
        if row["method"] != "none" and row["ratios"]:
            pooled.setdefault((row["temperature"], row["concurrency"], row["method"]), []).extend(row["ratios"])
    return [f"- T {t:g}, c = {c}, {m}: {statistics.mean(xs):.3f}{spread(xs)} over {len(xs)} (workload, repeat) pairs"
            for (t, c, m), xs in pooled.items()]


def merged(runs: list[dict]) -> dict:
    """One workload's repeats -> the median throughput, the speculation figures of the run with
    that throughput (all runs' answers must agree to count as the same text)."""
    ordered = sorted(runs, key=lambda r: r["tok_s"])
    median = ordered[len(ordered) // 2]
    same = all(r["answers"] == runs[0]["answers"] for r in runs)
    return {**median, "answers": runs[0]["answers"] if same else None}


def figures(row: dict) -> dict:
    """A merged row's figures for the JSON table (its answers are compared, not kept)."""
    return {key: value for key, value in row.items() if key != "answers"}


# Workloads that share no text share a server (edit and tools copy the same functions, the two
# json workloads the same documents: one would draft from the other's answers).
SERVER_GROUPS = (("chat", "edit", "json"), ("tools", "json-schema"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ngram,suffix,mtp,mtp+suffix")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workloads", default="edit,tools,json,json-schema,chat")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per (c, T), fresh servers each; the median tok/s and per-repeat ratio are reported")
    ap.add_argument("--baseline", choices=("server", "own"), default="server",
                    help="each method's ratio against spec off's own server (server), or against spec-off "
                         "requests on the method's own server, the prefix cache off (own): two servers' "
                         "plain steps differ by up to 10-15 %% here, and own takes that out of the ratio")
    ap.add_argument("--json-out", help="also write the rows (tok/s, the ratio to spec off with each repeat's, speculation figures) as JSON")
    args = ap.parse_args(argv)
    from macspec.blas import blas_info

    work = Path(tempfile.mkdtemp(prefix="macspec-agents-"))
    requests = workloads()
    chosen = args.workloads.split(",")
    groups = [{name: requests[name] for name in group if name in chosen} for group in SERVER_GROUPS]
    methods = args.methods.split(",")
    print(f"BLAS {blas_info().name}; SmolLM2 float32 through macspec serve, {args.max_tokens} tokens", flush=True)
    own = args.baseline == "own"
    arms = arms_of(methods, own)
    divisor = "its own server's spec off" if own else "none"
    print(f"| workload | T | c | method | tok/s | ÷ {divisor} | tokens/forward | acceptance | mean draft | same text |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|")
    table, misses = [], []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for c in (int(c) for c in args.concurrency.split(",")):
            runs = {arm: [] for arm, _, _ in arms}
            for repeat in range(args.repeats):
                out = {arm: {} for arm, _, _ in arms}
                for i, group in enumerate(g for g in groups if g):
                    # Each repeat starts them in another order: the server started first read up to
                    # 7-8 % faster than a second spec-off server (tools at four clients, run after run)
                    order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
                    servers = start(work / f"{c}-{temperature}-{i}-{repeat}", order, prefix_cache=not own)
                    try:
                        for arm, rows in measure(servers, arms, group, c, temperature, args.max_tokens, repeat).items():
                            out[arm].update(rows)
                    finally:
                        stop(servers)
                for arm in out:
                    runs[arm].append(out[arm])
            rows = {arm: {name: merged([r[name] for r in runs[arm]]) for name in runs[arm][0]} for arm in runs}
            for name in (n for n in chosen if n in requests):
                base = rows.get("none", {}).get(name)
                for m in methods:
                    r = rows[m][name]
                    against = m + OWN if own and m != "none" else "none"  # the arm its ratio divides by
                    # Each repeat ran the arms side by side: the median of its ratios (a ratio
                    # of medians would pair one repeat's run with another's)
                    paired = [a[name]["tok_s"] / b[name]["tok_s"] for a, b in zip(runs[m], runs[against])] \
                        if against in runs else []
                    median = statistics.median(paired) if paired else None
                    ratio = f"{median:.3f}" if paired else "-"  # 3 decimals: a cell at the 0.97 bar reads 0.97 at 2
                    if paired and m != "none":
                        ratio += spread(paired)
                    same = "-" if not base or temperature else \
                        ("yes" if r["answers"] is not None and r["answers"] == base["answers"] else "no")
                    table.append({"workload": name, "temperature": temperature, "concurrency": c, "method": m,
                                  **figures(r), "ratio": median, "ratios": paired, "same_text": same,
                                  # its own server's spec-off arm (--baseline own): its steps and seconds
                                  **({"own_spec_off": figures(rows[against][name])} if against != "none" else {})})
                    print(f"| {name} | {temperature:g} | {c} | {m} | {r['tok_s']:.1f} | {ratio} | "
                          f"{r['tokens_per_forward']:.2f} | {r['acceptance']:.2f} | {r['mean_draft']:.2f} | {same} |",
                          flush=True)
                    if paired and m not in ("none", CONTROL) and median < BAR:
                        misses.append(miss_line(name, c, m, runs[m], runs[against]))
    if misses:  # after the table: what the engine did in each row under the bar
        print(f"\nUnder {BAR} of spec off (each window's steps: count x its cost ÷ a plain step's at the same rows, "
              "tokens a row):", *misses, sep="\n")
    pooled = pooled_lines(table)
    if pooled:  # none without a spec-off arm to divide by
        print(f"\nPooled over the workloads (every per-repeat ratio to {divisor}; the control's is what noise "
              "alone reads):", *pooled, sep="\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(table, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
