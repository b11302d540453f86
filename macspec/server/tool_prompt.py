"""Tools for a chat template that ignores them: a Qwen2.5-style block in the system message.

Some templates (SmolLM2's, the embedded tiny model's) render neither `tools` nor an assistant's
`tool_calls`, so under tool_choice "auto" the model would never learn that the tools exist. As
llama.cpp's server and Ollama do, the tools are then described in the system message, and the
calls and results the template would drop are written as text in the same `<tool_call>` syntax,
which the "json" tool-call parser reads back. A template that renders tools is left alone.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> "
                "XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
PROBE_NAME = "macspec_probe_tool"
PROBE_RESULT = "macspec_probe_result"
PROBE_SYSTEM = "macspec_probe_system"
PROBE_TOOL = {"type": "function", "function": {
    "name": PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}}}
PROBE_USER = {"role": "user", "content": "hi"}
PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_probe", "type": "function", "function": {"name": PROBE_NAME, "arguments": {}}}]}
PROBE_ANSWER = {"role": "tool", "tool_call_id": "call_probe", "content": PROBE_RESULT}


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools, found by rendering probe conversations."""

    injects: bool = False  # the template ignores `tools`: the block goes in the prompt
    renders_calls: bool = True  # an assistant's tool_calls appear in the prompt
    renders_tool_role: bool = True  # a "tool" message renders (its content appears)
    renders_system: bool = True  # a "system" message renders


def probe_template(tokenizer) -> TemplateTools:
    """Four renders of tiny conversations (milliseconds); a template that fails the first two
    is left alone."""
    plain = _render(tokenizer, [PROBE_USER])
    if plain is None or plain != _render(tokenizer, [PROBE_USER], [PROBE_TOOL]):
        return TemplateTools()
    calls = _render(tokenizer, [PROBE_USER, PROBE_CALL], [PROBE_TOOL]) or ""
    answered = _render(tokenizer, [PROBE_USER, PROBE_CALL, PROBE_ANSWER], [PROBE_TOOL]) or ""
    system = _render(tokenizer, [{"role": "system", "content": PROBE_SYSTEM}, PROBE_USER]) or ""
    support = TemplateTools(True, PROBE_NAME in calls, PROBE_RESULT in answered,
                            PROBE_SYSTEM in system)
    logger.info("the chat template ignores tools; they are described in the system message "
                "(server.inject_tool_prompt): %s", support)
    return support


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
    except Exception:  # jinja2 raises its own types; a template may refuse roles it lacks
        return None


def tools_block(tools: list[dict]) -> str:
    """Qwen2.5's words for the tools, one JSON object a line."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def with_tool_prompt(messages: list[dict], tools: list[dict] | None,
                     support: TemplateTools) -> list[dict]:
    """The messages with the calls and results the template would drop as text, and the tools
    block, if any tools, in the system message (the first user message when the template has
    no system role)."""
    out = [_calls_as_text(m) if not support.renders_calls else m for m in messages]
    if not support.renders_tool_role:
        out = _results_as_text(out)
    if not tools:
        return out
    return _add_block(out, tools_block(tools), "system" if support.renders_system else "user")


def _add_block(messages: list[dict], block: str, role: str) -> list[dict]:
    at = next((i for i, m in enumerate(messages)
               if m.get("role") == role and isinstance(m.get("content"), str)), None)
    if at is None or (role == "system" and at != 0):
        return [{"role": role, "content": block}, *messages]
    text = messages[at]["content"]
    joined = _join(text, block) if role == "system" else _join(block, text)
    return [*messages[:at], {**messages[at], "content": joined}, *messages[at + 1:]]


def _join(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    parts = [message["content"]] if message.get("content") else []
    parts += [f"<tool_call>\n{_call_json(call)}\n</tool_call>" for call in calls]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(parts)}


def _call_json(call: dict) -> str:
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):  # already JSON text: keep it as the object it holds
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            pass
    return json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)


def _results_as_text(messages: list[dict]) -> list[dict]:
    """Each run of "tool" messages -> one user message of <tool_response> blocks (as Qwen2.5's
    template writes them), joined to the user message that follows so roles still alternate."""
    out: list[dict] = []
    run: list[str] = []
    for message in messages:
        if message.get("role") == "tool":
            run.append(f"<tool_response>\n{message.get('content') or ''}\n</tool_response>")
            continue
        if run and message.get("role") == "user" and isinstance(message.get("content"), str):
            text = message["content"]
            message, run = {**message, "content": "\n".join([*run, text] if text else run)}, []
        out += _flush(run) + [message]
        run = []
    return out + _flush(run)


def _flush(run: list[str]) -> list[dict]:
    return [{"role": "user", "content": "\n".join(run)}] if run else []
