"""An MTP head quantized vs dequantized: acceptance and the head's bytes.

For each built target (glm5-mini's bf16 MTP layer, tiny-moe's float32 one) it writes a copy whose
MTP layer is quantized as `mlx_lm.convert -q` quantizes (4-bit affine, group 64; the target's
files linked, not copied), then runs `macspec run --json` greedy at a fixed k on a few prompts
with the head as shipped, the quantized head run quantized (the default) and the quantized head
unpacked at load (speculative.mtp_dequantize = true).

    python benchmarks/mtp_quantized.py --out /tmp/mtpq
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from macspec.config import BUILTIN_PROFILE_DIR
from macspec.models.checkpoint import load_dir, load_mtp_head
from macspec.models.loader import resolve_path
from macspec.monitor.memory import mtp_size

TARGETS = {"glm5-mini": "glm5-mtp-mini", "tiny-moe": "tiny-moe"}  # built target -> its profile
PROMPTS = ["def parse_args(argv):\n", "Explain how a hash map works.",
           "class LRUCache:\n    def __init__(self, capacity):\n", "Write a haiku about rain."]
GROUP_SIZE, BITS = 64, 4


def quantized_copy(name: str, out: Path) -> Path:
    """`out/<name>-q4head`: the target's files linked, its MTP layer quantized."""
    src, dst = resolve_path(f"built:{name}"), out / f"{name}-q4head"
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.name not in ("mtp.safetensors", "config.json") and not (dst / file.name).exists():
            (dst / file.name).symlink_to(file)
    target = load_dir(src)
    head, layer = load_mtp_head(target), target.config["num_hidden_layers"]
    stored = next(iter(mx.load(str(src / "mtp.safetensors")).values())).dtype
    # As mlx_lm.convert -q picks its layers: every Linear whose rows split into whole groups.
    nn.quantize(head, group_size=GROUP_SIZE, bits=BITS,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % GROUP_SIZE == 0)
    weights = {k: v.astype(stored) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in head.layout_weights(layer).items()}
    mx.save_safetensors(str(dst / "mtp.safetensors"), weights)
    config = json.loads((src / "config.json").read_text())
    # The target keeps its own state: mlx-lm quantizes only modules stored with scales.
    config.setdefault("quantization", {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_profile(base: str, model: Path, dequantize: bool, out: Path, label: str) -> Path:
    text = (BUILTIN_PROFILE_DIR / f"{base}.toml").read_text()
    text = text.replace(f'name = "{base}"', f'name = "{label}"')
    text = text.replace("[speculative]\n", f"[speculative]\nmtp_dequantize = {str(dequantize).lower()}\n")
    text = text.replace("[model]\n", f"[model]\npath = {json.dumps(str(model))}\n", 1)
    lines = [ln for ln in text.splitlines() if not ln.startswith("path = \"built:")]
    path = out / f"{label}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def head_bytes(model: Path, dequantize: bool) -> int:
    head = load_mtp_head(load_dir(model), dequantize=dequantize)
    return sum(v.nbytes for _, v in tree_flatten(head.parameters()))


def run(profile: Path, prompt: str, args, home: Path) -> dict:
    cmd = ["macspec", "run", "--profile", str(profile), "--json", "--temperature", "0",
           "--max-tokens", str(args.max_tokens), "--fixed-k", "--num-draft", str(args.k), prompt]
    env = {**os.environ, "MACSPEC_HOME": str(home)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def measure(name: str, args) -> list[dict]:
    base, out = TARGETS[name], Path(args.out)
    copy = quantized_copy(name, out)
    variants = [("as shipped", resolve_path(f"built:{name}"), False),
                (f"{BITS}-bit, run quantized", copy, False),
                (f"{BITS}-bit, dequantized", copy, True)]
    rows = []
    for label, model, dequantize in variants:
        profile = write_profile(base, model, dequantize, out, f"{name}-{len(rows)}")
        runs = [run(profile, p, args, out / "home") for p in PROMPTS[: args.prompts]]
        drafted = sum(r["spec"]["drafted"] for r in runs)
        first = [r["spec"]["acceptance_by_position"][0] for r in runs]
        rows.append({"target": name, "head": label, "head_MB": head_bytes(model, dequantize) / 2**20,
                     "first_draft": sum(first) / len(first),
                     "acceptance": sum(r["spec"]["accepted"] for r in runs) / max(drafted, 1),
                     "tokens_per_forward": sum(r["generated_tokens"] for r in runs)
                     / sum(r["spec"]["target_forwards"] for r in runs),
                     "tok_s": sum(r["decode_tokens_per_s"] for r in runs) / len(runs),
                     "token_ids": [r["token_ids"] for r in runs]})
    size = mtp_size(copy)
    rows[-1]["stored_unpacked_MB"] = (size.stored / 2**20, size.unpacked / 2**20)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| target | MTP head | head MiB (loaded) | first-draft acc. | acceptance | tokens/forward | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['head']} | {r['head_MB']:.2f} | {r['first_draft']:.3f} | "
              f"{r['acceptance']:.3f} | {r['tokens_per_forward']:.2f} | {r['tok_s']:.1f} |")
    for r in rows:
        if "stored_unpacked_MB" in r:
            print(f"{r['target']}: quantized MTP layer {r['stored_unpacked_MB'][0]:.2f} MiB stored, "
                  f"{r['stored_unpacked_MB'][1]:.2f} MiB unpacked to 16-bit (doctor's estimate)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/mtpq")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [row for name in args.targets for row in measure(name, args)]
    print_table(rows)
    json.dump(rows, sys.stdout if args.out == "-" else open(Path(args.out) / "rows.json", "w"))


if __name__ == "__main__":
    main()
