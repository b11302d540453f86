"""The proposers, one line each: config validation, the CLI, the engine, the priors file,
/v1/status, the docs and the tests all read this table.

A proposer is a module under `speculative/` (named here) that defines, each given the method's name
(one module may serve several lines: speculative/hybrid.py serves mtp+suffix and draft+suffix)
- `load(runtime, method, fallback)`: load what it needs beside the target (its model), once;
- `make_group(runtime, method, vocab_size)`: a fresh `ProposerGroup` for every row of its method;
- `kv_bytes_per_token(runtime, method)`: the KV its own cache holds per token (0 when none).
Plain importing this table loads no MLX, so a bad profile is reported before MLX starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Proposer:
    name: str  # the profile's speculative.method, --method, the API's speculative.method
    module: str  # its implementation: macspec.speculative.<module>
    help: str
    # The profile key naming the proposer's own model, when it has one (it must be set, and the
    # acceptance it earns belongs to the (target, that model) pair).
    model_key: str | None = None
    # The profile key holding its longest draft, when not speculative.num_draft_tokens (a
    # proposer whose drafts are often right for many tokens at once).
    max_draft_key: str | None = None
    # A composite's parts, the model proposer first (a hybrid drafts with one of them per step).
    parts: tuple[str, ...] = ()
    # Whether the profile must name that model (an EAGLE-3 head may come with the target), and
    # whether it is a whole model (a draft: loaded, checked and pre-fetched like the target).
    model_required: bool = True
    model_is_lm: bool = True
    # Needs nothing from the target (no draft, no head), so it fits any model (`--model`).
    fits_any_target: bool = False


PROPOSERS = (
    Proposer("draft", "draft", "a small model with the target's tokenizer", model_key="draft_model"),
    Proposer("mtp", "mtp", "the target's multi-token-prediction head (DeepSeek V3, GLM, Kimi)"),
    Proposer("eagle3", "eagle3", "an EAGLE-3 head over three of the target's layers (the format "
             "SGLang and vLLM load; SmolLM2's ships with it)", model_key="eagle3_head",
             model_required=False, model_is_lm=False),
    Proposer("dflash", "dflash", "a block drafter over the target's layers: one forward drafts a "
             "whole block (z-lab's DFlash format; the tiny target ships one)", model_key="dflash_drafter",
             model_required=False, model_is_lm=False),
    Proposer("ngram", "ngram", "prompt lookup over the context; no extra model", fits_any_target=True),
    Proposer("suffix", "suffix", "the longest match in the context and recent answers; no extra model "
             "(agents: edits, tool loops, extraction)", max_draft_key="suffix_max_tokens",
             fits_any_target=True),
    Proposer("mtp+suffix", "hybrid", "per row and step, the MTP head's or the suffix's draft, whichever "
             "should be accepted further", max_draft_key="suffix_max_tokens", parts=("mtp", "suffix")),
    Proposer("draft+suffix", "hybrid", "the same with the draft model", model_key="draft_model",
             max_draft_key="suffix_max_tokens", parts=("draft", "suffix")),
    Proposer("eagle3+suffix", "hybrid", "the same with the EAGLE-3 head", model_key="eagle3_head",
             max_draft_key="suffix_max_tokens", parts=("eagle3", "suffix"), model_required=False,
             model_is_lm=False),
)
PLAIN = "none"  # no proposer: plain decoding
PROPOSER_NAMES = tuple(p.name for p in PROPOSERS)
SINGLE_NAMES = tuple(p.name for p in PROPOSERS if not p.parts)  # the composites' building blocks
METHODS = PROPOSER_NAMES + (PLAIN,)
BY_NAME = {p.name: p for p in PROPOSERS}


def implementation(name: str) -> ModuleType:
    """The module that implements proposer `name` (imports MLX)."""
    return importlib.import_module(f"{__package__}.speculative.{BY_NAME[name].module}")


def own_model(method: str, speculative) -> str | None:
    """The model `method` loads beside the target (from a SpeculativeConfig), if any."""
    proposer = BY_NAME.get(method)
    return getattr(speculative, proposer.model_key) if proposer and proposer.model_key else None


def max_draft(method: str, speculative) -> int:
    """The longest draft `method` makes by default (from a SpeculativeConfig)."""
    proposer = BY_NAME.get(method)
    key = proposer.max_draft_key if proposer and proposer.max_draft_key else "num_draft_tokens"
    return getattr(speculative, key)


def summary() -> str:
    """The methods, for help texts (README "Which proposer" says when to use which)."""
    return ", ".join(METHODS) + f" ({PLAIN}: plain decoding)"
