"""`macspec run`: one prompt, streamed through the speculative engine, then its stats."""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass

import click

from .blas import BlasInfo, blas_info
from .config import Profile
from .engine.launch import build_engine
from .sampling import SamplingParams
from .models.detokenizer import IncrementalDecoder
from . import progress
from .progress import phase

# CLI flag -> profile key it overrides (CLI flag > profile > default).
FLAG_KEYS = {
    "max_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "seed": "sampling.seed",
    "method": "speculative.method",
    "num_draft": "speculative.num_draft_tokens",
    "adaptive": "speculative.adaptive",
    "chat": "model.chat",
}


@dataclass
class RunOptions:
    as_json: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    method: str | None = None
    num_draft: int | None = None
    adaptive: bool | None = None
    chat: bool | None = None


def apply_flags(profile: Profile, opts: RunOptions) -> None:
    for flag, key in FLAG_KEYS.items():
        value = getattr(opts, flag)
        if value is not None:
            profile.override(key, value, f"--{flag.replace('_', '-')}")


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt, add_special_tokens=False)) or list(tokenizer.encode(prompt))


def stats_line(stats: dict, blas: BlasInfo) -> str:
    head = (f"prompt {stats['prompt_tokens']} tok | TTFT {stats['ttft_s'] * 1e3:.1f} ms | "
            f"decode {stats['decode_tokens_per_s']:.1f} tok/s ({stats['generated_tokens']} tok) | ")
    blas_text = f"BLAS {blas.name}" + (f" {blas.core}" if blas.core else "")
    if stats["method"] == "none":  # plain decoding: no acceptance to speak of
        return head + f"method none | {blas_text}"
    return head + (f"method {stats['method']} k<={stats['k_max']} (mean {stats['spec']['mean_k']:.2f}) | "
                   f"acceptance {stats['acceptance_rate']:.2f} | "
                   f"{stats['tokens_per_forward']:.2f} tok/forward | "
                   + (f"speculation {stats['speculation']} | " if stats.get("speculation") else "")
                   + blas_text)


def run_once(profile: Profile, prompt: str, opts: RunOptions) -> dict:
    """One prompt through the engine that `serve` uses (batch of one; under tensor
    parallelism this process is rank 0 and drives its peers)."""
    apply_flags(profile, opts)
    params = SamplingParams.from_config(profile.sampling)
    engine = build_engine(profile, max_batch=1)
    try:
        engine.remember_priors()
        if profile.speculative.adaptive and profile.speculative.method != "none":
            engine.calibrate()

        def steps(tokens, holder):
            return engine.stream(tokens, params, profile.sampling.max_tokens, holder)

        def explain(method: str) -> str:  # the policy's word, and whether a saved prior shaped it
            prior = engine.speculator.remembered.get(method)
            return engine.speculator.policy.explain(method) + (
                "" if prior is None else f" (k started from earlier runs' acceptance {prior:.2f})")

        return _stream(profile, engine.runtime, prompt, opts, steps, explain)
    finally:
        engine.close()


def startup_seconds() -> dict:
    """Each start-up phase's seconds, and the process's whole wall time so far (from exec:
    the interpreter and imports included)."""
    return {"phases": [{"phase": what, "seconds": round(s, 3)} for what, s in progress.timings],
            "process_s": round(progress.process_seconds(), 3)}


def _stream(profile: Profile, runtime, prompt: str, opts: RunOptions, steps, explain=None) -> dict:
    tokens = encode_prompt(runtime.tokenizer, prompt, profile.model.chat)
    text = IncrementalDecoder(runtime.tokenizer)
    stats: dict = {}
    with phase(f"prefilling {len(tokens)} prompt tokens"):
        pending = iter(steps(tokens, stats))
        first = next(pending, [])
    progress.clear()
    for step in itertools.chain([first], pending):
        segment = text.add(step)
        if segment and not opts.as_json:
            sys.stdout.write(segment)
            sys.stdout.flush()
    tail = text.flush()
    if explain is not None and "method" in stats:  # why it drafted (or did not)
        stats["speculation"] = "plain decoding" if stats["method"] == "none" else explain(stats["method"])
    result = {"profile": profile.name, "text": text.text, "token_ids": text.ids,
              "blas": blas_info().as_dict(), **stats, "startup": startup_seconds()}
    if runtime.method != profile.speculative.method:  # the draft was refused, fallback taken
        result["requested_method"] = profile.speculative.method
    if opts.as_json:
        click.echo(json.dumps(result))
    else:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        click.echo(stats_line(stats, blas_info()), err=True)
    return result
