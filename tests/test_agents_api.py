"""What agents send, through `macspec serve` with speculation on, driven by the real `openai`
and `anthropic` clients: structured output, forced and parsed tool calls, reasoning, logprobs,
n > 1. Greedy results must equal the same request with speculation off."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # starts a server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["a", "bc", "def"]}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
SPEC_ON = {"method": "draft", "num_draft_tokens": 4, "adaptive": False}
SPEC_OFF = {"method": "none"}
PROMPTS = [f"def {word}(" for word in ("parse", "load", "main", "run", "emit", "read", "walk",
                                        "split", "join", "scan", "find", "keys", "sort", "open",
                                        "send", "wait", "pack", "copy", "hash", "test")]


@pytest.fixture(scope="module")
def server():
    runtime = runtime_with("tiny", server__reasoning_parser="think")
    with RunningServer(runtime, max_batch=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, prompt, spec, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], temperature=0,
        extra_body={"speculative": spec, **kw.pop("extra_body", {})}, **kw)


def test_json_schema_output_validates_and_equals_speculation_off(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    off = [chat(client, p, SPEC_OFF, response_format=fmt) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:  # with speculation on, 4 at a time share the batch
        on = list(pool.map(lambda p: chat(client, p, SPEC_ON, response_format=fmt), PROMPTS))
    accepted = 0
    for prompt, a, b in zip(PROMPTS, on, off):
        text = a.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        assert a.choices[0].finish_reason == "stop"
        assert text == b.choices[0].message.content, prompt
        accepted += a.model_extra["macspec"]["spec"]["accepted"]
    assert accepted > 0, "speculation never paid under the grammar: the test proves nothing"


def test_json_object_and_regex_outputs(client):
    reply = chat(client, "x", SPEC_ON, response_format={"type": "json_object"}, max_tokens=200)
    if reply.choices[0].finish_reason == "stop":  # a free object may outgrow max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    reply = chat(client, "x", SPEC_ON, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", reply.choices[0].message.content)
    reply = chat(client, "x", SPEC_ON, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_a_valid_call(client, stream):
    kw = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if not stream:
        choice = chat(client, "weather in Paris?", SPEC_ON, **kw).choices[0]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        calls, finish = {}, None
        for chunk in chat(client, "weather in Paris?", SPEC_ON, stream=True, **kw):
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or delta.id
                entry["name"] = entry["name"] or delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        calls = [type("Call", (), {"id": c["id"], "function": type("F", (), c)}) for c in calls.values()]
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_tool_choice_required_picks_one_of_the_tools(client):
    choice = chat(client, "add 2 and 3", SPEC_ON, tools=TOOLS, tool_choice="required").choices[0]
    (call,) = choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# The tiny model's template is not Kimi's or GLM's, so "auto" parses the generic JSON syntax;
# a regex makes the model write it (the parser then sees real model output through the server).
WELL_FORMED = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "days": [1-7]\}\}</tool_call>'
MALFORMED = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": [a-z]{2,5}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_from_the_model_syntax(client, stream):
    kw = dict(tools=TOOLS, extra_body={"structured_outputs": {"regex": WELL_FORMED}})
    if stream:
        chunks = list(chat(client, "weather?", SPEC_ON, stream=True, **kw))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        name, arguments = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)
    else:
        choice = chat(client, "weather?", SPEC_ON, **kw).choices[0]
        (call,) = choice.message.tool_calls
        content, finish = choice.message.content or "", choice.finish_reason
        name, arguments = call.function.name, call.function.arguments
    assert (name, finish, content) == ("get_weather", "tool_calls", "")
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_a_malformed_call_from_the_model_is_text(client):
    reply = chat(client, "weather?", SPEC_ON, tools=TOOLS,
                 extra_body={"structured_outputs": {"regex": MALFORMED}})
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith('<tool_call>{"name": "get_weather"')


THINKING = r"<think>[a-z ]{4,30}</think>[a-z]{2,12}"


def test_reasoning_is_split_from_the_answer(client):
    message = chat(client, "x", SPEC_ON, extra_body={"structured_outputs": {"regex": THINKING}}).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in message.content
    chunks = list(chat(client, "x", SPEC_ON, stream=True, extra_body={"structured_outputs": {"regex": THINKING}}))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert streamed == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content


def test_logprobs_of_accepted_drafts_equal_plain_decoding(client):
    checked = accepted = 0
    for prompt in PROMPTS[:6]:
        on, off = (chat(client, prompt, spec, max_tokens=40, logprobs=True, top_logprobs=3)
                   for spec in (SPEC_ON, SPEC_OFF))
        a, b = on.choices[0].logprobs.content, off.choices[0].logprobs.content
        assert [e.token for e in a] == [e.token for e in b]
        for x, y in zip(a, b):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
            assert x.logprob == max(t.logprob for t in x.top_logprobs)  # greedy took the best
        checked += len(a)
        accepted += on.model_extra["macspec"]["spec"]["accepted"]
    assert checked > 100 and accepted > 20


def reused_tokens(server) -> int:
    import requests

    status = requests.get(server.url + "/v1/status", timeout=30).json()
    return status["engine"]["prefix_cache"]["reused_tokens"]


def test_n_choices_sample_independently(client, server):
    before = reused_tokens(server)
    content = "def n_choices(" + ", ".join(f"arg{i}" for i in range(30)) + "):"
    reply = client.chat.completions.create(model="default", n=3, temperature=0.8, max_tokens=24,
                                           messages=[{"role": "user", "content": content}])
    # Choices 2 and 3 start from choice 1's prompt KV (all but the last prompt token).
    assert reused_tokens(server) - before >= 2 * (reply.usage.prompt_tokens - 1)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert 24 < reply.usage.completion_tokens <= 3 * 24  # summed over the choices
    seen = set()
    for chunk in client.chat.completions.create(model="default", n=3, temperature=0.8, max_tokens=8,
                                                stream=True, messages=[{"role": "user", "content": "x"}]):
        seen |= {c.index for c in chunk.choices}
    assert seen == {0, 1, 2}


def test_completions_logprobs_and_penalties(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="default", prompt="def f(", max_tokens=10, temperature=0,
                                      logprobs=2, presence_penalty=1.5, frequency_penalty=1.0,
                                      logit_bias={"94": 8})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 10
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset[1] == len(logprobs.tokens[0])
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


# ---- Anthropic --------------------------------------------------------------------------
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": "d",
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_anthropic_forced_tool_use(claude):
    kw = dict(model="default", max_tokens=80, tools=ANTHROPIC_TOOLS,
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "weather?"}], extra_body={"temperature": 0})
    message = claude.messages.create(**kw)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)
    with claude.messages.stream(**kw) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(kinds) == {"input_json_delta"}
    assert final.content[0].input == block.input and final.stop_reason == "tool_use"


def test_anthropic_thinking_blocks_and_tool_results(claude):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "days": 2}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": "sunny"}]}]
    kw = dict(model="default", max_tokens=60, messages=messages, tools=ANTHROPIC_TOOLS,
              extra_body={"temperature": 0, "structured_outputs": {"regex": THINKING}})
    message = claude.messages.create(**kw)
    assert [b.type for b in message.content] == ["thinking", "text"]
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == message.content[0].thinking
    counted = claude.messages.count_tokens(model="default", messages=messages, tools=ANTHROPIC_TOOLS)
    usage = message.usage  # a prefix-cache hit is counted apart, as Anthropic does
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 10
