"""Agent clients' failures: strict JSON-schema grammars, forced calls cut off by max_tokens, and
tools described in the prompt for a chat template that ignores them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from macspec.config import Profile
from macspec.grammar import GrammarCompiler, strict_schema
from macspec.models.store import embedded_dir
from macspec.server.output import ChatOutput, collect
from macspec.server.state import ServerState
from macspec.server.structured import plan_openai
from macspec.server.tool_prompt import TemplateTools, probe_template, tools_block, with_tool_prompt
from macspec.server.toolcalls import cut_forced_call, parse_complete

TINY = embedded_dir() / "tiny-target"
CITY = {"type": "object", "required": ["name"],
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}}}}]
# SmolLM2-135M-Instruct's template: no tools section, assistant tool_calls dropped.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
# A template that renders tools and calls itself.
USES_TOOLS = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
              "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
              "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
              "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma-2-like: no system role, roles must alternate, no tools.
ALTERNATING = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
               "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
               "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
               "alternate') }}{% endif %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}"
               "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
               "{% endif %}")
LOOP = [{"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"name": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "and tomorrow?"}]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(TINY)


def hf_tokenizer(template: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY), chat_template=template)


def state_for(tokenizer, **server) -> ServerState:
    """A ServerState over a tokenizer alone: rendering needs no engine."""
    profile = Profile()
    for key, value in server.items():
        profile.override(f"server.{key}", value, "test")
    runtime = SimpleNamespace(tokenizer=tokenizer, vocab_size=4096)
    return ServerState(SimpleNamespace(runtime=runtime), profile)


# -- 1. strict JSON-schema grammars --------------------------------------------------------------

def accepts(compiler: GrammarCompiler, schema: dict, text: str) -> bool:
    constraint = compiler.constraint(compiler.compile("json_schema", schema))
    ids = compiler.tokenizer.tokenize_str(text)
    return constraint.matcher.try_consume_tokens(ids) == len(ids) and constraint.matcher.is_accepting()


def test_an_object_schema_refuses_keys_it_does_not_name_unless_lenient(tiny_tokenizer):
    strict = GrammarCompiler(tiny_tokenizer, 4096)
    lenient = GrammarCompiler(tiny_tokenizer, 4096, strict=False)
    extra = '{"name":"New York","country":"USA"}'
    assert accepts(strict, CITY, '{"name":"New York","population":1}')
    assert not accepts(strict, CITY, extra)
    assert accepts(lenient, CITY, extra)
    # A named call's arguments and a required call's {"name", "arguments"} are strict too.
    for value in ({"name": "x"}, {"name": "x", "country": "y"}):
        named = plan_openai({"tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "get_weather"}}}).grammar[1]
        required = plan_openai({"tools": TOOLS, "tool_choice": "required"}).grammar[1]
        call = json.dumps({"name": "get_weather", "arguments": value}, separators=(",", ":"))
        ok = "country" not in value
        assert accepts(strict, named, json.dumps(value, separators=(",", ":"))) == ok
        assert accepts(strict, required, call) == ok


def test_strict_schema_closes_nested_objects_and_leaves_open_ones_alone():
    schema = {"type": "object", "properties": {
        "city": {"$ref": "#/$defs/City"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
        "any": {"type": "object"},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]},
        "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True}},
        "$defs": {"City": {"type": "object", "properties": {"name": {}}}},
        "allOf": [{"properties": {"x": {}}}]}
    out = strict_schema(schema)
    props = out["properties"]
    assert out["$defs"]["City"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["any"]  # names no properties: any object
    assert props["open"]["additionalProperties"] is True
    # allOf parts stay open (closing each would refuse the other parts' keys)
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]
    assert "additionalProperties" not in schema["$defs"]["City"]  # the request's schema is untouched


# -- 2. forced calls cut off by max_tokens -------------------------------------------------------

def forced(body: dict, text: str):
    output = ChatOutput(plan_openai({"tools": TOOLS, **body}), "json", False, False)
    return collect(output.feed(text) + output.finish())


@pytest.mark.parametrize("text, name, arguments", [
    ('{"name":"get_weather","arguments":{"name":"Par', "get_weather", '{"name":"Par'),
    ('{"name":"add","argu', "add", ""),
    ('{"name":"g', "get_weather", ""),  # only one tool starts so
    ('{"name":"add","arguments":{"a":1}', "add", '{"a":1}'),
])
def test_a_cut_required_call_is_still_a_call_with_its_arguments_so_far(text, name, arguments):
    got = forced({"tool_choice": "required"}, text)
    assert got.content == "" and [(c.name, c.arguments) for c in got.calls] == [(name, arguments)]


def test_a_required_call_cut_before_its_name_is_decided_is_text():
    tools = [*TOOLS, {"type": "function", "function": {"name": "adder", "parameters": {}}}]
    assert cut_forced_call('{"name":"ad', ["add", "adder"]) is None
    got = collect(ChatOutput(plan_openai({"tools": tools, "tool_choice": "required"}), "json",
                             False, False).feed('{"name":"ad'))
    assert not got.calls


def test_a_cut_named_call_keeps_its_arguments_so_far():
    got = forced({"tool_choice": {"type": "function", "function": {"name": "add"}}}, '{"a":12')
    assert [(c.name, c.arguments) for c in got.calls] == [("add", '{"a":12')]


# -- 3. tools described in the prompt for a template that ignores them ----------------------------

def test_the_probe_tells_templates_that_ignore_tools(tiny_tokenizer):
    assert probe_template(hf_tokenizer(USES_TOOLS)) == TemplateTools()
    assert probe_template(tiny_tokenizer) == TemplateTools(True, renders_calls=False)
    assert probe_template(hf_tokenizer(SMOLLM2)) == TemplateTools(True, renders_calls=False)
    assert probe_template(hf_tokenizer(ALTERNATING)) == TemplateTools(
        True, renders_calls=False, renders_tool_role=False, renders_system=False)


def test_a_template_that_ignores_tools_gets_qwen_style_tools_calls_and_results():
    tokenizer = hf_tokenizer(SMOLLM2)
    state = state_for(tokenizer)
    ids, _ = state.render_chat(LOOP, TOOLS)
    text = tokenizer.decode(ids)
    block = tools_block(TOOLS)
    assert text.startswith(f"<|im_start|>system\n{block}<|im_end|>\n")  # replaces the default
    assert block.startswith("# Tools\n\nYou may call one or more functions") and \
        f"<tools>\n{json.dumps(TOOLS[0])}\n{json.dumps(TOOLS[1])}\n</tools>" in block
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"name": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\nsunny<|im_end|>" in text
    assert state.tool_format == "json"
    # what the block teaches is what the parser reads
    content, calls = parse_complete(state.tool_format, call, TOOLS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"name": "Paris"})]
    # an existing system message keeps its text first; no tools, no block
    system = [{"role": "system", "content": "Be brief."}, LOOP[0]]
    assert tokenizer.decode(state.render_chat(system, TOOLS)[0]).startswith(
        f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>")
    no_tools = tokenizer.decode(state.render_chat(LOOP)[0])  # no block; the call still shows
    assert "# Tools" not in no_tools and call in no_tools
    off = state_for(tokenizer, inject_tool_prompt=False)
    assert "# Tools" not in tokenizer.decode(off.render_chat(LOOP, TOOLS)[0])


def test_results_become_user_tool_responses_where_the_template_refuses_the_tool_role():
    support = TemplateTools(True, renders_calls=False, renders_tool_role=False, renders_system=False)
    messages = with_tool_prompt([*LOOP[:3], LOOP[2], LOOP[3]], TOOLS, support)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == tools_block(TOOLS) + "\n\nweather in Paris?"
    assert messages[2]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                      "<tool_response>\nsunny\n</tool_response>\nand tomorrow?")
    state = state_for(hf_tokenizer(ALTERNATING))
    state.render_chat(LOOP, TOOLS)  # renders (before: roles must alternate)


def test_a_template_that_renders_tools_renders_exactly_as_before():
    tokenizer = hf_tokenizer(USES_TOOLS)
    state = state_for(tokenizer)
    ids, _ = state.render_chat(LOOP, TOOLS)
    text = tokenizer.apply_chat_template(LOOP, tools=TOOLS, add_generation_prompt=True,
                                         tokenize=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert "You may call" not in text


# -- through a real server (the tiny model's template ignores tools) ------------------------------

@pytest.fixture(scope="module")
def server():
    from .serverutil import RunningServer, runtime_with

    with RunningServer(runtime_with("tiny"), max_batch=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    import anthropic
    from openai import OpenAI

    return (OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0),
            anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0))


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "weather?"}])
    return client.chat.completions.create(model="default", temperature=0, **kw)


@pytest.mark.slow
def test_server_strict_schema_tools_block_and_cut_calls(clients):
    client, claude = clients
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "boolean"}}}}}
    reply = chat(client, response_format=fmt, max_tokens=30).choices[0]
    assert reply.message.content in ('{"a":true}', '{"a":false}') and reply.finish_reason == "stop"
    # the tools and the earlier call reach the prompt (the tiny template drops both)
    bare = chat(client, max_tokens=1).usage.prompt_tokens
    assert chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens > bare + 50
    called = chat(client, messages=LOOP[:2], max_tokens=1).usage.prompt_tokens
    assert called > chat(client, messages=[LOOP[0], {"role": "assistant", "content": ""}],
                         max_tokens=1).usage.prompt_tokens + 10
    # a forced call cut by max_tokens is a call, and says it was cut
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=12).choices[0]
        (call,) = reply.message.tool_calls
        assert reply.finish_reason == "length" and call.function.name in ("get_weather", "add")
    message = claude.messages.create(
        model="default", max_tokens=12, messages=[{"role": "user", "content": "weather?"}],
        tools=[{"name": "get_weather", "input_schema": CITY}], tool_choice={"type": "any"})
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["tool_use"]
    response = client.responses.create(model="default", input="weather?", max_output_tokens=12,
                                       tools=[{"type": "function", "name": "get_weather",
                                               "parameters": CITY}], tool_choice="required")
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["function_call"]
