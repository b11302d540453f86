"""Tool calls in model output: Kimi K2 sections, GLM arg_key/arg_value blocks, Hermes-style JSON.

Parsers stream: feed() returns content and finished calls as soon as they are unambiguous,
holding back only text that may be the start of a marker. A call the model got wrong (bad JSON,
unknown tool, no end marker) comes back as plain content, never as an exception.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from .reasoning import partial_marker_len

logger = logging.getLogger(__name__)

KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGS_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text


@dataclass
class TextDelta:
    text: str


@dataclass
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = TextDelta | ToolCallDelta


def detect_format(chat_template: str | None, special_tokens: set[str]) -> str:
    """"kimi", "glm" or "json": which tool-call syntax the model's chat template teaches."""
    template = chat_template or ""
    if KIMI_SECTION_BEGIN in special_tokens or KIMI_SECTION_BEGIN in template:
        return "kimi"
    return "glm" if "<arg_key>" in template else "json"


def make_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_names(tools: list[dict] | None) -> set[str] | None:
    """Names the request offers; None when it offers none, and then any name is accepted."""
    names = (_function(t).get("name") for t in tools or [])
    return {n for n in names if isinstance(n, str)} or None


def _function(tool) -> dict:
    # OpenAI nests the function; accept a bare {"name", "parameters"} too.
    if not isinstance(tool, dict):
        return {}
    inner = tool.get("function")
    return inner if isinstance(inner, dict) else tool


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, set[str]]]:
    """tool name -> parameter -> JSON schema types (from "type", "anyOf" and "oneOf")."""
    table: dict[str, dict[str, set[str]]] = {}
    for tool in tools or []:
        fn = _function(tool)
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            table[fn["name"]] = {k: _schema_types(s) for k, s in props.items()}
    return table


def _schema_types(schema) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key) if isinstance(schema.get(key), list) else []:
            types |= _schema_types(alt)
    return types


