"""POST /v1/chat/completions and /v1/completions (OpenAI wire format, SSE streaming)."""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from ..errors import RequestError
from .jobs import Job, JobResult
from .schema import (build_job, get_bool, get_int, get_stop, parse_json_body, reject_unsupported)
from .state import STATE, USAGE, ServerState

ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {"n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
               "frequency_penalty": 0, "tools": [], "functions": [], "logit_bias": {},
               "best_of": 1, "echo": False, "suffix": None, "response_format": {"type": "text"}}
NO_TOOL_CHOICES = (None, "none", "auto")  # without tools, nothing else can be honoured


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
        out.append({"role": "system" if role == "developer" else role,
                    "content": message_text(m.get("content"), i)})
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


def _common(body: dict, state: ServerState):
    state.check_model(body.get("model"))
    reject_unsupported(body, UNSUPPORTED)
    if body.get("tool_choice") not in NO_TOOL_CHOICES:
        raise RequestError(f"'tool_choice' = {body['tool_choice']!r} needs tools, which are not "
                           "supported yet"[:300], "tool_choice")
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    include_usage = stream and get_bool(options or {}, "include_usage", False)
    max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=1)
    return stream, include_usage, max_tokens, get_stop(body, "stop")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    body = parse_json_body(await request.read())
    stream, include_usage, max_tokens, stop = _common(body, state)
    prompt = await state.off_loop(state.encode_chat, chat_messages(body))
    spec = build_job(body, prompt, max_tokens, stop, state.profile)
    return await _respond(request, state, spec, stream, include_usage, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    body = parse_json_body(await request.read())
    stream, include_usage, max_tokens, stop = _common(body, state)
    prompt = await state.off_loop(completion_prompt, body, state.tokenizer)
    spec = build_job(body, prompt, max_tokens, stop, state.profile)
    return await _respond(request, state, spec, stream, include_usage, chat=False)


async def _respond(request, state: ServerState, spec, stream: bool, include_usage: bool, chat: bool):
    job = Job(state.engine, state.tokenizer, spec, lambda: _gone(request))
    request[USAGE] = job.usage
    await job.start()
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = state.model_id
    if not stream:
        text = "".join([piece async for piece in job.deltas()])
        return web.json_response(_final_body(ident, created, model, text, job.result, len(spec.prompt), chat))
    response = await state.open_sse(request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": delta_text} if delta_text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        return {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}

    async def events():
        if chat:
            yield chunk(None, None, first=True)
        async for piece in job.deltas():
            yield chunk(piece, None)
        yield chunk(None, finish_reason(job.result))
        if include_usage:
            yield {"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                   "usage": usage(job.result, len(spec.prompt))}

    await state.stream_events(response, job, events(), lambda e: f"data: {json.dumps(e)}\n\n",
                              done="data: [DONE]\n\n")
    return response


def finish_reason(result: JobResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def usage(result: JobResult, prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": prompt_tokens + result.completion_tokens}


def _final_body(ident, created, model, text, result: JobResult, prompt_tokens: int, chat: bool) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason(result)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(result)}
    return {"id": ident, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice],
            "usage": usage(result, prompt_tokens), "macspec": result.stats}


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "macspec"}
            for name in state.model_names]
    return web.json_response({"object": "list", "data": data})
