"""Request validation shared by the OpenAI and Anthropic routes: every problem is a 400 that
names the field, what it got and what it accepts."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from ..proposers import METHODS
from ..sampling import SamplingParams
from ..errors import RequestError
from .jobs import JobSpec

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16


MAX_JSON_DEPTH = 64
GREEDY_BELOW = 1e-5  # temperatures and top_p this small mean "the most likely token"


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not valid UTF-8") from None
    except RecursionError:
        raise RequestError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    check_json_values(body)
    return body


def check_json_values(body: dict) -> None:
    """Every string must be encodable text (a lone surrogate such as "\\ud800" is not) and the
    nesting shallow; walked with an explicit stack so no input can exhaust Python's."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"the request body is nested too deeply at {path or 'the top'} "
                               f"(at most {MAX_JSON_DEPTH} levels)", _top_field(path))
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"'{path}' contains a lone UTF-16 surrogate (not valid text)",
                                   _top_field(path)) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path or "(key)", depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _top_field(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def get_int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {_type_name(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{name}' = {value} is out of range [{lo}, {hi if hi is not None else '∞'}]", name)
    return value


def get_float(body: dict, name: str, default=None, lo: float | None = None, hi: float | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}"[:200], name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{name}' = {value} is out of range [{lo}, {hi}]", name)
    return float(value)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {_type_name(value)}", name)
    return value


def get_str(body: dict, name: str, default=None, required: bool = False):
    value = body.get(name, default)
    if value is None:
        if required:
            raise RequestError(f"'{name}' is required", name)
        return default
    if not isinstance(value, str):
        raise RequestError(f"'{name}' must be a string, got {_type_name(value)}", name)
    return value


def get_stop(body: dict, name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(f"'{name}' must be a string or a list of strings", name)
    if len(value) > MAX_STOP_STRINGS:
        raise RequestError(f"'{name}' has {len(value)} entries; at most {MAX_STOP_STRINGS}", name)
    return [s for s in value if s]


MAX_LOGIT_BIAS = 1024


def get_logit_bias(body: dict, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias in [-100, 100]}."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} "
                           "{\"token id\": bias} entries", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias key {key!r} is not a token id"[:200], "logit_bias") from None
        if token < 0 or (vocab is not None and token >= vocab):
            raise RequestError(f"logit_bias token id {token} is out of range [0, {vocab})", "logit_bias")
        bias = get_float({"logit_bias": bias}, "logit_bias", lo=-100.0, hi=100.0)
        if bias:
            out.append((token, bias))
    return tuple(sorted(out))


def sampling_params(body: dict, defaults, temperature_max: float = 2.0,
                    vocab: int | None = None) -> SamplingParams:
    """Tiny temperatures and top_p (down to 0) are the limit they tend to: greedy decoding."""
    top_k = get_int(body, "top_k", None, lo=-1)
    temperature = get_float(body, "temperature", defaults.temperature, 0.0, temperature_max)
    top_p = get_float(body, "top_p", defaults.top_p, 0.0, 1.0)
    if temperature < GREEDY_BELOW or top_p < GREEDY_BELOW:
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=defaults.top_k if top_k is None else max(top_k, 0),
        min_p=get_float(body, "min_p", defaults.min_p, 0.0, 1.0),
        repetition_penalty=get_float(body, "repetition_penalty", defaults.repetition_penalty, 0.01, 10.0),
        repetition_context_size=defaults.repetition_context_size,
        seed=get_int(body, "seed", defaults.seed, lo=0, hi=2**63 - 1),
        presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=get_logit_bias(body, vocab),
    )


def speculative_options(body: dict) -> dict:
    """The macspec extension `speculative: {method, num_draft_tokens, adaptive}`."""
    value = body.get("speculative")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError("'speculative' must be an object {method, num_draft_tokens, adaptive}",
                           "speculative")
    unknown = set(value) - {"method", "num_draft_tokens", "adaptive"}
    if unknown:
        raise RequestError(f"'speculative' has unknown keys {sorted(unknown)}", "speculative")
    method = get_str(value, "method")
    if method is not None and method not in METHODS:
        raise RequestError(f"speculative.method = {method!r}; one of {', '.join(METHODS)}", "speculative")
    return {"method": method, "num_draft": get_int(value, "num_draft_tokens", None, 0, 32),
            "adaptive": get_bool(value, "adaptive", None)}


def reject_unsupported(body: dict, fields: dict[str, Any]) -> None:
    """Fields we do not implement are refused unless they hold their neutral value."""
    for name, neutral in fields.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise RequestError(f"'{name}' = {value!r} is not supported (only {neutral!r})"[:300], name)


class ContextLengthError(RequestError):
    """A prompt (or prompt + max_tokens) past the context, in the words clients act on: OpenAI's
    code context_length_exceeded (Codex), Anthropic's "prompt is too long" (Claude Code)."""

    error_type = "context_length_exceeded"


def output_limit(prompt_tokens: int, max_tokens: int | None, profile, anthropic: bool = False) -> int:
    """The tokens a request may generate: what it asked for, or up to what the context leaves
    (server.max_output_tokens at most) when it named none, as vLLM does."""
    context = profile.kv.max_context
    if prompt_tokens >= context:  # one token at least must fit after the prompt
        raise ContextLengthError(f"prompt is too long: {prompt_tokens} tokens > {context} maximum"
                                 if anthropic else
                                 f"This model's maximum context length is {context} tokens. However, "
                                 f"your messages resulted in {prompt_tokens} tokens. Please reduce "
                                 "the length of the messages.", "messages")
    left = context - prompt_tokens
    if max_tokens is None:
        return min(profile.server.max_output_tokens, left)
    if max_tokens <= left:
        return max_tokens
    if not profile.server.clamp_max_tokens:
        raise ContextLengthError(_overflow_message(prompt_tokens, max_tokens, context, anthropic),
                                 "max_tokens")
    # As llama.cpp: agents ask for more than a small context leaves (Claude Code: 32000).
    logger.debug("max_tokens %d clamped to %d (prompt %d tokens, context %d)",
                 max_tokens, left, prompt_tokens, context)
    return left


def _overflow_message(prompt_tokens: int, max_tokens: int, context: int, anthropic: bool) -> str:
    if anthropic:
        return (f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
                f"{max_tokens} > {context}, decrease input length or `max_tokens` and try again")
    return (f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion.")


def build_job(body: dict, prompt: list[int], max_tokens: int | None, stop: list[str], profile,
              temperature_max: float = 2.0, vocab: int | None = None,
              logprobs: int | None = None, anthropic: bool = False) -> JobSpec:
    """`anthropic` picks the wording of context errors (each client parses its own)."""
    if not prompt:
        raise RequestError("the prompt is empty", "prompt")
    max_tokens = output_limit(len(prompt), max_tokens, profile, anthropic)
    params = sampling_params(body, profile.sampling, temperature_max, vocab)
    return JobSpec(prompt, params, max_tokens, stop, ignore_eos=get_bool(body, "ignore_eos", False),
                   logprobs=logprobs, **speculative_options(body))
