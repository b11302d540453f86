"""The model's text -> what a chat response carries: reasoning, content and tool calls.

Streaming and non-streaming responses use the same `ChatOutput`; the non-streaming ones collect
its parts with `collect`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .reasoning import ReasoningSplitter
from .structured import OutputPlan
from .toolcalls import (TextDelta, ToolCall, ToolCallDelta, cut_forced_call, make_call_id,
                        make_parser)


@dataclass
class Part:
    kind: str  # "content" | "reasoning" | "call"
    text: str = ""
    call: ToolCallDelta | None = None


class ChatOutput:
    """Feed text pieces as they come; get the parts to send."""

    def __init__(self, plan: OutputPlan, tool_format: str, reasoning: bool, in_reasoning: bool):
        self.plan = plan
        # A forced call's output is the grammar's JSON: no reasoning block can precede it.
        self.reasoning = ReasoningSplitter(in_reasoning=in_reasoning) if reasoning and not plan.forced_call else None
        self.parser = make_parser(tool_format, plan.tools) if plan.tool_mode == "auto" else None
        self.buffer: list[str] = []  # "required": the whole {"name", "arguments"} object
        self.call_id = make_call_id()
        self.opened = False  # "named": the call's first delta went out

    def feed(self, text: str) -> list[Part]:
        return self._route(text, final=False)

    def finish(self) -> list[Part]:
        return self._route("", final=True)

    def _route(self, text: str, final: bool) -> list[Part]:
        mode = self.plan.tool_mode
        if mode == "named":
            return self._named(text)
        if mode == "required":
            self.buffer.append(text)
            return self._required() if final else []
        pieces = [("content", text)] if self.reasoning is None else self.reasoning.feed(text)
        if final and self.reasoning is not None:
            pieces += self.reasoning.finish()
        out: list[Part] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out.append(Part("reasoning", piece))
            else:
                out += self._content(piece)
        if final and self.parser is not None:
            out += self._parsed(self.parser.finish())
        return [p for p in out if p.kind == "call" or p.text]

    def _content(self, text: str) -> list[Part]:
        if self.parser is None:
            return [Part("content", text)]
        return self._parsed(self.parser.feed(text))

    @staticmethod
    def _parsed(deltas) -> list[Part]:
        return [Part("content", d.text) if isinstance(d, TextDelta) else Part("call", call=d)
                for d in deltas]

    def _named(self, text: str) -> list[Part]:
        parts = []
        if not self.opened:
            self.opened = True
            parts.append(Part("call", call=ToolCallDelta(0, self.call_id, self.plan.forced, "")))
        if text:
            parts.append(Part("call", call=ToolCallDelta(0, None, None, text)))
        return parts

    def _required(self) -> list[Part]:
        """The grammar made it {"name": ..., "arguments": {...}}. Cut short (max_tokens) it is
        still the call, its arguments as far as they got, as a named call's are; only a cut
        before the name is decided leaves text."""
        text = "".join(self.buffer)
        try:
            value = json.loads(text)
            name, arguments = value["name"], json.dumps(value["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            cut = cut_forced_call(text, [t["function"]["name"] for t in self.plan.tools])
            if cut is None:
                return [Part("content", text)] if text else []
            name, arguments = cut
        return [Part("call", call=ToolCallDelta(0, self.call_id, name, arguments))]


@dataclass
class Collected:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def collect(parts: list[Part], into: Collected | None = None) -> Collected:
    """Merge parts into whole strings and whole calls (deltas of one call share its index)."""
    out = into or Collected()
    by_index: dict[int, ToolCall] = {c_index: c for c_index, c in enumerate(out.calls)}
    for part in parts:
        if part.kind == "content":
            out.content += part.text
        elif part.kind == "reasoning":
            out.reasoning += part.text
        else:
            d = part.call
            call = by_index.get(d.index)
            if call is None:
                call = by_index[d.index] = ToolCall(d.id or make_call_id(), d.name or "", "")
                out.calls.append(call)
            call.arguments += d.arguments
    return out
