"""What shapes a chat's output, read from a request: tools, tool_choice, response_format.

The result (`OutputPlan`) says which grammar, if any, the engine must enforce, and how the
output text becomes a response: plain text, a call forced by the grammar (`tool_choice`
named or required), or free text in which the model's own tool-call syntax is parsed ("auto").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from ..errors import RequestError

logger = logging.getLogger(__name__)

MAX_TOOLS = 128


@dataclass
class OutputPlan:
    tools: list[dict] = field(default_factory=list)  # OpenAI form: {"type": "function", "function": {...}}
    # "none": no tool calls; "auto": parse the model's own syntax; "named": the output is the
    # arguments of `forced`; "required": the output is {"name": ..., "arguments": ...}.
    tool_mode: str = "none"
    forced: str | None = None
    grammar: tuple[str, object] | None = None  # (kind, value) for GrammarCompiler.compile

    @property
    def forced_call(self) -> bool:
        return self.tool_mode in ("named", "required")


def _name_of(tool: dict) -> str:
    return tool["function"]["name"]


def openai_tools(value, field_name: str = "tools") -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"'{field_name}' must be a list of at most {MAX_TOOLS} tools", field_name)
    out = []
    for i, tool in enumerate(value):
        where = f"{field_name}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", field_name)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}.function.name must be a non-empty string", field_name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON Schema object", field_name)
        entry = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            entry["description"] = fn["description"]
        out.append({"type": "function", "function": entry})
    unique_names(out, field_name)
    return out


def anthropic_tools(value) -> list[dict]:
    """Anthropic's {name, description, input_schema} -> the OpenAI form used inside."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{i}].name must be a non-empty string", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"tools[{i}].input_schema must be a JSON Schema object", "tools")
        entry = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            entry["description"] = tool["description"]
        out.append({"type": "function", "function": entry})
    unique_names(out, "tools")
    return out


def unique_names(tools: list[dict], field_name: str) -> None:
    names = [_name_of(t) for t in tools]
    if len(set(names)) != len(names):
        raise RequestError(f"'{field_name}' names a function twice", field_name)


def plan_openai(body: dict) -> OutputPlan:
    tools = openai_tools(body.get("tools"))
    if not tools and body.get("functions") is not None:  # the legacy spelling
        tools = openai_tools([{"type": "function", "function": f} for f in body["functions"]]
                             if isinstance(body["functions"], list) else body["functions"], "functions")
    choice = body.get("tool_choice", body.get("function_call"))
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else choice
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                               "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        choice = ("named", name)
    plan = plan_tools(tools, choice, "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and not plan.forced_call:
        plan.grammar = _response_format(fmt)
    structured_extension(body, plan)
    return plan


def plan_anthropic(body: dict) -> OutputPlan:
    tools = anthropic_tools(_client_tools(body.get("tools")))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise RequestError("tool_choice {'type': 'tool'} needs a 'name'", "tool_choice")
            choice = ("named", choice["name"])
        elif kind in ("auto", "none"):
            choice = kind
        elif kind == "any":
            choice = "required"
        else:
            raise RequestError(f"tool_choice.type = {kind!r}; one of auto, any, tool, none"[:200],
                               "tool_choice")
    elif choice is not None:
        raise RequestError("'tool_choice' must be an object {'type': ...}", "tool_choice")
    plan = plan_tools(tools, choice, "tool_choice")
    name, fmt = _anthropic_format(body)
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise RequestError(f"'{name}' must be {{'type': 'json_schema', 'schema': {{...}}}}",
                               name.split(".")[0])
        plan.grammar = ("json_schema", fmt["schema"])
    structured_extension(body, plan)
    return plan


def _anthropic_format(body: dict) -> tuple[str, object]:
    """Structured outputs: `output_config.format` (current) or `output_format` (the beta's)."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("'output_config' must be an object {format, effort}", "output_config")
    fmt = (config or {}).get("format")
    if fmt is not None and body.get("output_format") is not None:
        raise RequestError("give 'output_config.format' or 'output_format', not both", "output_config")
    return ("output_config.format", fmt) if fmt is not None else ("output_format", body.get("output_format"))


def _client_tools(value):
    """Anthropic's server tools (web_search_*, code_execution_*, bash_*, ...: a `type` and no
    input_schema) run on Anthropic's side, not here: dropped, so agents that list them by
    default still work."""
    if not isinstance(value, list):
        return value
    kept = [t for t in value if not _is_server_tool(t)]
    new = sorted({str(t["type"])[:40] for t in value if _is_server_tool(t)} - _DROPPED_TYPES)
    if new and len(_DROPPED_TYPES) < MAX_TOOLS:  # once per type: agents send them every request
        logger.info("Anthropic server tools cannot run here; dropped from requests: %s", ", ".join(new))
        _DROPPED_TYPES.update(new)
    return kept


def _is_server_tool(tool) -> bool:
    return isinstance(tool, dict) and "input_schema" not in tool and tool.get("type") not in (None, "custom")


_DROPPED_TYPES: set[str] = set()


def structured_extension(body: dict, plan: OutputPlan) -> None:
    """vLLM's `structured_outputs`, on either API."""
    extension = body.get("structured_outputs")
    if extension is not None:
        if plan.grammar is not None or plan.forced_call:
            raise RequestError("'structured_outputs' cannot be combined with another output format "
                               "or a forced tool call", "structured_outputs")
        plan.grammar = _structured_outputs(extension)


