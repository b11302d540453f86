"""What every route shares: the engine, the tokenizer, model names, SSE plumbing, errors."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from ..config import Profile
from ..engine.service import EngineService
from ..errors import MacspecError, NotFoundError, RequestError
from ..grammar import GrammarCompiler
from .jobs import ClientGone
from .reasoning import opens_in_reasoning
from .tool_prompt import TemplateTools, probe_template, with_tool_prompt
from .toolcalls import detect_format
from .turns import TurnMemory

logger = logging.getLogger(__name__)

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                         413: "request_too_large", 415: "invalid_request_error",
                         429: "rate_limit_error", 503: "overloaded_error"}
KEEPALIVE_S = 5.0  # an SSE comment this often while no event is ready (prefill, held-back text)
KEEPALIVE = b": keep-alive\n\n"
DEFAULT_MODEL = "default"  # always accepted as `model`: whatever this server serves
# 400s whose error_type is an OpenAI error `code` that clients act on (Codex compacts its
# history on context_length_exceeded); their `type` stays invalid_request_error.
REQUEST_ERROR_CODES = ("context_length_exceeded",)


def error_body(status: int, message: str, error_type: str, param: str | None, anthropic: bool) -> dict:
    if anthropic:
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                           "message": message}}
    coded = error_type in REQUEST_ERROR_CODES
    return {"error": {"message": message, "type": "invalid_request_error" if coded else error_type,
                      "param": param, "code": error_type if coded or status != 400 else None}}


class ServerState:
    def __init__(self, engine: EngineService, profile: Profile):
        self.engine = engine
        self.profile = profile
        self.runtime = engine.runtime
        self.tokenizer = engine.runtime.tokenizer
        self.started = time.time()
        self.model_id = profile.model.path  # what responses name as `model` when none was asked
        names = [profile.model.path, profile.name, Path(profile.model.path.split(":")[-1]).name,
                 *profile.server.model_aliases]
        self.model_names = list(dict.fromkeys(names))  # listed by /v1/models, in this order
        self.strict_model_names = profile.server.strict_model_names
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
        self._token_bytes: dict[int, bytes] = {}
        # Earlier answers' ids for the next turn's prompt (see server/turns.py).
        self.turns = TurnMemory(self.tokenizer, profile.server.answer_ids_kept)
        self.stopping = False  # set at shutdown: /health answers 503 until the port closes

    def check_model(self, model) -> str:
        """-> the `model` responses carry: the name asked for (echoed, as vLLM and llama.cpp do;
        agents such as Claude Code check it), or the served model for none or "default"."""
        if model is None or model == "" or model == DEFAULT_MODEL:
            return self.model_id
        if not isinstance(model, str):
            raise RequestError("'model' must be a string", "model")
        if self.strict_model_names and model not in self.model_names:
            raise NotFoundError(f"model {model[:200]!r} is not served here; available: "
                                f"{', '.join([*self.model_names, DEFAULT_MODEL])}", "model")
        return model

    async def off_loop(self, fn, *args):
        """Tokenizing and chat templating take milliseconds per long prompt: run them on a
        worker thread so the event loop keeps streaming other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    inject: bool = True, **template_args) -> tuple[list[int], bool]:
        """-> (prompt ids, whether the prompt leaves a <think> block open). Tools go to the chat
        template as transformers passes them; a template that cannot render them is a 400. A
        template that ignores them gets them, and earlier calls, as text (server/tool_prompt.py)."""
        if self.has_chat_template:
            if inject and self.template_tools.injects:
                messages, tools = with_tool_prompt(messages, tools, self.template_tools), None
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                    **template_args)
            except Exception as err:  # jinja2 raises its own types for template errors
                raise RequestError(f"the model's chat template could not render these messages: "
                                   f"{err}"[:400], "messages") from None
        else:
            # No template: a plain transcript the base model can continue.
            text = "".join(f"{m['role']}: {_transcript_content(m)}\n" for m in messages)
            if tools:
                text = f"tools: {json.dumps(tools)}\n" + text
            text += "assistant:"
        return self.turns.encode(text), opens_in_reasoning(text)

    @functools.cached_property
    def template_tools(self) -> TemplateTools:
        """What the chat template does with tools, probed once."""
        if not (self.has_chat_template and self.profile.server.inject_tool_prompt):
            return TemplateTools()
        return probe_template(self.tokenizer)

    @functools.cached_property
    def grammar(self) -> GrammarCompiler:
        """Built on first use (~20 ms to 1 s for a large vocabulary)."""
        return GrammarCompiler(self.tokenizer, self.runtime.vocab_size,
                               strict=self.profile.server.strict_json_schema)

    def compile_grammar(self, kind: str, value) -> str:
        return self.grammar.compile(kind, value)

    def token_bytes(self, token: int) -> bytes:
        """A token's exact bytes (a byte-level token may be part of a UTF-8 character)."""
        raw = self._token_bytes.get(token)
        if raw is None:
            vocab = self.grammar.tokenizer
            if token < vocab.vocab_size and not vocab.is_special_token(token):
                raw = vocab.decode_bytes([token])
            else:
                raw = self.tokenizer.decode([token]).encode()
            self._token_bytes[token] = raw
        return raw

    @functools.cached_property
    def tool_format(self) -> str:
        choice = self.profile.server.tool_parser
        if choice != "auto":
            return choice
        if self.template_tools.injects:  # the injected block teaches <tool_call>{json}
            return "json"
        special = set(getattr(self.tokenizer, "all_special_tokens", None) or [])
        special |= set(getattr(getattr(self.tokenizer, "_tokenizer", None), "added_tokens_encoder", {}) or {})
        return detect_format(getattr(self.tokenizer, "chat_template", None), special)

    @functools.cached_property
    def parses_reasoning(self) -> bool:
        choice = self.profile.server.reasoning_parser
        if choice != "auto":
            return choice == "think"
        return "<think>" in (getattr(self.tokenizer, "chat_template", None) or "")

    async def open_sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        return response

    async def stream_events(self, response: web.StreamResponse, group, events, encode,
                            done: str | None = None, anthropic: bool = False) -> None:
        """Write events until the end; a failure mid-stream becomes an error event (the status
        line is already sent), a vanished client cancels the jobs and is logged as 499. While
        no event comes (a long prefill) a comment line goes out every KEEPALIVE_S, so clients'
        idle timeouts do not fire."""
        stream = keepalive(events, KEEPALIVE_S)
        try:
            async for event in stream:
                await response.write(KEEPALIVE if event is None else encode(event).encode())
        except (ConnectionResetError, ClientGone):  # the finally below cancels the jobs
            group.jobs[0].usage["status"] = ClientGone.http_status  # the access log's status
            return
        except MacspecError as err:
            body = error_body(err.http_status, str(err), err.error_type, err.param, anthropic)
            line = f"event: error\ndata: {json.dumps(body)}\n\n" if anthropic else f"data: {json.dumps(body)}\n\n"
            try:
                await response.write(line.encode())
            except ConnectionResetError:
                return
        finally:
            await stream.aclose()
            group.close()
        try:
            if done:
                await response.write(done.encode())
            await response.write_eof()
        except ConnectionResetError:
            pass


async def keepalive(events, interval: float):
    """The items of `events`, with None each time `interval` seconds pass without one."""
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            finished, _ = await asyncio.wait({pending}, timeout=interval)
            if not finished:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        if not pending.done():  # the consumer stopped early: end the pending step first
            pending.cancel()
            await asyncio.wait({pending})
        await events.aclose()


def _transcript_content(message: dict) -> str:
    content = message.get("content") or ""
    calls = message.get("tool_calls")
    if calls:
        content += json.dumps([c.get("function", c) for c in calls])
    return content


def _request_key(name: str, kind: type):
    make = getattr(web, "RequestKey", None)  # aiohttp >= 3.13; a plain string before
    return make(name, kind) if make else name


STATE = web.AppKey("state", ServerState)
# Per request: the id in the access log (and the X-Request-Id header), and what a route handler
# reports for the access log: {"prompt_tokens": int, "completion_tokens": int, "method": str,
# "acceptance": float | None}.
REQUEST_ID = _request_key("macspec_request_id", str)
USAGE = _request_key("macspec_usage", dict)
STARTED = web.AppKey("started", float)  # event-loop time at startup, for uptime
