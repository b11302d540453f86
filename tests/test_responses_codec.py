"""The Responses codec without a model: input items -> template messages, tools -> plan, and
output parts -> items and the reference's event order."""

from __future__ import annotations

import json

import pytest

from macspec.errors import RequestError
from macspec.server.output import Part
from macspec.server.responses_input import (ResponseTools, input_messages, normalise_input,
                                            plan_responses, thinking_args)
from macspec.server.responses_output import ItemBuilder, output_items_as_input
from macspec.server.toolcalls import ToolCallDelta


def test_items_become_template_messages():
    items = [{"role": "developer", "content": "be terse"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
             {"type": "custom_tool_call", "call_id": "c2", "name": "sh", "input": "ls"},
             {"type": "function_call_output", "call_id": "c1", "output": "2"},
             {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "a.py"}]}]
    messages = input_messages(items)
    assert messages[0] == {"role": "system", "content": "be terse"}
    assert messages[2]["role"] == "assistant" and messages[2]["reasoning_content"] == "hm"
    assert [c["function"] for c in messages[2]["tool_calls"]] == [
        {"name": "add", "arguments": {"a": 1}}, {"name": "sh", "arguments": {"input": "ls"}}]
    assert messages[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "2"},
                            {"role": "tool", "tool_call_id": "c2", "content": "a.py"}]
    assert normalise_input("x") == [{"type": "message", "role": "user", "content": "x"}]


def test_tools_and_choices_make_the_shared_plan():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}},
             {"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark",
                                                        "definition": "start: \"a\""}}]
    plan, named = plan_responses({"tools": tools, "tool_choice": {"type": "custom", "name": "g"}})
    assert plan.tool_mode == "named" and plan.grammar == ("lark", 'start: "a"') and "g" in named.custom
    plan, _ = plan_responses({"tools": tools, "text": {"format": {"type": "json_object"}}})
    assert plan.tool_mode == "auto" and plan.grammar == ("json_schema", {"type": "object"})
    assert thinking_args({"reasoning": {"effort": "none"}}) == {"enable_thinking": False}
    with pytest.raises(RequestError, match="needs .tools."):
        plan_responses({"tools": [{"type": "web_search"}], "tool_choice": {"type": "function", "name": "x"}})


def test_namespaces_flatten_and_map_back():
    spaced = {"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {"type": "function", "name": "g", "parameters": {"type": "object"}}]}
    plan, tools = plan_responses({"tools": [spaced, {"type": "function", "name": "f"},
                                            {"type": "web_search"}]})
    assert sorted(t["function"]["name"] for t in plan.tools) == ["f", "g", "ns.f"]
    assert tools.wire_name("ns.f") == ("ns", "f") and tools.wire_name("g") == ("ns", "g")
    assert tools.wire_name("f") == (None, "f") and tools.dropped == ["web_search"]
    messages = input_messages([{"type": "function_call", "call_id": "c", "name": "f",
                                "namespace": "ns", "arguments": "{}"}], tools)
    assert messages[0]["tool_calls"][0]["function"]["name"] == "ns.f"
    builder = ItemBuilder(tools, raw_custom=False)
    builder.feed([Part("call", call=ToolCallDelta(0, "call_1", "g", "{}"))])
    builder.finish()
    assert (builder.items[0]["name"], builder.items[0]["namespace"]) == ("g", "ns")


def test_item_builder_events_follow_the_reference_order():
    builder = ItemBuilder(ResponseTools(), raw_custom=False)
    events = builder.feed([Part("reasoning", "think"), Part("content", "hel"), Part("content", "lo"),
                           Part("call", call=ToolCallDelta(0, "call_1", "add", '{"a"')),
                           Part("call", call=ToolCallDelta(0, None, None, ': 1}'))])
    events += builder.finish()
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [fields["output_index"] for kind, fields in events if kind.endswith("item.done")] == [0, 1, 2]
    reasoning, message, call = builder.items
    assert message["content"][0]["text"] == "hello" and json.loads(call["arguments"]) == {"a": 1}
    assert [i["type"] for i in output_items_as_input(builder.items)] == ["reasoning", "message", "function_call"]


def test_custom_calls_unwrap_their_input():
    builder = ItemBuilder(ResponseTools(custom={"sh": {"type": "text"}}), raw_custom=False)
    builder.feed([Part("call", call=ToolCallDelta(0, "call_1", "sh", '{"input": "ls -a"}'))])
    builder.finish()
    assert builder.items[0]["type"] == "custom_tool_call" and builder.items[0]["input"] == "ls -a"
