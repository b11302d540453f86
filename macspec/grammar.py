"""Structured output: a request's grammar (JSON Schema, regex, Lark) as token masks.

llguidance compiles the grammar against the target's tokenizer; a `Constraint` follows one
request's output and says which ids may come next. With speculation the engine asks for the
masks after each leading draft that the grammar accepts, so every window position is verified
against the grammar state after the tokens before it, and the matcher is rolled back to the
committed tokens before the verdict is known.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

import mlx.core as mx

from .errors import MacspecError, RequestError

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "lark", "choice")
# Keywords whose value is a subschema, a list of them, or a map of names to them.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(MacspecError):
    """The output broke its grammar (a bug: the mask should have prevented it)."""


def strict_schema(schema):
    """A copy in which every object schema that names `properties` but says nothing of extra
    keys admits only those (vLLM's xgrammar reads schemas so; llguidance has no switch for it).
    `allOf` branches, and a schema with an `allOf`, are left open: closing each part would
    make their intersection refuse the other parts' keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not any(
            key in out for key in ("additionalProperties", "unevaluatedProperties", "allOf")):
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_strict_inside(s) for s in out["allOf"]]
    return out


def _strict_inside(schema):
    # An allOf branch stays as open as written; what it nests is closed as usual.
    closed = strict_schema(schema)
    if isinstance(schema, dict) and "additionalProperties" not in schema:
        closed.pop("additionalProperties", None)
    return closed


class GrammarCompiler:
    """One per tokenizer: the llguidance view of the vocabulary is built once. `strict`: object
    schemas that do not allow extra keys refuse them (see strict_schema)."""

    def __init__(self, tokenizer, logits_width: int, strict: bool = True):
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", None) or
                     ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))
        if not eos:  # the grammar must be able to say where the output ends
            raise RequestError("structured output needs a tokenizer with an end-of-sequence token; "
                               "this model's has none")
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        except ValueError as err:
            raise RequestError(f"structured output cannot use this model's tokenizer: {err}") from None
        self.width = logits_width  # the target's logits; ids past the tokenizer's never pass
        self.strict = strict
        self.mask_seconds = 0.0  # total time spent computing masks (the bench reports µs/token)
        self.masks_computed = 0

    def compile(self, kind: str, value) -> str:
        """-> an llguidance grammar, checked; a bad one is the request's 400."""
        from llguidance import LLMatcher

        try:
            if kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(
                    strict_schema(value) if self.strict else value,
                    defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(value)
            elif kind == "lark":
                grammar = LLMatcher.grammar_from_lark(value)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(str(c)) for c in value))
            else:
                raise RequestError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
        except ValueError as err:
            raise RequestError(f"the {kind.replace('_', ' ')} is not valid: {err}"[:500]) from None
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise RequestError(f"the {kind.replace('_', ' ')} is not valid: {messages[0]}"[:500])
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"the grammar could not be used: {matcher.get_error()}"[:500])
        return Constraint(matcher, self)


class Constraint:
    """One request's grammar state; advanced only by committed tokens."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self.matcher = matcher
        self.compiler = compiler
        self._words = (compiler.tokenizer.vocab_size + 31) // 32

    @property
    def done(self) -> bool:
        """Nothing (not even EOS) may follow: the output is complete."""
        return self.matcher.is_stopped()

    def masks(self, drafts: list[int]) -> tuple[mx.array, int]:
        """Allowed ids at the next position and after each leading draft the grammar accepts:
        ([valid + 1, V] bool, valid). A draft after the first invalid one can never be accepted,
        so its position needs no mask."""
        from llguidance.numpy import fill_next_token_bitmask

        t0 = time.perf_counter()
        valid = self.matcher.validate_tokens(drafts) if drafts else 0
        bitmask = np.zeros((valid + 1, self._words), dtype=np.int32)
        consumed = 0
        for j in range(valid + 1):
            fill_next_token_bitmask(self.matcher, bitmask, j)
            # Once complete, only EOS may come and nothing after it is emitted; an EOS consumed
            # there would not count for rollback(), so nothing is consumed past the end.
            if j == valid or self.matcher.is_stopped():
                bitmask = bitmask[:j + 1]
                break
            if not self.matcher.consume_token(drafts[j]):
                raise GrammarError(f"the grammar refused draft token {drafts[j]} it had validated")
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
        # Past the end (after an EOS draft) nothing is allowed; that position is never emitted,
        # and an all-masked row would turn its distribution into NaN.
        allowed[~allowed.any(axis=1)] = True
        width = self.compiler.width
        if allowed.shape[1] < width:
            allowed = np.pad(allowed, [(0, 0), (0, width - allowed.shape[1])])
        self.compiler.mask_seconds += time.perf_counter() - t0
        self.compiler.masks_computed += len(allowed)
        return mx.array(allowed[:, :width]), valid

    def commit(self, tokens: list[int]) -> int:
        """The step's committed tokens -> how many belong to the output: none may follow once
        the grammar is complete (a regex matched in full, or EOS)."""
        for used, token in enumerate(tokens):
            if self.done:
                return used
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the output left its grammar at token {token}: "
                                   f"{self.matcher.get_error()}"[:300])
        return len(tokens)
