"""The README's chart, from measurements: speculation on vs off vs mlx_lm.server, per workload.

Runs three benchmarks here, one after another (never two at once), and keeps their numbers:
  - serve.py --target tiny-wide: the bandwidth-bound 206M stand-in with its distilled draft;
    macspec spec on / off, mlx_lm.server plain and with the same draft (--draft-model);
  - serve.py --target smollm2: SmolLM2-135M-Instruct chat prompts, its trained MTP head;
    macspec spec on / off, mlx_lm.server plain (it cannot use an MTP head);
  - agents.py: SmolLM2 restating a file in a tool loop and rewriting a function (code edit),
    suffix decoding vs plain.
Every bar is tok/s ÷ macspec with speculation off, measured side by side in the same run.
Writes docs/img/headline.json (the numbers, the commands, the machine) and docs/img/headline.png.

    python benchmarks/headline.py [--repeats 2] [--concurrency 1,4] [--agent-concurrency 1]
                                                     # ~45 min on 2 cores
    python benchmarks/headline.py --replot                             # redraw from the JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
BARS = ("speculation on", "speculation off", "mlx_lm.server", "mlx_lm.server + draft")
COLORS = {"speculation on": "#2a7ab9", "speculation off": "#9db9d3",
          "mlx_lm.server": "#d98b3a", "mlx_lm.server + draft": "#f0c48a"}
SERVE_NAMES = {"macspec spec on": "speculation on", "macspec spec off": "speculation off",
               "mlx_lm.server": "mlx_lm.server", "mlx_lm.server draft": "mlx_lm.server + draft"}
AGENT_WORKLOADS = {"tools": "agent tool loop", "edit": "agent code edit"}


def run(argv: list[str]) -> None:
    print("$", " ".join(argv), flush=True)
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True)


def measure(repeats: int, concurrency: str, agent_concurrency: str) -> dict:
    groups: list[dict] = []
    commands = []
    with tempfile.TemporaryDirectory(prefix="macspec-headline-") as tmp:
        for target, label in (("tiny-wide", "206M stand-in"), ("smollm2", "SmolLM2 chat")):
            out = Path(tmp) / f"{target}.json"
            argv = ["benchmarks/serve.py", "--target", target, "--concurrency", concurrency,
                    "--repeats", str(repeats), "--json-out", str(out)]
            run(argv)
            commands.append(" ".join(["python", *argv[:-2]]))
            table = json.loads(out.read_text())
            off = table["macspec spec off"]
            for c in concurrency.split(","):
                groups.append({"label": f"{label}\n{c} client{'s' if c != '1' else ''}",
                               "tok_s": {SERVE_NAMES[n]: rows[c]["tok_per_s"] for n, rows in table.items()
                                         if n in SERVE_NAMES},
                               "ratio": {SERVE_NAMES[n]: rows[c]["tok_per_s"] / off[c]["tok_per_s"]
                                         for n, rows in table.items() if n in SERVE_NAMES}})
        out = Path(tmp) / "agents.json"
        argv = ["benchmarks/agents.py", "--methods", "none,suffix", "--concurrency", agent_concurrency,
                "--temperatures", "0", "--workloads", ",".join(AGENT_WORKLOADS), "--repeats", str(repeats),
                "--json-out", str(out)]
        run(argv)
        commands.append(" ".join(["python", *argv[:-2]]))
        rows = json.loads(out.read_text())
        for workload, label in AGENT_WORKLOADS.items():
            for c in agent_concurrency.split(","):
                got = {r["method"]: r["tok_s"] for r in rows if r["workload"] == workload and r["concurrency"] == int(c)}
                groups.append({"label": f"{label}\n{c} client{'s' if c != '1' else ''}",
                               "tok_s": {"speculation on": got["suffix"], "speculation off": got["none"]},
                               "ratio": {"speculation on": got["suffix"] / got["none"], "speculation off": 1.0}})
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "repeats": repeats,
            "commands": commands, "groups": groups}


def machine() -> str:
    import macspec  # noqa: F401  (the BLAS macspec uses)
    from macspec.blas import blas_info
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, MLX CPU, BLAS {blas_info().name}"


def draw(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = data["groups"]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.2
    for i, bar in enumerate(BARS):
        xs = [g for g, group in enumerate(groups) if bar in group["ratio"]]
        values = [groups[g]["ratio"][bar] for g in xs]
        if not xs:
            continue
        bars = ax.bar([x + (i - 1.5) * width for x in xs], values, width, label=bar, color=COLORS[bar])
        for rect, value in zip(bars, values):
            ax.annotate(f"{value:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), [g["label"] for g in groups], fontsize=8)
    ax.set_ylabel("tok/s ÷ macspec, speculation off")
    ax.set_title(f"macspec serve, greedy: speculation on vs off vs mlx_lm.server "
                 f"({data['date']}; {data['machine']})", fontsize=9)
    ax.legend(fontsize=8, ncol=4, loc="upper right")
    ax.set_ylim(0, max(v for g in groups for v in g["ratio"].values()) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats per level (each benchmark's)")
    ap.add_argument("--concurrency", default="1,4", help="clients, serve.py's rows")
    ap.add_argument("--agent-concurrency", default="1", help="clients, agents.py's rows (a fresh "
                    "server per run makes each level minutes)")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from docs/img/headline.json")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    numbers = OUT / "headline.json"
    if args.replot:
        data = json.loads(numbers.read_text())
    else:
        data = measure(args.repeats, args.concurrency, args.agent_concurrency)
        numbers.write_text(json.dumps(data, indent=1) + "\n")
    draw(data, OUT / "headline.png")
    for group in data["groups"]:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in group["ratio"].items())
        print(f"{group['label'].replace(chr(10), ', ')}: {ratios}")
    print(f"wrote {OUT / 'headline.png'}")


if __name__ == "__main__":
    main()
