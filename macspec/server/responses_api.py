"""POST /v1/responses (the OpenAI Responses API, typed SSE events), GET and DELETE
/v1/responses/{id}.

A codec over the shared pipeline: input items become chat-template messages, tools and
text.format an OutputPlan, and ChatOutput's parts become output items (responses_output).
Stored responses (a bounded LRU, `server.responses_store`) carry their whole conversation so
`previous_response_id` continues it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict

from aiohttp import web

from ..errors import MacspecError, NotFoundError, RequestError
from .jobs import ClientGone
from .respond import Call, Reply, Usage, respond
from .responses_input import input_messages, normalise_input, plan_responses, thinking_args
from .responses_output import ItemBuilder, new_id, output_items_as_input
from .schema import get_bool, get_int, get_str, reject_unsupported
from .state import ServerState

UNSUPPORTED = {"background": False, "conversation": None, "prompt": None, "top_logprobs": 0}
ECHOED = ("instructions", "metadata", "parallel_tool_calls", "temperature", "top_p",
          "max_output_tokens", "previous_response_id", "tool_choice", "tools", "text", "reasoning")


class ResponseStore:
    """Finished responses by id, with the input items that led to them; oldest dropped first."""

    def __init__(self, limit: int):
        self.limit = limit
        self.entries: OrderedDict[str, tuple[dict, list]] = OrderedDict()

    def put(self, response: dict, items: list) -> None:
        if self.limit == 0:
            return
        self.entries[response["id"]] = (response, items)
        while len(self.entries) > self.limit:
            self.entries.popitem(last=False)

    def get(self, ident: str) -> tuple[dict, list]:
        if ident not in self.entries:
            raise NotFoundError(f"no stored response with id {ident[:100]!r}", "response_id")
        self.entries.move_to_end(ident)
        return self.entries[ident]

    def delete(self, ident: str) -> None:
        self.get(ident)
        del self.entries[ident]


STORE = web.AppKey("responses_store", ResponseStore)


def _history(request: web.Request, body: dict) -> list:
    """The conversation so far: the previous response's inputs and outputs, then this input."""
    previous = get_str(body, "previous_response_id")
    items = normalise_input(body.get("input"))
    if previous is None:
        return items
    response, earlier = request.app[STORE].get(previous)
    return earlier + output_items_as_input(response["output"]) + items


def _messages(body: dict, items: list, tools) -> list[dict]:
    messages = input_messages(items, tools)
    instructions = get_str(body, "instructions")
    if instructions:  # not carried over by previous_response_id, as the reference says
        messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise RequestError("'input' is empty", "input")
    return messages


def _shell(body: dict, model: str, ident: str, status: str) -> dict:
    echo = {key: body.get(key) for key in ECHOED}
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    echo["tool_choice"] = body.get("tool_choice") or "auto"
    echo["tools"] = body.get("tools") or []
    return {"id": ident, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "usage": None, "store": body.get("store", True), **echo}


def _finish(shell: dict, job, builder: ItemBuilder, usage: Usage) -> dict:
    incomplete = job.result.finish_reason == "length"
    return {**shell, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": builder.items, "macspec": job.result.stats,
            "usage": {"input_tokens": usage.prompt, "input_tokens_details": {"cached_tokens": usage.cached},
                      "output_tokens": usage.completion,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage.prompt + usage.completion}}


class ResponsesCodec:
    anthropic = False
    done = None

    async def parse(self, request, state: ServerState, body: dict) -> Call:
        model = state.check_model(body.get("model"))
        reject_unsupported(body, UNSUPPORTED)
        self.store = request.app[STORE] if get_bool(body, "store", True) else None
        plan, self.tools = plan_responses(body)
        self.items = _history(request, body)
        self.shell = _shell(body, model, new_id("resp"), "in_progress")
        return Call(model, body, plan, messages=_messages(body, self.items, self.tools),
                    template_args=thinking_args(body), stream=get_bool(body, "stream", False),
                    max_tokens=get_int(body, "max_output_tokens", None, lo=1),
                    warnings=self.tools.warnings())

    def _begin(self, reply: Reply):
        """-> (the output parser, the item builder); the shell gains the call's warnings, known
        once the prompt is rendered."""
        if reply.call.warnings:
            self.shell["warnings"] = reply.call.warnings
        plan = reply.call.plan
        custom = plan.tool_mode == "named" and plan.forced in self.tools.custom
        return reply.output(), ItemBuilder(self.tools, raw_custom=custom)

    def _finish(self, reply: Reply, builder: ItemBuilder) -> dict:
        response = _finish(self.shell, reply.job, builder, reply.usage())
        if self.store is not None:
            self.store.put(response, self.items)
        return response

    async def whole(self, reply: Reply) -> dict:
        output, builder = self._begin(reply)
        async for piece in reply.job.deltas():
            builder.feed(output.feed(piece))
        builder.feed(output.finish())
        builder.finish()
        return self._finish(reply, builder)

    async def events(self, reply: Reply):
        output, builder = self._begin(reply)
        sequence = iter(range(1 << 62))

        def event(kind: str, fields: dict) -> dict:
            return {"type": kind, "sequence_number": next(sequence), **fields}

        yield event("response.created", {"response": self.shell})
        yield event("response.in_progress", {"response": self.shell})
        try:
            async for piece in reply.job.deltas():
                for kind, fields in builder.feed(output.feed(piece)):
                    yield event(kind, fields)
        except ClientGone:
            raise
        except MacspecError as err:  # agents read the failure from the typed stream
            failed = {**self.shell, "status": "failed", "output": builder.items,
                      "error": {"code": err.error_type, "message": str(err)}}
            yield event("response.failed", {"response": failed})
            return
        for kind, fields in builder.feed(output.finish()) + builder.finish():
            yield event(kind, fields)
        final = self._finish(reply, builder)
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event(done, {"response": final})

    def encode(self, data: dict) -> str:
        return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


async def create(request: web.Request) -> web.StreamResponse:
    return await respond(request, ResponsesCodec())


async def retrieve(request: web.Request) -> web.Response:
    response, _ = request.app[STORE].get(request.match_info["response_id"])
    return web.json_response(response)


async def delete(request: web.Request) -> web.Response:
    ident = request.match_info["response_id"]
    request.app[STORE].delete(ident)
    return web.json_response({"id": ident, "object": "response", "deleted": True})


def add_routes(app: web.Application, store_limit: int) -> None:
    app[STORE] = ResponseStore(store_limit)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
