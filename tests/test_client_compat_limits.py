"""What agent CLIs (Claude Code, Codex) send and act on: output limits, context-overflow errors in
each API's own words, and the Anthropic fields Claude Code sends by default."""

from __future__ import annotations

import contextlib
import json

import anthropic
import openai
import pytest
import requests

from macspec.config import profile_from_dict
from macspec.errors import ProfileError
from macspec.server.respond import leading_system

from .serverutil import RunningServer, runtime_with

CONTEXT = 256
CAP = 200  # server.max_output_tokens, below what a short prompt leaves
USER = [{"role": "user", "content": "def f():"}]


@pytest.fixture(scope="module")
def server():
    runtime = runtime_with("tiny", kv__max_context=CONTEXT, server__max_output_tokens=CAP)
    with RunningServer(runtime) as srv:
        yield srv


@pytest.fixture(scope="module")
def clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120))


@contextlib.contextmanager
def clamp_off(server):
    profile = server.runtime.profile  # the live server's profile: read per request
    profile.server.clamp_max_tokens = False
    try:
        yield
    finally:
        profile.server.clamp_max_tokens = True


def _long_messages(tokens: int) -> list[dict]:
    return [{"role": "user", "content": "x = 1\n" * tokens}]


@pytest.mark.slow
def test_no_limit_generates_up_to_the_cap_or_the_context_left(clients):
    oai, _ = clients
    short = oai.completions.create(model="m", prompt=[5] * 10, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == CAP and short.choices[0].finish_reason == "length"
    long = oai.completions.create(model="m", prompt=[5] * 100, extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == CONTEXT - 100
    chat = oai.chat.completions.create(model="m", messages=USER, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == CAP  # was sampling.max_tokens (128 in tiny)
    codex = oai.responses.create(model="m", input="def f():", extra_body={"ignore_eos": True})
    assert codex.usage.output_tokens == CAP and codex.status == "incomplete"


@pytest.mark.slow
def test_a_prompt_past_the_context_is_an_error_each_client_acts_on(clients, server):
    oai, ant = clients
    body = {"model": "claude-opus-4-8[1m]", "max_tokens": 32000, "messages": _long_messages(300)}
    n = requests.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(**body)
    assert err.value.body["error"] == {"type": "invalid_request_error",
                                       "message": f"prompt is too long: {n} tokens > {CONTEXT} maximum"}
    for call in (lambda: oai.chat.completions.create(model="m", messages=_long_messages(300)),
                 lambda: oai.responses.create(model="m", input="x = 1\n" * 300)):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        error = err.value.body
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. "
                                            "However, your messages resulted in ")


@pytest.mark.slow
def test_max_tokens_past_the_context_is_clamped_or_refused(clients, server):
    oai, ant = clients
    # Claude Code's default max_tokens against a small context: the turn completes.
    msg = ant.messages.create(model="claude-haiku-4-5", max_tokens=32000, messages=USER,
                              extra_body={"ignore_eos": True})
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt + msg.usage.output_tokens == CONTEXT and msg.stop_reason == "max_tokens"
    with clamp_off(server):
        with pytest.raises(anthropic.BadRequestError) as err:
            ant.messages.create(model="m", max_tokens=32000, messages=USER)
        assert err.value.body["error"]["message"] == (
            f"input length and `max_tokens` exceed context limit: {prompt} + 32000 > {CONTEXT}, "
            "decrease input length or `max_tokens` and try again")
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="m", messages=USER, max_tokens=32000)
        assert err.value.body["code"] == "context_length_exceeded"
        assert err.value.body["param"] == "max_tokens"


CLAUDE_CODE_BODY = {
    "model": "claude-opus-4-8[1m]", "max_tokens": 32000, "stream": False,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "def f():", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "pass"},
        {"role": "system", "content": "The user switched to plan mode."},
        {"role": "user", "content": "continue"},
    ],
    "tools": [{"name": "Read", "description": "read a file", "cache_control": {"type": "ephemeral"},
               "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
              {"type": "bash_20250124", "name": "bash"}],
    "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "u"}, "service_tier": "auto", "container": None, "mcp_servers": [],
}


@pytest.mark.slow
def test_what_claude_code_sends_by_default_is_served(server):
    reply = requests.post(server.url + "/v1/messages", json=CLAUDE_CODE_BODY, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "claude-opus-4-8[1m]"
    count = lambda body: requests.post(server.url + "/v1/messages/count_tokens", json=body,  # noqa: E731
                                       timeout=60).json()["input_tokens"]
    without = {**CLAUDE_CODE_BODY, "messages": [m for m in CLAUDE_CODE_BODY["messages"] if m["role"] != "system"]}
    assert count(CLAUDE_CODE_BODY) > count(without)  # the system message reached the prompt


@pytest.mark.slow
def test_output_config_format_constrains_the_output(clients):
    _, ant = clients
    schema = {"type": "string", "enum": ["yes", "no"]}
    msg = ant.messages.create(model="m", max_tokens=16, messages=USER,
                              extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert json.loads(msg.content[0].text) in ("yes", "no")


@pytest.mark.slow
@pytest.mark.parametrize("extra,text", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "reads text only"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "MCP"),
    ({"output_config": {"effort": 5}}, "effort"),
    ({"output_config": {"format": {"type": "json_schema"}}, }, "output_config.format"),
])
def test_what_cannot_be_served_is_a_clear_400(server, extra, text):
    body = {"model": "m", "max_tokens": 4, "messages": USER, **extra}
    reply = requests.post(server.url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400 and text in reply.json()["error"]["message"], reply.text


def test_system_messages_merge_into_one_leading_one_for_strict_templates():
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "u"},
                {"role": "system", "content": "b"}, {"role": "assistant", "content": "v"}]
    assert leading_system(messages) == [{"role": "system", "content": "a\n\nb"},
                                        {"role": "user", "content": "u"},
                                        {"role": "assistant", "content": "v"}]


def test_the_old_accept_any_model_key_is_explained():
    with pytest.raises(ProfileError, match="server.accept_any_model.*strict_model_names"):
        profile_from_dict({"server": {"accept_any_model": True}}, "old.toml")


@pytest.mark.slow
def test_tools_too_long_for_the_context_are_left_out_of_the_prompt(clients, caplog):
    """The tiny template ignores tools, so they are written into the prompt; where that alone
    overflows the context the request is served without them (Codex on SmolLM2), not refused."""
    oai, _ = clients
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "word " * 20,
                                               "parameters": {"type": "object"}}} for i in range(4)]
    reply = oai.chat.completions.create(model="m", messages=USER, tools=tools, max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.prompt_tokens < CONTEXT
    assert any("served without them" in r.getMessage() for r in caplog.records)
    flat = [{"type": "function", **tool["function"]} for tool in tools]
    response = oai.responses.create(model="m", input="def f():", tools=flat, max_output_tokens=4)
    assert "left out" in " ".join(response.model_extra["warnings"])  # the Responses API says so
