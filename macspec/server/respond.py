"""The one pipeline every API shares: a codec parses its wire format into a `Call`, the pipeline
renders the prompt, submits the jobs and hands the codec a `Reply` to render back, whole or as
its stream of events.

    body --codec.parse--> Call --render, build_job, submit--> Reply --codec.whole / .events--> wire
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from aiohttp import web

from ..errors import RequestError
from .choices import JobGroup, start_response
from .output import ChatOutput
from .schema import build_job, parse_json_body
from .state import STATE, ServerState
from .structured import OutputPlan, apply_testing

logger = logging.getLogger(__name__)


@dataclass
class Call:
    """One request in the pipeline's terms, whichever API it came from."""
    model: str  # the name the response echoes
    body: dict  # sampling fields and the `speculative` extension are read from it as they are
    plan: OutputPlan
    messages: list[dict] | None = None  # chat-template messages, or
    prompt: list[int] | None = None  # token ids given as they are (text completions)
    template_args: dict = field(default_factory=dict)  # e.g. enable_thinking
    max_tokens: int | None = None  # None: up to the context left (server.max_output_tokens)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    logprobs: int | None = None
    temperature_max: float = 2.0
    warnings: list[str] = field(default_factory=list)  # what was left out, where an API says so


@dataclass
class Usage:
    """Token counts as every API reports them, each in its own field names."""
    prompt: int
    cached: int  # of the prompt, read from the prefix cache
    completion: int


@dataclass
class Reply:
    """What a codec renders: the call, its running jobs and the prompt they answer."""
    state: ServerState
    call: Call
    group: JobGroup
    prompt_tokens: int
    in_reasoning: bool  # the prompt leaves a <think> block open

    @property
    def job(self):
        return self.group.jobs[0]

    def output(self) -> ChatOutput:
        """A fresh parser of one choice's text into content, reasoning and tool calls."""
        state = self.state
        return ChatOutput(self.call.plan, state.tool_format, state.parses_reasoning, self.in_reasoning)

    def usage(self) -> Usage:
        cached = self.job.result.stats.get("cached_prompt_tokens", 0)
        return Usage(self.prompt_tokens, cached, self.group.completion_tokens)


class Codec(Protocol):
    """An API's wire format around the pipeline."""
    anthropic: bool  # errors in Anthropic's shape and words
    done: str | None  # the stream's closing line, if the format has one

    async def parse(self, request: web.Request, state: ServerState, body: dict) -> Call: ...

    async def whole(self, reply: Reply) -> dict: ...

    def events(self, reply: Reply) -> AsyncIterator[Any]: ...

    def encode(self, event) -> str: ...


async def respond(request: web.Request, codec: Codec) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    call = await codec.parse(request, state, parse_json_body(await request.read()))
    prompt, in_reasoning = await prepare(state, call)
    spec = build_job(call.body, prompt, call.max_tokens, call.stop, state.profile,
                     temperature_max=call.temperature_max, vocab=state.runtime.vocab_size,
                     logprobs=call.logprobs, anthropic=codec.anthropic)
    group = await start_response(request, state, spec, call.plan.grammar, call.n)
    reply = Reply(state, call, group, len(prompt), in_reasoning)
    if not call.stream:
        try:
            return web.json_response(await codec.whole(reply))
        finally:
            group.close()
    response = await state.open_sse(request)
    await state.stream_events(response, group, codec.events(reply), codec.encode,
                              done=codec.done, anthropic=codec.anthropic)
    return response


async def prepare(state: ServerState, call: Call) -> tuple[list[int], bool]:
    """The [testing] switches, then the prompt: -> (token ids, whether a <think> is left open)."""
    if call.messages is None:
        return call.prompt, False
    call.plan = apply_testing(call.plan, state.profile.testing, call.messages)
    prompt, in_reasoning, left_out = await state.off_loop(render, state, call.messages,
                                                          call.plan.tools, call.template_args)
    if left_out:
        call.warnings.append("the tools did not fit in the context once written into the prompt: "
                             "they were left out (the model cannot call them)")
    return prompt, in_reasoning


def render(state: ServerState, messages: list[dict], tools, template_args: dict):
    """-> (prompt ids, whether a <think> is left open, whether the tools were left out)."""
    prompt, in_reasoning = _render(state, messages, tools, template_args)
    if tools and len(prompt) >= state.profile.kv.max_context and state.template_tools.injects:
        # Tools written into the prompt (server.inject_tool_prompt) made it too long: an answer
        # without them is better than none (Codex on SmolLM2: 8.9k tokens with its tools, 4.6k
        # without).
        bare, in_reasoning = _render(state, messages, tools, template_args, inject=False)
        logger.warning("the prompt is %d tokens with its %d tools written in, %d without, and the "
                       "context %d: served without them (the model cannot call them)", len(prompt),
                       len(tools), len(bare), state.profile.kv.max_context)
        return bare, in_reasoning, True
    return prompt, in_reasoning, False


def _render(state: ServerState, messages: list[dict], tools, template_args: dict, inject=True):
    try:
        return state.render_chat(messages, tools, inject, **template_args)
    except RequestError:
        merged = leading_system(messages)
        if merged == messages:
            raise
        # Templates such as Gemma's or Mistral's take one system message, first; agents send
        # more (Claude Code mid-conversation, Codex two developer messages).
        logger.debug("the chat template refused system messages after the first; merged")
        return state.render_chat(merged, tools, inject, **template_args)


def leading_system(messages: list[dict]) -> list[dict]:
    """All system messages merged, in order, into one leading system message."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest
