"""POST /v1/chat/completions and /v1/completions (OpenAI wire format, SSE streaming).

Tools, tool_choice, response_format (and vLLM's `structured_outputs`), logprobs, n > 1,
penalties and logit_bias all run with speculative decoding on: the engine applies them to the
target's and the proposer's distributions alike.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from ..errors import RequestError
from .choices import interleave
from .jobs import Job, JobResult
from .output import collect
from .respond import Call, Reply, Usage, respond
from .schema import get_bool, get_int, get_stop, reject_unsupported
from .state import STATE, ServerState
from .structured import plan_openai

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": None}
MAX_CHOICES = 8
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' `logprobs` (an integer there)


def message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content: only text parts "
                                   "({'type': 'text', 'text': ...}) are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict, roles=ROLES) -> list[dict]:
    """OpenAI messages -> what chat templates read (tool calls with their arguments as objects,
    as transformers' templates expect)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in roles:
            raise RequestError(f"messages[{i}].role = {role!r}; one of {', '.join(roles)}"[:300], "messages")
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        message = {"role": "system" if role == "developer" else role,
                   "content": "" if content is None and calls else message_text(content, i)}
        if calls:
            message["tool_calls"] = _template_calls(calls, i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"messages[{i}]: a tool message needs 'tool_call_id'", "messages")
            message["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _template_calls(calls, index: int) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(f"messages[{index}].tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"messages[{index}].tool_calls: each needs function.name", "messages")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                pass  # templates print a string as it is
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def completion_prompt(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    raise RequestError("'prompt' must be a string, a list with one string, or a list of token ids",
                       "prompt")


def _common(body: dict, state: ServerState, **fields) -> Call:
    reject_unsupported(body, UNSUPPORTED)
    stream = get_bool(body, "stream", False)
    max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=1)
    return Call(state.check_model(body.get("model")), body, max_tokens=max_tokens, stream=stream,
                stop=get_stop(body, "stop"), n=get_int(body, "n", 1, lo=1, hi=MAX_CHOICES), **fields)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    return get_bool(options or {}, "include_usage", False)


def _chat_logprobs(body: dict) -> int | None:
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if not get_bool(body, "logprobs", False):
        if top:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


class ChatCodec:
    """chat/completions; CompletionsCodec below shares its shape for the legacy text route."""
    anthropic = False
    done = "data: [DONE]\n\n"
    prefix, whole_kind, chunk_kind = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    async def parse(self, request, state: ServerState, body: dict) -> Call:
        return self._begin(body, _common(body, state, plan=plan_openai(body),
                                         messages=chat_messages(body), logprobs=_chat_logprobs(body)))

    def _begin(self, body: dict, call: Call) -> Call:
        self.include_usage = _include_usage(body)
        self.head = {"id": self.prefix + uuid.uuid4().hex[:24], "created": int(time.time()),
                     "model": call.model}
        return call

    async def whole(self, reply: Reply) -> dict:
        choices = [await _whole_choice(reply, job, i) for i, job in enumerate(reply.group.jobs)]
        return {**self.head, "object": self.whole_kind, "choices": choices,
                "usage": _usage(reply.usage()), "macspec": reply.job.result.stats}

    async def events(self, reply: Reply):
        head = {**self.head, "object": self.chunk_kind}
        streams = [_choice_chunks(reply, job, i) for i, job in enumerate(reply.group.jobs)]
        async for choice in interleave(streams):
            yield {**head, "choices": [choice]}
        if self.include_usage:
            yield {**head, "choices": [], "usage": _usage(reply.usage())}

    def encode(self, event: dict) -> str:
        return f"data: {json.dumps(event)}\n\n"


class CompletionsCodec(ChatCodec):
    prefix, whole_kind, chunk_kind = "cmpl-", "text_completion", "text_completion"

    async def parse(self, request, state: ServerState, body: dict) -> Call:
        reject_unsupported(body, {"tools": [], "tool_choice": None})
        logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_LEGACY_LOGPROBS)
        call = _common(body, state, plan=plan_openai(body), logprobs=logprobs)
        call.prompt = await state.off_loop(completion_prompt, body, state.tokenizer)
        return self._begin(body, call)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await respond(request, ChatCodec())


