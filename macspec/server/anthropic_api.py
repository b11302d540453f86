"""POST /v1/messages (the Anthropic Messages API, typed SSE events) and /v1/messages/count_tokens.

Content blocks map onto the chat template as transformers passes them: `tool_use` blocks are an
assistant's tool calls, `tool_result` blocks are tool messages; the output's reasoning becomes
`thinking` blocks and its calls `tool_use` blocks (streamed as `input_json_delta`).
"""

from __future__ import annotations

import json
import logging
import uuid

from aiohttp import web

from ..errors import RequestError
from .output import collect
from .respond import Call, Reply, Usage, prepare, respond
from .schema import get_bool, get_int, get_stop, parse_json_body
from .state import STATE, ServerState
from .structured import plan_anthropic

logger = logging.getLogger(__name__)

ROLES = ("user", "assistant", "system")  # Claude Code sends system messages mid-conversation
MEDIA = ("image", "document")  # what a text model cannot read
MEDIA_PLACEHOLDER = "[{} omitted: this model reads text only]"


def _text_of(content, where: str, media_ok: bool = False) -> str:
    """A string, or a list of text blocks; `media_ok` turns image and document blocks into a
    placeholder (a tool's screenshot must not fail every later turn that re-sends it)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text(b) or (media_ok and _is_media(b)) for b in content):
        return "".join(b["text"] if _is_text(b) else MEDIA_PLACEHOLDER.format(b["type"]) for b in content)
    raise RequestError(f"{where} must be a string or a list of text blocks", "messages")


def _is_text(block) -> bool:
    return isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)


def _is_media(block) -> bool:
    return isinstance(block, dict) and block.get("type") in MEDIA


def _system(body: dict) -> list[dict]:
    system = body.get("system")
    if system is None:
        return []
    return [{"role": "system", "content": _text_of(system, "'system'")}]


def conversation(body: dict) -> list[dict]:
    """Anthropic messages -> chat-template messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = _system(body)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with role user, assistant or "
                               "system", "messages")
        content = m.get("content")
        if m["role"] == "system":
            out.append({"role": "system", "content": _text_of(content, f"messages[{i}].content")})
        elif isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(m["role"], content, i)
        else:
            raise RequestError(f"messages[{i}].content must be a string or a list of blocks", "messages")
    return out


