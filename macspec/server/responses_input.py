"""The Responses API's request side: input items -> chat-template messages, and its tools,
tool_choice and text.format -> the shared OutputPlan.

Custom (freeform) tools reach the template as functions with one string argument `input`; a
forced custom tool's output is its raw input, constrained by its Lark or regex grammar.
"""

from __future__ import annotations

import json

from ..errors import RequestError
from .structured import MAX_TOOLS, OutputPlan, plan_tools, structured_extension, unique_names

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
CUSTOM_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["input"],
                     "properties": {"input": {"type": "string"}}}
GRAMMAR_SYNTAXES = {"lark": "lark", "regex": "regex"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _parts_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise RequestError(f"{where}[{j}]: type {kind!r} is not supported (text parts: "
                               f"{', '.join(TEXT_PARTS[:2])})"[:300], "input")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


class _Conversation:
    """Builds template messages item by item: calls join the assistant message before them,
    reasoning waits for the assistant message after it."""

    def __init__(self):
        self.messages: list[dict] = []
        self.reasoning: list[str] = []

    def message(self, role: str, text: str) -> None:
        message = {"role": role, "content": text}
        if role == "assistant" and self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)

    def call(self, call_id: str, name: str, arguments) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            self.message("assistant", "")
            last = self.messages[-1]
        last.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})

    def output(self, call_id: str, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})


def input_messages(items: list) -> list[dict]:
    """Normalised input items -> chat-template messages."""
    talk = _Conversation()
    for i, item in enumerate(items):
        _add_item(talk, item, f"input[{i}]")
    return talk.messages


def _add_item(talk: _Conversation, item, where: str) -> None:
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role = {role!r}; one of {', '.join(ROLES)}"[:300], "input")
        talk.message(ROLES[role], _parts_text(item.get("content"), f"{where}.content"))
    elif kind in ("function_call", "custom_tool_call"):
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise RequestError(f"{where}: a {kind} needs 'call_id' and 'name'", "input")
        talk.call(call_id, name, _call_arguments(item, kind, where))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise RequestError(f"{where}: a {kind} needs 'call_id'", "input")
        talk.output(item["call_id"], _parts_text(item.get("output", ""), f"{where}.output"))
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        talk.reasoning.append(_parts_text(parts, f"{where}.content"))
    else:
        raise RequestError(f"{where}: item type {kind!r} is not supported (message, function_call, "
                           "function_call_output, custom_tool_call, custom_tool_call_output, "
                           "reasoning)"[:300], "input")


def _call_arguments(item: dict, kind: str, where: str):
    """Templates read arguments as objects (transformers' convention)."""
    if kind == "custom_tool_call":
        if not isinstance(item.get("input"), str):
            raise RequestError(f"{where}: a custom_tool_call needs 'input' (a string)", "input")
        return {"input": item["input"]}
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise RequestError(f"{where}.arguments must be a JSON string", "input")
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return arguments  # templates print a string as it is


def normalise_input(value) -> list:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise RequestError("'input' must be a string or a list of items", "input")


def response_tools(value) -> tuple[list[dict], dict[str, dict]]:
    """Responses tools -> (OpenAI chat form for the template, {custom name: its format})."""
    if value is None:
        return [], {}
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    out, custom = [], {}
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in ("function", "custom"):
            raise RequestError(f"tools[{i}].type = {kind!r} cannot run here: only 'function' and "
                               "'custom' tools are supported"[:300], "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].name must be a non-empty string", "tools")
        if kind == "function":
            params = tool.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise RequestError(f"tools[{i}].parameters must be a JSON Schema object", "tools")
        else:
            custom[name] = _custom_format(tool.get("format"), i)
            params = CUSTOM_PARAMETERS
        entry = {"name": name, "parameters": params}
        if isinstance(tool.get("description"), str):
            entry["description"] = tool["description"]
        out.append({"type": "function", "function": entry})
    unique_names(out, "tools")
    return out, custom


def _custom_format(fmt, index: int) -> dict:
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {"type": "text"}
    if (isinstance(fmt, dict) and fmt.get("type") == "grammar"
            and fmt.get("syntax") in GRAMMAR_SYNTAXES and isinstance(fmt.get("definition"), str)):
        return fmt
    raise RequestError(f"tools[{index}].format must be {{'type': 'text'}} or {{'type': 'grammar', "
                       "'syntax': 'lark' | 'regex', 'definition': ...}", "tools")


def plan_responses(body: dict) -> tuple[OutputPlan, dict[str, dict]]:
    """-> (the output plan, the custom tools' formats)."""
    tools, custom = response_tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    plan = plan_tools(tools, choice, "tool_choice")
    if plan.tool_mode == "named" and plan.forced in custom:
        fmt = custom[plan.forced]  # the output is the raw input: its own grammar, or free text
        plan.grammar = (GRAMMAR_SYNTAXES[fmt["syntax"]], fmt["definition"]) if fmt["type"] == "grammar" else None
    if not plan.forced_call:
        plan.grammar = _text_format(body.get("text"))
    structured_extension(body, plan)  # vLLM's structured_outputs, as on the other APIs
    return plan, custom


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return ("named", choice["name"])
    raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or {'type': "
                       "'function' | 'custom', 'name': ...}", "tool_choice")


def _text_format(text) -> tuple[str, object] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", {"type": "object"})
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return ("json_schema", fmt["schema"])
    raise RequestError("'text.format' must be {'type': 'text' | 'json_object'} or {'type': "
                       "'json_schema', 'name': ..., 'schema': {...}}", "text")


def thinking_args(body: dict) -> dict:
    """`reasoning.effort` turns the template's thinking switch: "none" off, any other on."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise RequestError(f"reasoning.effort = {effort!r}; one of {', '.join(EFFORTS)}"[:200],
                           "reasoning")
    return {"enable_thinking": effort != "none"}
