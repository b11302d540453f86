"""The Responses API's request side: input items -> chat-template messages, and its tools,
tool_choice and text.format -> the shared OutputPlan.

Custom (freeform) tools reach the template as functions with one string argument `input`; a
forced custom tool's output is its raw input, constrained by its Lark or regex grammar.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from ..errors import RequestError
from .structured import MAX_TOOLS, OutputPlan, plan_tools, structured_extension, unique_names

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
CUSTOM_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["input"],
                     "properties": {"input": {"type": "string"}}}
GRAMMAR_SYNTAXES = {"lark": "lark", "regex": "regex"}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Records of hosted tools' runs (web search, file search, ...) in a conversation's history: the
# model never ran them here and the template has no place for them, so they are left out.
HOSTED_CALL_ITEMS = ("web_search_call", "file_search_call", "computer_call", "computer_call_output",
                     "image_generation_call", "code_interpreter_call", "mcp_list_tools",
                     "mcp_approval_request", "mcp_approval_response", "mcp_call")

logger = logging.getLogger(__name__)


@dataclass
class ResponseTools:
    """A request's tools as the template sees them, and how its calls map back to the wire."""
    template: list[dict] = field(default_factory=list)  # OpenAI chat form
    custom: dict[str, dict] = field(default_factory=dict)  # a custom tool's name -> its format
    # A namespace's functions reach the template flattened: template name -> (namespace, name).
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # hosted tools that cannot run here

    def wire_name(self, template_name: str) -> tuple[str | None, str]:
        """-> (namespace or None, name) as a call item carries them."""
        return self.namespaced.get(template_name, (None, template_name))

    def template_name(self, namespace, name: str) -> str:
        if namespace is None:
            return name
        for flat, (space, inner) in self.namespaced.items():
            if (space, inner) == (namespace, name):
                return flat
        return f"{namespace}.{name}"  # a namespace no longer offered: still a readable name

    def warnings(self) -> list[str]:
        return [f"tool {kind!r} is hosted by OpenAI and cannot run here: it was left out"
                for kind in self.dropped]


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


def input_messages(items: list, tools: ResponseTools | None = None) -> list[dict]:
    """Normalised input items -> chat-template messages."""
    talk = _Conversation()
    for i, item in enumerate(items):
        _add_item(talk, item, f"input[{i}]", tools or ResponseTools())
    return talk.messages


def _add_item(talk: _Conversation, item, where: str, tools: ResponseTools) -> None:
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
        name = tools.template_name(item.get("namespace"), name)
        talk.call(call_id, name, _call_arguments(item, kind, where))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if not isinstance(item.get("call_id"), str):
            raise RequestError(f"{where}: a {kind} needs 'call_id'", "input")
        talk.output(item["call_id"], _parts_text(item.get("output", ""), f"{where}.output"))
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        talk.reasoning.append(_parts_text(parts, f"{where}.content"))
    elif kind in HOSTED_CALL_ITEMS:
        logger.debug("%s: a %s item left out (a hosted tool's record)", where, kind)
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


def response_tools(value) -> ResponseTools:
    """Responses tools -> the template's functions, custom formats and namespaces; hosted tools
    (web search, ...) cannot run here and are dropped with a log line, not refused."""
    if value is None:
        return ResponseTools()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    out, members = ResponseTools(), []  # members: (namespace or None, tool, where)
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            members += _namespace_members(tool, i)
        elif kind in ("function", "custom"):
            members.append((None, tool, f"tools[{i}]"))
        elif isinstance(kind, str):
            logger.info("tools[%d]: hosted tool %r left out (it cannot run here)", i, kind[:40])
            out.dropped.append(kind[:40])
        else:
            raise RequestError(f"tools[{i}] must be an object with a 'type'", "tools")
    bare = [tool.get("name") for _, tool, _ in members]
    for namespace, tool, where in members:
        # A namespace's function keeps its bare name unless another tool has it too.
        clash = namespace is not None and bare.count(tool.get("name")) > 1
        _add_tool(out, tool, where, namespace, f"{namespace}.{tool.get('name')}" if clash else None)
    unique_names(out.template, "tools")
    return out


def _namespace_members(tool: dict, index: int) -> list[tuple]:
    space, inner = tool.get("name"), tool.get("tools")
    if not isinstance(space, str) or not space or not isinstance(inner, list):
        raise RequestError(f"tools[{index}]: a namespace needs 'name' and a list of 'tools'", "tools")
    for j, member in enumerate(inner):
        if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
            raise RequestError(f"tools[{index}].tools[{j}] must be a function or custom tool", "tools")
    return [(space, member, f"tools[{index}].tools[{j}]") for j, member in enumerate(inner)]


def _add_tool(out: ResponseTools, tool: dict, where: str, namespace: str | None,
              flat: str | None) -> None:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name must be a non-empty string", "tools")
    flat = flat or name
    if tool["type"] == "function":
        params = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise RequestError(f"{where}.parameters must be a JSON Schema object", "tools")
    else:
        out.custom[flat] = _custom_format(tool.get("format"), where)
        params = CUSTOM_PARAMETERS
    entry = {"name": flat, "parameters": params}
    if isinstance(tool.get("description"), str):
        entry["description"] = tool["description"]
    if namespace is not None:
        out.namespaced[flat] = (namespace, name)
    out.template.append({"type": "function", "function": entry})


def _custom_format(fmt, where: str) -> dict:
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {"type": "text"}
    if (isinstance(fmt, dict) and fmt.get("type") == "grammar"
            and fmt.get("syntax") in GRAMMAR_SYNTAXES and isinstance(fmt.get("definition"), str)):
        return fmt
    raise RequestError(f"{where}.format must be {{'type': 'text'}} or {{'type': 'grammar', "
                       "'syntax': 'lark' | 'regex', 'definition': ...}", "tools")


def plan_responses(body: dict) -> tuple[OutputPlan, ResponseTools]:
    """-> (the output plan, the tools as the template sees them)."""
    tools = response_tools(body.get("tools"))
    custom = tools.custom
    choice = _tool_choice(body.get("tool_choice"), tools)
    plan = plan_tools(tools.template, choice, "tool_choice")
    if plan.tool_mode == "named" and plan.forced in custom:
        fmt = custom[plan.forced]  # the output is the raw input: its own grammar, or free text
        plan.grammar = (GRAMMAR_SYNTAXES[fmt["syntax"]], fmt["definition"]) if fmt["type"] == "grammar" else None
    if not plan.forced_call:
        plan.grammar = _text_format(body.get("text"))
    structured_extension(body, plan)  # vLLM's structured_outputs, as on the other APIs
    return plan, tools


def _tool_choice(choice, tools: ResponseTools):
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        return ("named", tools.template_name(choice.get("namespace"), choice["name"]))
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
