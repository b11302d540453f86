"""POST /v1/responses through the real `openai` client, speculation on: text, function calls and
their outputs (with and without previous_response_id), custom tools with grammars, text.format,
reasoning, the stored-response routes, errors, and a Codex-style session replay."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests
from openai import OpenAI

from macspec import faults

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # starts a server

SPEC_ON = {"method": "draft", "num_draft_tokens": 4, "adaptive": False}
SPEC_OFF = {"method": "none"}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
SHELL_REGEX = "ls -[al]{1,2}( [a-z]{1,8})?"
TOOLS = [{"type": "function", "name": "add", "description": "sum", "parameters": ADD},
         {"type": "custom", "name": "shell", "description": "run a command",
          "format": {"type": "grammar", "syntax": "regex", "definition": SHELL_REGEX}},
         {"type": "custom", "name": "calc", "description": "arithmetic",
          "format": {"type": "grammar", "syntax": "lark",
                     "definition": 'start: NUM " " OP " " NUM\nNUM: /[0-9]{1,3}/\nOP: "+" | "-"'}}]
THINKING = r"<think>[a-z ]{4,30}</think>[a-z]{2,12}"
SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
         "properties": {"name": {"type": "string", "maxLength": 8},
                        "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def server():
    runtime = runtime_with("tiny", server__reasoning_parser="think", server__responses_store=8)
    with RunningServer(runtime, max_batch=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def create(client, spec=SPEC_ON, **kw):
    kw.setdefault("max_output_tokens", 24)
    extra = {"speculative": spec, **kw.pop("extra_body", {})}
    return client.responses.create(model="default", temperature=0, extra_body=extra, **kw)


def test_text_equals_chat_completions_and_speculation_off(client):
    reply = create(client, instructions="Be brief.", input="def parse(")
    off = create(client, SPEC_OFF, instructions="Be brief.", input="def parse(")
    chat = client.chat.completions.create(
        model="default", temperature=0, max_tokens=24, extra_body={"speculative": SPEC_OFF},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def parse("}])
    assert reply.output_text == off.output_text == chat.choices[0].message.content
    assert reply.object == "response" and reply.output[0].type == "message"
    assert reply.status in ("completed", "incomplete")
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.model_extra["macspec"]["spec"]["accepted"] > 0


def test_streamed_text_events_in_reference_order(client):
    with client.responses.stream(model="default", input="def load(", temperature=0,
                                 max_output_tokens=16) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == create(client, input="def load(", max_output_tokens=16).output_text


def _call_then_output(client, use_previous: bool, store: bool = True):
    first = create(client, input="add 2 and 3", tools=TOOLS, max_output_tokens=40,
                   tool_choice={"type": "function", "name": "add"}, store=store)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    if use_previous:
        return first, create(client, input=[result], tools=TOOLS, previous_response_id=first.id)
    history = [{"role": "user", "content": "add 2 and 3"},
               {"type": "function_call", "call_id": call.call_id, "name": "add",
                "arguments": call.arguments}, result]
    return first, create(client, input=history, tools=TOOLS)


def test_function_call_then_its_output_with_and_without_previous_response_id(client):
    first, chained = _call_then_output(client, use_previous=True)
    _, explicit = _call_then_output(client, use_previous=False, store=False)
    assert chained.output_text == explicit.output_text
    assert chained.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens
    assert chained.previous_response_id == first.id


def test_forced_custom_tools_follow_their_grammars(client):
    reply = create(client, input="list files", tools=TOOLS, tool_choice={"type": "custom", "name": "shell"})
    call = reply.output[0]
    assert call.type == "custom_tool_call" and call.name == "shell"
    assert re.fullmatch(SHELL_REGEX, call.input)
    with client.responses.stream(model="default", input="compute", tools=TOOLS, temperature=0,
                                 tool_choice={"type": "custom", "name": "calc"},
                                 max_output_tokens=24) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"][0]
    assert re.fullmatch(r"[0-9]{1,3} [+-] [0-9]{1,3}", done.input) and deltas == done.input
    assert events[-1].response.output[0].input == done.input


def test_json_schema_and_json_object_formats(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SMALL, "strict": True}
    reply = create(client, input="a thing", text={"format": fmt}, max_output_tokens=60)
    jsonschema.validate(json.loads(reply.output_text), SMALL)
    assert reply.output_text == create(client, SPEC_OFF, input="a thing", text={"format": fmt},
                                       max_output_tokens=60).output_text
    reply = create(client, input="x", text={"format": {"type": "json_object"}}, max_output_tokens=200)
    if reply.status == "completed":  # a free object may outgrow the budget
        assert isinstance(json.loads(reply.output_text), dict)


def test_reasoning_items_out_and_back_in(client):
    kw = dict(input="why", max_output_tokens=60, reasoning={"effort": "low"},
              extra_body={"structured_outputs": {"regex": THINKING}})
    reply = create(client, **kw)
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    thought = reply.output[0].content[0].text
    assert thought and "<think>" not in thought and "</think>" not in reply.output_text
    with client.responses.stream(model="default", temperature=0, **kw) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thought
    follow = create(client, input=[{"role": "user", "content": "why"}, reply.output[0].model_dump(),
                                   {"role": "assistant", "content": reply.output_text},
                                   {"role": "user", "content": "and"}])
    assert follow.status in ("completed", "incomplete")


def test_stored_responses_get_delete_and_bounded(client):
    reply = create(client, input="def main(")
    assert client.responses.retrieve(reply.id).output_text == reply.output_text
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    unstored = create(client, input="def run(", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    ids = [create(client, input="x", max_output_tokens=2).id for _ in range(9)]
    with pytest.raises(openai.NotFoundError):  # the store holds 8 (server.responses_store)
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_codex_tools_namespaces_and_hosted_tools_are_served(server, client):
    """Codex sends a `namespace` of client-run functions and hosted tools (web search): the
    namespace's functions reach the model, its calls carry `namespace` back, hosted tools are
    left out with a warning instead of a 400."""
    tools = [{"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [{"type": "function", "name": "add", "parameters": ADD}]},
             {"type": "web_search", "external_web_access": True},
             {"type": "file_search", "vector_store_ids": []}]
    reply = create(client, input="add 2 and 3", tools=tools,
                   tool_choice={"type": "function", "name": "add"})
    call = reply.output[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "add", "agents")
    jsonschema.validate(json.loads(call.arguments), ADD)
    assert "web_search" in " ".join(reply.model_extra["warnings"])
    follow = create(client, tools=tools, input=[
        {"role": "user", "content": "add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "namespace": "agents",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"}])
    assert follow.status in ("completed", "incomplete")


@pytest.mark.parametrize("body, message", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' is not supported"),
    ({"input": 3}, "'input' must be"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
     "not among the tools"),
    ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar",
                                                                         "syntax": "lark",
                                                                         "definition": "start: ("}}],
      "tool_choice": {"type": "custom", "name": "c"}}, "lark is not valid"),
    ({"input": "x", "background": True}, "'background'"),
])
def test_bad_requests_are_400s_naming_the_problem(server, client, body, message):
    reply = requests.post(server.url + "/v1/responses", json={"model": "default", **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert create(client, input="ok", max_output_tokens=2).status  # still serving


def test_a_failed_step_ends_the_stream_with_response_failed(server, client):
    faults.arm("decode", RuntimeError("injected decode failure"), times=1)
    events = _sse(server.url + "/v1/responses", {"model": "default", "input": "def f(", "stream": True,
                                                 "max_output_tokens": 20, "temperature": 0})
    assert events[-1]["type"] == "response.failed", events[-1]
    assert "injected decode failure" in events[-1]["response"]["error"]["message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert create(client, input="ok", max_output_tokens=2).status  # still serving


def test_unknown_previous_response_is_404(client):
    with pytest.raises(openai.NotFoundError):
        create(client, input="x", previous_response_id="resp_missing")


CODEX_INSTRUCTIONS = "You are a coding agent running in a terminal. Use the tools to inspect files."
CODEX_TOOLS = [{"type": "function", "name": "shell", "description": "Runs a shell command",
                "strict": False, "parameters": {
                    "type": "object", "additionalProperties": False, "required": ["command"],
                    "properties": {"command": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 8}}}}},
               {"type": "function", "name": "update_plan", "description": "Updates the plan",
                "strict": False, "parameters": {"type": "object", "properties": {
                    "plan": {"type": "string", "maxLength": 12}}}}]


def test_codex_style_session_replay(server):
    """Codex sends store=false, stream=true, the whole history each turn, and reads the events."""
    history = [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "list the files and count them"}]}]
    cached = []
    for turn in range(3):
        body = {"model": "default", "instructions": CODEX_INSTRUCTIONS, "input": history,
                "tools": CODEX_TOOLS, "tool_choice": "required" if turn < 2 else "auto",
                "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
                "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
                "prompt_cache_key": "session-1", "temperature": 0, "max_output_tokens": 60}
        events = _sse(server.url + "/v1/responses", body)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        cached.append(final["usage"]["input_tokens_details"]["cached_tokens"])
        for item in final["output"]:
            history.append(item)
            if item["type"] == "function_call":
                assert item["name"] in ("shell", "update_plan")
                json.loads(item["arguments"])
                history.append({"type": "function_call_output", "call_id": item["call_id"],
                                "output": json.dumps({"output": "a.py b.py", "exit_code": 0})})
        assert turn == 2 or any(i["type"] == "function_call" for i in final["output"])
    assert cached[1] > 0 and cached[2] > 0  # later turns reuse the earlier ones' KV


def _sse(url: str, body: dict) -> list[dict]:
    events = []
    with requests.post(url, json=body, stream=True, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events