def _blocks(role: str, blocks: list, index: int) -> list[dict]:
    texts, calls, results, thinking = [], [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages[{index}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            text = _text_of(block.get("content", ""), f"{where}.content", media_ok=True)
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            thinking.append(block.get("thinking", ""))
        elif kind in MEDIA:
            raise RequestError(f"{where}: {kind} blocks cannot be served: this model reads text "
                               "only", "messages")
        else:
            raise RequestError(f"{where}: type {kind!r} is not supported in a {role} message "
                               "(text, tool_use, tool_result, thinking)"[:300], "messages")
    out = list(results)  # the answers to the previous turn's calls come first
    if texts or calls or thinking or not results:
        message = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        out.append(message)
    return out


def _thinking_args(body: dict) -> dict:
    """`thinking` turns the template's thinking switch (GLM, Qwen: enable_thinking) on or off;
    "adaptive" is on with no budget (the model decides how long)."""
    _check_effort(body)
    value = body.get("thinking")
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "adaptive", "disabled"):
        raise RequestError("'thinking' must be {'type': 'enabled', 'budget_tokens': N}, "
                           "{'type': 'adaptive'} or {'type': 'disabled'}", "thinking")
    if value["type"] == "enabled":
        get_int(value, "budget_tokens", None, lo=1)
    return {"enable_thinking": value["type"] != "disabled"}


def _check_effort(body: dict) -> None:
    """output_config.effort ("low" ... "max") has no switch in chat templates (thinking on/off is
    `thinking`'s): accepted and ignored, whatever new level a client sends."""
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None and not isinstance(effort, str):
        raise RequestError("output_config.effort must be a string such as \"high\"", "output_config")
    if effort is not None:
        logger.debug("output_config.effort = %s ignored (no template switch for it)", effort)


def _check_unsupported(body: dict) -> None:
    """Claude Code's defaults (metadata, context_management, service_tier, container) are
    ignored; MCP servers cannot be reached from here."""
    if body.get("mcp_servers"):
        raise RequestError("'mcp_servers' is not supported: this server cannot connect to MCP "
                           "servers (give their tools as client tools)", "mcp_servers")


def stop_reason(result, called: bool) -> str:
    if result.stop_sequence is not None:
        return "stop_sequence"
    if result.finish_reason == "length":
        return "max_tokens"
    return "tool_use" if called else "end_turn"


def _call(state: ServerState, body: dict) -> Call:
    _check_unsupported(body)
    return Call(state.check_model(body.get("model")), body, plan_anthropic(body),
                messages=conversation(body), template_args=_thinking_args(body),
                stop=get_stop(body, "stop_sequences"), stream=get_bool(body, "stream", False),
                temperature_max=1.0)


async def count_tokens(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    prompt, _ = await prepare(state, _call(state, parse_json_body(await request.read())))
    return web.json_response({"input_tokens": len(prompt)})


class MessagesCodec:
    anthropic = True
    done = None

    async def parse(self, request, state: ServerState, body: dict) -> Call:
        call = _call(state, body)
        call.max_tokens = get_int(body, "max_tokens", None, lo=1)
        if call.max_tokens is None:
            raise RequestError("'max_tokens' is required", "max_tokens")
        self.ident = "msg_" + uuid.uuid4().hex[:24]
        return call

    async def whole(self, reply: Reply) -> dict:
        output, job = reply.output(), reply.job
        text = "".join([piece async for piece in job.deltas()])
        got = collect(output.feed(text) + output.finish())
        content = []
        if got.reasoning:
            content.append({"type": "thinking", "thinking": got.reasoning, "signature": ""})
        if got.content or not got.calls:
            content.append({"type": "text", "text": got.content})
        content += [{"type": "tool_use", "id": _tool_use_id(c.id), "name": c.name,
                     "input": _input(c.arguments)} for c in got.calls]
        return {"id": self.ident, "type": "message", "role": "assistant", "model": reply.call.model,
                "content": content, "stop_reason": stop_reason(job.result, bool(got.calls)),
                "stop_sequence": job.result.stop_sequence, "usage": _usage(reply.usage())}

    async def events(self, reply: Reply):
        output, job = reply.output(), reply.job
        yield "message_start", {"type": "message_start", "message": {
            "id": self.ident, "type": "message", "role": "assistant", "model": reply.call.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}}
        yield "ping", {"type": "ping"}
        blocks = _BlockStream()
        async for piece in job.deltas():
            for event in blocks.parts(output.feed(piece)):
                yield event
        for event in [*blocks.parts(output.finish()), *blocks.end()]:
            yield event
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason(job.result, blocks.called),
                                          "stop_sequence": job.result.stop_sequence},
                                "usage": _usage(reply.usage())}
        yield "message_stop", {"type": "message_stop"}

    def encode(self, item) -> str:
        name, data = item
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def messages(request: web.Request) -> web.StreamResponse:
    return await respond(request, MessagesCodec())


def _usage(usage: Usage) -> dict:
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens = the prompt."""
    return {"input_tokens": usage.prompt - usage.cached, "cache_read_input_tokens": usage.cached,
            "cache_creation_input_tokens": 0, "output_tokens": usage.completion}


class _BlockStream:
    """Output parts -> content_block_start / _delta / _stop events, one block per run of a kind
    (a thinking block, a text block, one tool_use block per call)."""

    def __init__(self):
        self.index = -1
        self.open: tuple | None = None  # (kind, call index) of the block being streamed
        self.called = False

    def parts(self, parts):
        for part in parts:
            key = (part.kind, part.call.index if part.call else None)
            if key != self.open:
                yield from self._close()
                yield from self._start(part, key)
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": _delta(part)}

    def end(self):
        if self.index < 0:  # an empty answer is still one (empty) text block
            yield from self._start_block({"type": "text", "text": ""}, ("content", None))
        yield from self._close()

    def _start(self, part, key):
        if part.kind == "call":
            self.called = True
            block = {"type": "tool_use", "id": _tool_use_id(part.call.id), "name": part.call.name,
                     "input": {}}
        elif part.kind == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        yield from self._start_block(block, key)

    def _start_block(self, block: dict, key):
        self.index += 1
        self.open = key
        yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                      "content_block": block}

    def _close(self):
        if self.open is not None:
            if self.open[0] == "reasoning":  # thinking blocks end with their signature
                yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                              "delta": {"type": "signature_delta", "signature": ""}}
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.open = None


def _delta(part) -> dict:
    if part.kind == "call":
        return {"type": "input_json_delta", "partial_json": part.call.arguments}
    if part.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": part.text}
    return {"type": "text_delta", "text": part.text}


def _tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or uuid.uuid4().hex).removeprefix("call_").replace(":", "_").replace(".", "_")


def _input(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}  # a call cut short by max_tokens
    return value if isinstance(value, dict) else {"_value": value}
