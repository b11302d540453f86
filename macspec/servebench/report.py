"""report.json (stable schema), report.md (the tables users post) and report.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SCHEMA = "macspec.bench/1"
REQUEST_COLUMNS = ["index", "status", "prompt_tokens", "completion_tokens", "ttft_s", "prefill_tok_s",
                   "decode_tok_s", "total_s", "error"]


def comparisons(runs: list[dict]) -> list[dict]:
    """Ratios per scenario against the first run (macspec with speculation on)."""
    if len(runs) < 2:
        return []
    base = runs[0]
    out = []
    for other in runs[1:]:
        for mine, theirs in zip(base["scenarios"], other["scenarios"]):
            a, b = mine["summary"], theirs["summary"]
            out.append({"scenario": mine["name"], "run": base["label"], "versus": other["label"],
                        "throughput_ratio": _ratio(a["throughput_tok_s"], b["throughput_tok_s"]),
                        "decode_ratio": _ratio(a["decode_tok_s_mean"], b["decode_tok_s_mean"]),
                        "ttft_p50_ratio": _ratio(a["ttft_p50_ms"], b["ttft_p50_ms"])})
    return out


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def spread(ratios: list[float]) -> str:
    """" ±" the standard error of per-repeat ratios, each repeat having run both configs side by
    side ("" for fewer than two): the noise between runs, beside the ratio it qualifies."""
    if len(ratios) < 2:
        return ""
    return f" ±{statistics.stdev(ratios) / len(ratios) ** 0.5:.3f}"


def build(config: dict, runs: list[dict], errors: list[str], log_excerpt: str | None) -> dict:
    totals = {"requests": 0, "ok": 0, "failed": 0, "completion_tokens": 0}
    for run in runs:
        for scenario in run["scenarios"]:
            for key in totals:
                totals[key] += scenario["summary"][key]
    return {"schema": SCHEMA, "config": config, "runs": runs, "comparisons": comparisons(runs),
            "totals": totals, "errors": errors, "server_log_excerpt": log_excerpt}


def write(report: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(markdown(report))
    chart = out / "report.png"
    if draw_chart(report, chart):
        paths.append(chart)
    return paths


def _table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v).replace("|", "/").replace("\n", " ") for v in row) + " |" for row in rows]
    return lines


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = ["# macspec bench report", "", "## Configuration", ""]
    lines += _table(["key", "value"], [[k, json.dumps(v) if isinstance(v, (dict, list)) else v]
                                       for k, v in cfg.items()])
    lines += ["", "## Summary", ""]
    rows = []
    for run in report["runs"]:
        for s in run["scenarios"]:
            m = s["summary"]
            rows.append([run["label"], s["name"], f"{m['ok']}/{m['requests']}", m["completion_tokens"],
                         m["throughput_tok_s"], m["decode_tok_s_mean"], m["prefill_tok_s_mean"],
                         m["ttft_p50_ms"], m["ttft_p95_ms"], m["wall_s"]])
    lines += _table(["run", "scenario", "ok", "completion tok", "throughput tok/s", "decode tok/s (mean)",
                     "prefill tok/s (mean)", "TTFT p50 ms", "TTFT p95 ms", "wall s"], rows)
    if report["comparisons"]:
        lines += ["", "## Ratios", ""]
        lines += _table(["scenario", "run", "versus", "throughput", "decode", "TTFT p50"],
                        [[c["scenario"], c["run"], c["versus"], c["throughput_ratio"], c["decode_ratio"],
                          c["ttft_p50_ratio"]] for c in report["comparisons"]])
    spec_rows = [[run["label"], s["name"], method, v["drafted"], v["accepted"], v["acceptance_rate"],
                  v["tokens_per_forward"], v["drafts_per_forward"]]
                 for run in report["runs"] for s in run["scenarios"]
                 for method, v in (s["speculation"] or {}).items()]
    lines += ["", "## Speculation (from the server's /v1/status)", ""]
    lines += _table(["run", "scenario", "method", "drafted", "accepted", "acceptance", "tokens/forward",
                     "drafts/forward (k)"], spec_rows) if spec_rows else ["(no /v1/status counters)"]
    for run in report["runs"]:
        lines += ["", f"## Requests: {run['label']}", ""]
        for s in run["scenarios"]:
            lines += [f"### {s['name']}", ""]
            lines += _table(REQUEST_COLUMNS, [[r.get(c) for c in REQUEST_COLUMNS] for r in s["requests"]])
            counters = s["server_counters"]
            if counters:
                syncs = (f", {counters['host_syncs_per_step']} host syncs per step"
                         if "host_syncs_per_step" in counters else "")
                lines += ["", f"Server counters: {counters['completed']} completed, "
                          f"{counters['generated_tokens']} tokens generated, {counters['steps']} engine steps{syncs}."]
            lines.append("")
    lines += ["## Errors", ""]
    failed = [f"- {run['label']} / {s['name']} #{r['index']}: {r['error']}" for run in report["runs"]
              for s in run["scenarios"] for r in s["requests"] if r["status"] != "OK"]
    lines += (failed + [f"- {e}" for e in report["errors"]]) or ["none"]
    lines += ["", "## Server log excerpt", "", "```", report["server_log_excerpt"] or
              "(not available: the server was not started by the bench)", "```", ""]
    return "\n".join(lines)


def draw_chart(report: dict, path: Path) -> bool:
    """Decode tok/s and TTFT p50 per scenario, one bar per run (spec on / off / peer)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = report["runs"]
    if not runs:
        return False
    names = [s["name"] for s in runs[0]["scenarios"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(runs)
    for metric, ax, title in (("decode_tok_s_mean", axes[0], "decode tok/s (mean per request)"),
                              ("ttft_p50_ms", axes[1], "TTFT p50 (ms)")):
        for i, run in enumerate(runs):
            values = [(s["summary"][metric] or 0) for s in run["scenarios"]]
            ax.bar([x + i * width for x in range(len(values))], values, width, label=run["label"])
        ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"macspec bench: {report['config'].get('target')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
