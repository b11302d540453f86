"""The Responses API's output side: ChatOutput parts -> output items (reasoning, message,
function_call, custom_tool_call), whole or as the reference's typed stream events."""

from __future__ import annotations

import json
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ItemBuilder:
    """Parts in, output items and their events out. One item per run of a kind: a reasoning
    item, a message, one call item per tool call. `events` collects (type, fields) pairs for
    streaming; whole responses read `items` only."""

    def __init__(self, tools, raw_custom: bool):
        self.tools = tools  # ResponseTools: custom formats and namespaces by template name
        self.raw_custom = raw_custom  # a forced custom tool: the output is its raw input
        self.items: list[dict] = []
        self.events: list[tuple[str, dict]] = []
        self.open: tuple | None = None  # (kind, call index) of the item being built
        self.held: str = ""  # a custom call's JSON arguments, unwrapped when the call closes

    @property
    def called(self) -> bool:
        return any(item["type"] in ("function_call", "custom_tool_call") for item in self.items)

    def feed(self, parts) -> list[tuple[str, dict]]:
        for part in parts:
            key = (part.kind, part.call.index if part.call else None)
            if key != self.open:
                self._close()
                self._start(part, key)
            self._delta(part)
        return self._take()

    def finish(self, status: str = "completed") -> list[tuple[str, dict]]:
        self._close(status)
        return self._take()

    def _take(self) -> list[tuple[str, dict]]:
        out, self.events = self.events, []
        return out

    def _start(self, part, key) -> None:
        if part.kind == "call":
            item = self._call_item(part.call)
        elif part.kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress"}
        self.items.append(item)
        self.open = key
        self.held = ""
        self._event("response.output_item.added", item=_copy(item))
        if item["type"] in ("message", "reasoning"):
            self._event("response.content_part.added", item_id=item["id"], content_index=0,
                        part=_part(item["type"], ""))

    def _call_item(self, call) -> dict:
        namespace, name = self.tools.wire_name(call.name)
        if call.name in self.tools.custom:
            item = {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress",
                    "call_id": call.id, "name": name, "input": ""}
        else:
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call.id, "name": name, "arguments": ""}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def _delta(self, part) -> None:
        item = self.items[-1]
        kind = item["type"]
        if kind == "function_call":
            item["arguments"] += part.call.arguments
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        delta=part.call.arguments)
        elif kind == "custom_tool_call" and not self.raw_custom:
            self.held += part.call.arguments
        elif kind == "custom_tool_call":
            item["input"] += part.call.arguments
            self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                        delta=part.call.arguments)
        else:
            self._text(item, part.text)

    def _text(self, item: dict, text: str) -> None:
        if not item["content"]:
            item["content"].append(_part(item["type"], ""))
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if item["type"] == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        self._event(name, item_id=item["id"], content_index=0, delta=text, **extra)

    def _close(self, status: str = "completed") -> None:
        if self.open is None:
            return
        item = self.items[-1]
        self.open = None
        kind = item["type"]
        if kind == "custom_tool_call" and not self.raw_custom:
            item["input"] = _custom_input(self.held)
            self._event("response.custom_tool_call_input.delta", item_id=item["id"], delta=item["input"])
        if kind == "function_call":
            self._event("response.function_call_arguments.done", item_id=item["id"],
                        arguments=item["arguments"], name=item["name"])
        elif kind == "custom_tool_call":
            self._event("response.custom_tool_call_input.done", item_id=item["id"], input=item["input"])
        else:
            text = item["content"][0]["text"] if item["content"] else ""
            if kind == "message":
                self._event("response.output_text.done", item_id=item["id"], content_index=0,
                            text=text, logprobs=[])
            else:
                self._event("response.reasoning_text.done", item_id=item["id"], content_index=0, text=text)
            self._event("response.content_part.done", item_id=item["id"], content_index=0,
                        part=_part(kind, text))
        item["status"] = status
        self._event("response.output_item.done", item=_copy(item))

    def _event(self, kind: str, **fields) -> None:
        self.events.append((kind, {"output_index": len(self.items) - 1, **fields}))


def _part(item_type: str, text: str) -> dict:
    if item_type == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


def _custom_input(arguments: str) -> str:
    """A custom tool reached the template as a function of one `input`: unwrap it (a call cut
    short stays the raw text)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def output_items_as_input(items: list[dict]) -> list[dict]:
    """A stored response's output, as the input items of the next turn."""
    out = []
    for item in items:
        if item["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": item["content"]})
        elif item["type"] in ("reasoning", "function_call", "custom_tool_call"):
            out.append(item)
    return out
