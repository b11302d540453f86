"""POST /v1/messages: the Anthropic Messages API, stream (typed SSE events) and non-stream."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from ..errors import RequestError
from .jobs import Job, JobResult
from .openai_api import chat_messages, message_text
from .schema import build_job, get_bool, get_int, get_stop, parse_json_body, reject_unsupported
from .state import STATE, USAGE, ServerState

UNSUPPORTED = {"tools": [], "tool_choice": None, "thinking": None}


def _system(body: dict) -> list[dict]:
    system = body.get("system")
    if system is None:
        return []
    return [{"role": "system", "content": message_text(system, -1)}]


def stop_reason(result: JobResult) -> str:
    if result.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if result.finish_reason == "length" else "end_turn"


async def messages(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    body = parse_json_body(await request.read())
    state.check_model(body.get("model"))
    reject_unsupported(body, UNSUPPORTED)
    max_tokens = get_int(body, "max_tokens", None, lo=1)
    if max_tokens is None:
        raise RequestError("'max_tokens' is required", "max_tokens")
    stream = get_bool(body, "stream", False)
    conversation = _system(body) + chat_messages(body, roles=("user", "assistant"))
    prompt = await state.off_loop(state.encode_chat, conversation)
    spec = build_job(body, prompt, max_tokens, get_stop(body, "stop_sequences"), state.profile,
                     temperature_max=1.0)
    job = Job(state.engine, state.tokenizer, spec, lambda: request.transport is None or request.transport.is_closing())
    request[USAGE] = job.usage
    await job.start()
    ident = "msg_" + uuid.uuid4().hex[:24]
    if not stream:
        text = "".join([piece async for piece in job.deltas()])
        return web.json_response({
            "id": ident, "type": "message", "role": "assistant", "model": state.model_id,
            "content": [{"type": "text", "text": text}], "stop_reason": stop_reason(job.result),
            "stop_sequence": job.result.stop_sequence,
            "usage": {"input_tokens": len(prompt), "output_tokens": job.result.completion_tokens},
        })
    response = await state.open_sse(request)

    async def events():
        yield "message_start", {"type": "message_start", "message": {
            "id": ident, "type": "message", "role": "assistant", "model": state.model_id,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(prompt), "output_tokens": 0}}}
        yield "content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}
        yield "ping", {"type": "ping"}
        async for piece in job.deltas():
            yield "content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": piece}}
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason(job.result),
                                          "stop_sequence": job.result.stop_sequence},
                                "usage": {"output_tokens": job.result.completion_tokens}}
        yield "message_stop", {"type": "message_stop"}

    def encode(item) -> str:
        name, data = item
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"

    await state.stream_events(response, job, events(), encode, anthropic=True)
    return response