def _dump(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_object(text: str) -> dict | None:
    value = _loads(text)
    return value if isinstance(value, dict) else None


class _CallStream:
    """Text with calls between begin/end markers, optionally grouped in a section (Kimi)."""

    section: tuple[str, str] | None = None
    call_markers: tuple[str, str] = (TOOL_CALL_BEGIN, TOOL_CALL_END)

    def __init__(self, tools: list[dict] | None = None):
        self.names = tool_names(tools)
        self.types = _param_types(tools)
        self._state = "text"  # "text" | "section" | "call"
        self._buf = ""  # not yet scanned for markers
        self._raw = ""  # what the open section/call looked like, returned if it is malformed
        self._body = ""  # the open call, between its markers
        self._section_in_text = False  # the section's opening went out as text: so does its end
        self._num_calls = 0
        self._after_call = False  # whitespace after a call is dropped, not content
        self._pending_ws = ""
        self._out: list[Delta] = []

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        self._advance(final=True)
        if self._state != "text":
            self._reject("unterminated")
        self._state, self._pending_ws = "text", ""
        return self._take()

    def parse_call(self, body: str) -> list[tuple[str, str, str]] | None:
        """(id, name, arguments) for each call in one block's body; None if malformed."""
        raise NotImplementedError

    def is_known(self, name) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def _markers(self) -> tuple[str, ...]:
        begin, end = self.call_markers
        if self.section is None:
            return (begin,) if self._state == "text" else (end, begin)
        if self._state == "text":
            return (self.section[0],)
        inner = (begin, self.section[1])
        return inner if self._state == "section" else (end, *inner)

    def _advance(self, final: bool) -> None:
        while True:
            markers = self._markers()
            found = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
            if not found:
                keep = 0 if final else partial_marker_len(self._buf, markers)
                self._consume(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            idx, marker = min(found)
            self._consume(self._buf[:idx])
            self._buf = self._buf[idx + len(marker):]
            self._on_marker(marker)

    def _consume(self, text: str) -> None:
        if self._state == "text":
            self._emit_text(text)
        else:
            self._raw += text
            self._body += text if self._state == "call" else ""

    def _on_marker(self, marker: str) -> None:
        begin, end = self.call_markers
        if self._state == "call" and marker != end:
            # A new call or the section's end before this call's end: this call is malformed.
            if marker != begin:
                self._raw += marker
            self._reject("unterminated")
            if marker != begin:
                self._state = "text"
                return
        if marker == begin:
            self._state, self._body = "call", ""
            self._raw += marker
        elif marker == end:
            self._raw += marker
            self._close_call()
        elif self.section and marker == self.section[0]:
            self._state, self._raw, self._section_in_text = "section", marker, False
        else:  # the section's end
            self._raw += marker
            junk = self._raw.replace(self.section[0], "").replace(self.section[1], "")
            if junk.strip() or self._section_in_text:
                self._reject("stray text in section")
            self._state, self._raw = "text", ""

    def _close_call(self) -> None:
        calls = self.parse_call(self._body)
        if calls is None:
            self._reject("malformed")
        else:
            for call_id, name, arguments in calls:
                self._emit_call(call_id, name, arguments)
            self._raw = ""
        self._state = "section" if self.section else "text"

    def _reject(self, why: str) -> None:
        if self._raw.strip():
            logger.warning("tool-call text returned as content (%s): %.200r", why, self._raw)
        raw, self._raw = self._raw, ""
        self._section_in_text |= bool(self.section) and raw.startswith(self.section[0])
        self._emit_text(raw)

    def _emit_text(self, text: str) -> None:
        if self._after_call:
            self._pending_ws += text
            if not self._pending_ws.strip():
                return
            text, self._pending_ws, self._after_call = self._pending_ws, "", False
        if not text:
            return
        if self._out and isinstance(self._out[-1], TextDelta):
            self._out[-1].text += text
        else:
            self._out.append(TextDelta(text))

    def _emit_call(self, call_id: str, name: str, arguments: str) -> None:
        self._out.append(ToolCallDelta(self._num_calls, call_id, name, arguments))
        self._num_calls += 1
        self._after_call, self._pending_ws = True, ""

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


class KimiToolParser(_CallStream):
    """`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`."""

    section = (KIMI_SECTION_BEGIN, KIMI_SECTION_END)
    call_markers = (KIMI_CALL_BEGIN, KIMI_CALL_END)

    def parse_call(self, body: str) -> list[tuple[str, str, str]] | None:
        head, sep, tail = body.partition(KIMI_ARGS_BEGIN)
        call_id = head.strip()
        prefix, colon, idx = call_id.rpartition(":")
        name = prefix.removeprefix("functions.")
        args = _json_object(tail)
        if not (sep and colon and idx.isdigit() and self.is_known(name)) or args is None:
            return None
        return [(call_id, name, _dump(args))]


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmToolParser(_CallStream):
    """`<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`"""

    def parse_call(self, body: str) -> list[tuple[str, str, str]] | None:
        head, sep, rest = body.partition("<arg_key>")
        name = head.strip()
        if not self.is_known(name) or re.search(r"[\s<>]", name):
            return None
        rest, pos, args = sep + rest, 0, {}
        types = self.types.get(name, {})
        while match := _GLM_ARG.match(rest, pos):
            key = match[1].strip()
            args[key] = _typed(match[2], types.get(key, set()))
            pos = match.end()
        if rest[pos:].strip():
            return None
        return [(make_call_id(), name, _dump(args))]


def _typed(value: str, types: set[str]):
    # The template writes strings raw and everything else as JSON.
    if not types or "string" in types:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class JsonToolParser(_CallStream):
    """`<tool_call>{"name": …, "arguments": {…}}</tool_call>`, or an output that is only such
    JSON (an object or a list of them)."""

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._mode = "undecided"  # "undecided" | "bare" (may be only JSON) | "stream"
        self._lead = ""
        self._closed = False  # the lead already holds a complete JSON value

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "stream":
            return super().feed(text)
        self._lead += text
        head = self._lead.lstrip()
        if not head:
            return []
        if self._mode == "undecided":
            self._mode = "bare" if head[0] in "{[" else "stream"
        if self._mode == "bare" and self._may_be_bare(head, text):
            return []
        return self._stream_lead()

    def finish(self) -> list[Delta]:
        if self._mode != "stream":
            calls = self._json_calls(_loads(self._lead), require_args=True)
            if calls:
                for call_id, name, arguments in calls:
                    self._emit_call(call_id, name, arguments)
                return self._take()
            return self._stream_lead() + super().finish()
        return super().finish()

    def parse_call(self, body: str) -> list[tuple[str, str, str]] | None:
        return self._json_calls(_loads(body), require_args=False)

    def _stream_lead(self) -> list[Delta]:
        self._mode, lead, self._lead = "stream", self._lead, ""
        return super().feed(lead)

    def _may_be_bare(self, head: str, text: str) -> bool:
        # Give up on "only JSON" as soon as the opening cannot be a call, or a complete JSON
        # value is followed by more text or is not a call: content then streams at once.
        opening = "".join(head[:64].split())
        start = '[{"' if opening[0] == "[" else '{"'
        if not start.startswith(opening[:len(start)]):
            return False
        if not self._closed and "}" not in text and "]" not in text:
            return True  # no complete JSON value yet: skip the decode
        try:
            value, end = json.JSONDecoder().raw_decode(head)
        except ValueError:
            return True
        self._closed = True
        return not head[end:].strip() and self._json_calls(value, require_args=True) is not None

    def _json_calls(self, value, require_args: bool) -> list[tuple[str, str, str]] | None:
        items = value if isinstance(value, list) else [value]
        calls = [self._json_call(item, require_args) for item in items]
        return calls if calls and None not in calls else None

    def _json_call(self, item, require_args: bool) -> tuple[str, str, str] | None:
        if not isinstance(item, dict) or not self.is_known(item.get("name")):
            return None
        key = "arguments" if "arguments" in item else "parameters"
        if require_args and key not in item:
            return None
        args = item.get(key, {})
        args = _json_object(args) if isinstance(args, str) else args
        return (make_call_id(), item["name"], _dump(args)) if isinstance(args, dict) else None


_FORCED_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', re.S)
_FORCED_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*', re.S)


def cut_forced_call(text: str, names: list[str]) -> tuple[str, str] | None:
    """A forced {"name": …, "arguments": …} cut short (max_tokens) -> (name, the arguments text
    as far as it got); None while the text still fits several names."""
    match = _FORCED_NAME.match(text)
    if match is None:  # the name is unfinished: it is decided once one tool fits
        fits = [n for n in names if ('{"name":' + json.dumps(n, ensure_ascii=False)).startswith(
            "".join(text.split()))]
        return (fits[0], "") if len(fits) == 1 else None
    name = _loads(match[1])
    if name not in names:
        return None
    args = _FORCED_ARGS.match(text, match.end())
    return name, text[args.end():] if args else ""


PARSERS = {"kimi": KimiToolParser, "glm": GlmToolParser, "json": JsonToolParser}


def make_parser(fmt: str, tools: list[dict] | None = None) -> _CallStream:
    """A fresh streaming parser for one response in format `fmt` ("kimi", "glm" or "json")."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(PARSERS)}")
    return PARSERS[fmt](tools)


def assemble(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    """Content and calls from a stream of deltas, as a non-streamed response reports them."""
    content, calls = [], {}
    for delta in deltas:
        if isinstance(delta, TextDelta):
            content.append(delta.text)
            continue
        call = calls.setdefault(delta.index, ToolCall(delta.id or "", delta.name or "", ""))
        call.arguments += delta.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]


def parse_complete(fmt: str, text: str,
                   tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """A whole response as (content, calls); the same result as streaming it in any chunks."""
    parser = make_parser(fmt, tools)
    return assemble(parser.feed(text) + parser.finish())
