"""`model` names: any name is served and echoed by default; with server.strict_model_names,
"default" and profile aliases, 404 for the rest."""

from __future__ import annotations

import anthropic
import openai
import pytest

from macspec.config import load_profile
from macspec.errors import ProfileError

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

SERVED = "embedded:tiny-target"
ALIASES = ["gpt-4o", "claude-local"]
MESSAGES = [{"role": "user", "content": "def f():"}]


@pytest.fixture(scope="module")
def aliased():
    with RunningServer(runtime_with("tiny", server__model_aliases=ALIASES,
                                    server__strict_model_names=True)) as srv:
        yield srv


def _clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0))


def test_default_and_aliases_are_served_and_echoed(aliased):
    oai, ant = _clients(aliased)
    for name in ["default", "tiny", SERVED, *ALIASES]:
        echoed = SERVED if name == "default" else name
        chat = oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert chat.model == echoed, name
        text = oai.completions.create(model=name, prompt="x", max_tokens=2)
        assert text.model == echoed, name
        msg = ant.messages.create(model=name, max_tokens=2, messages=MESSAGES)
        assert msg.model == echoed, name
    chunks = list(oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2,
                                              stream=True))
    assert chunks and all(c.model == "gpt-4o" for c in chunks)


def test_unknown_model_is_404_naming_what_is_served(aliased):
    oai, ant = _clients(aliased)
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, max_tokens=2)
    message = err.value.body["message"]
    assert "gpt-4o-mini" in message and "gpt-4o" in message and "default" in message
    with pytest.raises(anthropic.NotFoundError) as err:
        ant.messages.create(model="claude-opus-4", max_tokens=2, messages=MESSAGES)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_models_lists_the_aliases(aliased):
    oai, _ = _clients(aliased)
    ids = [m.id for m in oai.models.list().data]
    assert ids[0] == SERVED and set(ALIASES) <= set(ids) and "tiny" in ids
    assert len(ids) == len(set(ids))


def test_any_model_name_is_served_and_echoed_by_default():
    with RunningServer(runtime_with("tiny")) as srv:
        oai, ant = _clients(srv)
        for name in ("gpt-4o", "anything/at-all"):
            chat = oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
            assert chat.model == name
        assert oai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2).model == SERVED
        # What Claude Code asks for: its main model and its small one.
        for name in ("claude-opus-4-8[1m]", "claude-haiku-4-5"):
            assert ant.messages.create(model=name, max_tokens=2, messages=MESSAGES).model == name
        assert oai.responses.create(model="gpt-5-codex", input="x", max_output_tokens=2).model == "gpt-5-codex"
        with pytest.raises(openai.BadRequestError):  # still a string
            oai.chat.completions.create(model=5, messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("key,value", [
    ("model_aliases", "gpt-4o"), ("model_aliases", [""]), ("model_aliases", [3]),
    ("strict_model_names", "yes"), ("allowed_hosts", "example.com"), ("allowed_hosts", [""]),
    ("max_connections", 0), ("max_connections", 1.5), ("idle_timeout_s", 0),
    ("body_timeout_s", -1),
])
def test_server_keys_are_validated(key, value):
    profile = load_profile("tiny")
    with pytest.raises(ProfileError, match=f"server.{key}"):
        profile.override(f"server.{key}", value, "test")


def test_server_key_defaults():
    server = load_profile("tiny").server
    assert server.model_aliases == [] and server.strict_model_names is False
    assert server.allowed_hosts == [] and server.max_connections is None
    assert server.idle_timeout_s > 0 and server.body_timeout_s > 0
