"""`model` names: "default", profile aliases, 404 for the rest, or any name when a profile says so.
Whatever was asked, the response's `model` names what was served."""

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
    with RunningServer(runtime_with("tiny", server__model_aliases=ALIASES)) as srv:
        yield srv


def _clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0))


def test_default_and_aliases_are_served_under_the_served_name(aliased):
    oai, ant = _clients(aliased)
    for name in ["default", "tiny", SERVED, *ALIASES]:
        chat = oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert chat.model == SERVED, name
        text = oai.completions.create(model=name, prompt="x", max_tokens=2)
        assert text.model == SERVED, name
        msg = ant.messages.create(model=name, max_tokens=2, messages=MESSAGES)
        assert msg.model == SERVED, name
    chunks = list(oai.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2,
                                              stream=True))
    assert chunks and all(c.model == SERVED for c in chunks)


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


def test_accept_any_model_serves_every_name():
    with RunningServer(runtime_with("tiny", server__accept_any_model=True)) as srv:
        oai, ant = _clients(srv)
        for name in ("gpt-4o", "default", "anything/at-all"):
            chat = oai.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
            assert chat.model == SERVED
        msg = ant.messages.create(model="claude-opus-4-1", max_tokens=2, messages=MESSAGES)
        assert msg.model == SERVED
        with pytest.raises(openai.BadRequestError):  # still a string
            oai.chat.completions.create(model=5, messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize("key,value", [
    ("model_aliases", "gpt-4o"), ("model_aliases", [""]), ("model_aliases", [3]),
    ("accept_any_model", "yes"), ("allowed_hosts", "example.com"), ("allowed_hosts", [""]),
    ("max_connections", 0), ("max_connections", 1.5), ("idle_timeout_s", 0),
    ("body_timeout_s", -1),
])
def test_server_keys_are_validated(key, value):
    profile = load_profile("tiny")
    with pytest.raises(ProfileError, match=f"server.{key}"):
        profile.override(f"server.{key}", value, "test")


def test_server_key_defaults():
    server = load_profile("tiny").server
    assert server.model_aliases == [] and server.accept_any_model is False
    assert server.allowed_hosts == [] and server.max_connections is None
    assert server.idle_timeout_s > 0 and server.body_timeout_s > 0
