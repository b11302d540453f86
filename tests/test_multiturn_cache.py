"""A 6-turn conversation through each API: from turn 2 on the prefix cache serves all but the new
message (reported where clients read it), and the answers equal those with the cache off."""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # starts servers

TURNS = ["def parse(", "and load", "now main", "run it", "emit all", "read back"]
SLACK = 16  # template tokens around the new message (role markers, generation prompt)


def _servers():
    on = runtime_with("tiny", server__reasoning_parser="think")
    off = runtime_with("tiny", server__reasoning_parser="think", kv__prefix_cache_mb=0)
    return RunningServer(on, max_batch=2), RunningServer(off, max_batch=2)


@pytest.fixture(scope="module")
def servers():
    on, off = _servers()
    with on, off:
        yield on, off


def _chat(url: str):
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages, out = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                               max_tokens=12)
        answer = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        out.append((answer, reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
    return out


def _messages(url: str):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages, out = [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        reply = client.messages.create(model="default", messages=messages, max_tokens=12,
                                        extra_body={"temperature": 0})
        answer = "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": answer})
        usage = reply.usage
        out.append((answer, usage.input_tokens + usage.cache_read_input_tokens, usage.cache_read_input_tokens))
    return out


def _responses(url: str):
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    previous, out = None, []
    for text in TURNS:
        reply = client.responses.create(model="default", input=text, temperature=0,
                                        max_output_tokens=12, previous_response_id=previous)
        previous = reply.id
        usage = reply.usage
        out.append((reply.output_text, usage.input_tokens, usage.input_tokens_details.cached_tokens))
    return out


@pytest.mark.parametrize("conversation", [_chat, _messages, _responses], ids=["chat", "messages", "responses"])
def test_six_turns_reuse_all_but_the_new_message(servers, conversation):
    on, off = servers
    cached_run = conversation(on.url)
    cold_run = conversation(off.url)
    tokenizer = on.runtime.tokenizer
    for turn, ((answer, prompt, cached), (cold_answer, cold_prompt, cold_cached)) in enumerate(zip(cached_run, cold_run)):
        assert answer == cold_answer and prompt == cold_prompt and cold_cached == 0
        if turn:
            new = len(tokenizer.encode(TURNS[turn], add_special_tokens=False))
            assert cached >= prompt - new - SLACK, (turn, prompt, cached)