def apply_testing(plan: OutputPlan, testing, messages: list[dict]) -> OutputPlan:
    """The profile's [testing] switches (docs/profiles.md): on the user's turn, a call to one of
    `force_tool_call` (its arguments still the model's, grammar-bound); after a tool's result,
    an answer matching `answer_pattern`, so a model that never stops ends its turn."""
    said = [m["role"] for m in messages if m["role"] != "system"]
    last = said[-1] if said else None
    if plan.tool_mode == "auto" and last == "user" and testing.force_tool_call:
        offered = [_name_of(t) for t in plan.tools]
        pick = next((n for n in testing.force_tool_call if n in offered),
                    offered[0] if "*" in testing.force_tool_call else None)
        if pick is not None:
            return plan_tools(plan.tools, ("named", pick), "tool_choice")
    if last == "tool" and testing.answer_pattern and plan.grammar is None and not plan.forced_call:
        plan.tool_mode, plan.grammar = "none", ("regex", testing.answer_pattern)
    return plan


def plan_tools(tools: list[dict], choice, field_name: str) -> OutputPlan:
    if choice in (None, "auto"):
        return OutputPlan(tools, "auto" if tools else "none")
    if choice == "none":
        return OutputPlan(tools, "none")
    if not tools:
        raise RequestError(f"'{field_name}' = {choice!r} needs 'tools'"[:200], field_name)
    if choice == "required":
        schema = {"anyOf": [_call_schema(t) for t in tools]}
        return OutputPlan(tools, "required", grammar=("json_schema", schema))
    if isinstance(choice, tuple):
        name = choice[1]
        match = [t for t in tools if _name_of(t) == name]
        if not match:
            raise RequestError(f"'{field_name}' names {name!r}, which is not among the tools"[:300],
                               field_name)
        return OutputPlan(tools, "named", name, ("json_schema", _object_schema(match[0])))
    raise RequestError(f"'{field_name}' = {choice!r}; one of none, auto, required, or a "
                       "named function"[:300], field_name)


def _object_schema(tool: dict) -> dict:
    schema = dict(tool["function"]["parameters"])
    schema.setdefault("type", "object")
    return schema


def _call_schema(tool: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": _name_of(tool)}, "arguments": _object_schema(tool)}}


def _response_format(fmt) -> tuple[str, object] | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError("'response_format' must be {'type': 'text' | 'json_object' | "
                           "'json_schema', ...}", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_schema", {"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON Schema object",
                               "response_format")
        return ("json_schema", schema)
    raise RequestError(f"response_format.type = {kind!r}; one of text, json_object, json_schema"[:200],
                       "response_format")


def _structured_outputs(value) -> tuple[str, object]:
    """vLLM's extension: exactly one of json, regex, grammar (Lark), choice."""
    kinds = {"json": "json_schema", "regex": "regex", "grammar": "lark", "choice": "choice"}
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in kinds:
        raise RequestError("'structured_outputs' must hold exactly one of json, regex, grammar, "
                           "choice", "structured_outputs")
    key, spec = next(iter(value.items()))
    if key == "json" and isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise RequestError("structured_outputs.json must be a JSON Schema", "structured_outputs") from None
    ok = {"json": dict, "regex": str, "grammar": str, "choice": list}[key]
    if not isinstance(spec, ok) or (key == "choice" and not all(isinstance(c, str) for c in spec)):
        raise RequestError(f"structured_outputs.{key} has the wrong type", "structured_outputs")
    return (kinds[key], spec)