async def completions(request: web.Request) -> web.StreamResponse:
    return await respond(request, CompletionsCodec())


async def _whole_choice(reply: Reply, job: Job, index: int) -> dict:
    state = reply.state
    text = "".join([piece async for piece in job.deltas()])
    logprobs = job.take_logprobs() if job.spec.logprobs is not None else None
    if reply.call.messages is None:  # a text completion
        return {"index": index, "text": text, "finish_reason": finish_reason(job.result),
                "logprobs": None if logprobs is None else _legacy_logprobs(state, logprobs, 0)}
    output = reply.output()
    got = collect(output.feed(text) + output.finish())
    message = {"role": "assistant", "content": got.content if got.content or not got.calls else None}
    if got.reasoning:
        message["reasoning_content"] = got.reasoning
    if got.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in got.calls]
    return {"index": index, "message": message,
            "logprobs": None if logprobs is None else {"content": _chat_logprobs_entries(state, logprobs)},
            "finish_reason": finish_reason(job.result, bool(got.calls))}


async def _choice_chunks(reply: Reply, job: Job, index: int):
    """One choice's stream: its `choices` entries, first to last."""
    state = reply.state
    output = reply.output() if reply.call.messages is not None else None
    wants_logprobs = job.spec.logprobs is not None
    offset = 0  # text_offset of the legacy logprobs

    def entry(delta: dict | None = None, text: str | None = None, finish: str | None = None) -> dict:
        nonlocal offset
        taken = job.take_logprobs() if wants_logprobs else []
        if output is None:
            logprobs = _legacy_logprobs(state, taken, offset) if wants_logprobs else None
            offset += len(text or "")
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        logprobs = {"content": _chat_logprobs_entries(state, taken)} if wants_logprobs else None
        return {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}

    if output is None:
        async for piece in job.deltas():
            yield entry(text=piece)
        yield entry(finish=finish_reason(job.result))
        return
    yield entry({"role": "assistant", "content": ""})
    called = False
    async for piece in job.deltas():
        for delta in _chat_deltas(output.feed(piece)):
            called |= "tool_calls" in delta
            yield entry(delta)
    for delta in _chat_deltas(output.finish()):
        called |= "tool_calls" in delta
        yield entry(delta)
    yield entry(finish=finish_reason(job.result, called))


def _chat_deltas(parts) -> list[dict]:
    out = []
    for part in parts:
        if part.kind == "content":
            out.append({"content": part.text})
        elif part.kind == "reasoning":
            out.append({"reasoning_content": part.text})
        else:
            d = part.call
            call = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                call.update(id=d.id, type="function")
                call["function"]["name"] = d.name
            out.append({"tool_calls": [call]})
    return out


def _token_text(state: ServerState, token: int) -> tuple[str, list[int]]:
    raw = state.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def _chat_logprobs_entries(state: ServerState, taken) -> list[dict]:
    out = []
    for token, (logprob, top) in taken:
        text, raw = _token_text(state, token)
        alternatives = []
        for alt, value in top:
            alt_text, alt_raw = _token_text(state, alt)
            alternatives.append({"token": alt_text, "logprob": value, "bytes": alt_raw})
        out.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return out


def _legacy_logprobs(state: ServerState, taken, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token, (logprob, top) in taken:
        text = _token_text(state, token)[0]
        tokens.append(text)
        values.append(logprob)
        tops.append({_token_text(state, alt)[0]: value for alt, value in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def finish_reason(result: JobResult, called: bool = False) -> str:
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def _usage(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt, "completion_tokens": usage.completion,
            "total_tokens": usage.prompt + usage.completion,
            "prompt_tokens_details": {"cached_tokens": usage.cached}}


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "macspec"}
            for name in state.model_names]
    return web.json_response({"object": "list", "data": data})
