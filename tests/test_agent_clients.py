"""Codex CLI and Claude Code themselves (the npm packages, pinned) against a real `macspec serve`,
configured exactly as docs/agents.md says: each completes a turn with exit 0, through a tool call
whose result goes back to the model, and the server logs no 4xx or 5xx.

The tiny model neither calls tools nor stops on its own; the profile's [testing] switches
(docs/profiles.md) make it call one of the clients' harmless tools on the user's turn and answer
a tool's result in a short sentence, so the clients' whole loop runs on any CPU in seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from .serverutil import Foreground

pytestmark = pytest.mark.slow  # installs the clients once, starts a server

CLIENTS = {"codex": ("@openai/codex", "0.169.0"), "claude": ("@anthropic-ai/claude-code", "2.1.332")}
CACHE = Path(os.environ.get("MACSPEC_TEST_CACHE", Path.home() / ".cache" / "macspec-tests"))
AGENTS_DOC = Path(__file__).resolve().parent.parent / "docs" / "agents.md"
KEY = "sk-agent-clients"
ANSWER = r"[a-z]{2,8}( [a-z]{2,8}){0,3}\."
PROFILE = f"""
name = "tiny-agent"
[model]
path = "embedded:tiny-target"
[speculative]
method = "draft"
draft_model = "embedded:tiny-draft"
[sampling]
temperature = 0.0
[kv]
max_context = 65536  # Codex's and Claude Code's prompts: 6.6k and 5.9k tiny tokens
[server]
inject_tool_prompt = false  # the call is forced: 11k tokens of tool text would only cost prefill
[testing]
force_tool_call = ["get_goal", "Read"]  # Codex's goal lookup, Claude Code's file read
answer_pattern = {json.dumps(ANSWER)}
"""
ACCESS = re.compile(r"macspec\.access: \S+ (?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) ")


def client_binary(name: str) -> Path:
    """The pinned package, installed once into the cache (a failed install leaves nothing)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the agent-client tests need Node.js and npm")
    package, version = CLIENTS[name]
    home = CACHE / f"{name}-{version}"
    binary = home / "node_modules" / ".bin" / name
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=CACHE))
        subprocess.run(["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                        f"{package}@{version}"], check=True, capture_output=True, timeout=600)
        shutil.rmtree(home, ignore_errors=True)
        staging.rename(home)
    return binary


def doc_block(after: str, language: str) -> str:
    """The first ```language block after the line that starts with `after`."""
    text = AGENTS_DOC.read_text()
    start = text.index(f"```{language}\n", text.index(after)) + len(language) + 4
    return text[start:text.index("```", start)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    profile = root / "tiny-agent.toml"
    profile.write_text(PROFILE)
    env = {**os.environ, "MACSPEC_HOME": str(root / "home"), "MACSPEC_API_KEY": KEY}
    srv = Foreground(root / "home", "--profile", str(profile), "--log-level", "info", env=env)
    yield srv
    srv.proc.terminate()
    srv.wait()


def run_client(command: list[str] | str, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """A client in an empty work dir and home; a string runs as a bash command line."""
    work = tmp_path / "work"
    work.mkdir()
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MACSPEC_API_KEY": KEY}
    argv = ["bash", "-c", command] if isinstance(command, str) else command
    return subprocess.run(argv, cwd=work, env={**base, **env}, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)


def assert_clean_log(server) -> list[tuple[str, str]]:
    """Every request the clients made was answered below 400; -> [(method, path), ...]."""
    lines = [m for m in map(ACCESS.search, server.log.read_text().splitlines()) if m]
    assert all(int(m["status"]) < 400 for m in lines), [m.group(0) for m in lines]
    return [(m["method"], m["path"]) for m in lines]


def test_codex_exec_completes_a_turn_through_a_tool_call(server, tmp_path):
    codex = client_binary("codex")
    config = doc_block("Codex CLI speaks only the Responses API", "toml")
    (tmp_path / "codex").mkdir()
    (tmp_path / "codex" / "config.toml").write_text(config.replace("127.0.0.1:8000", server.url[7:]))
    done = run_client([str(codex), "exec", "--json", "--skip-git-repo-check", "Say hi."],
                      {"CODEX_HOME": str(tmp_path / "codex")}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    answers = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
    # The answer follows a tool's result (answer_pattern binds only such a turn): the call ran.
    assert answers and re.fullmatch(ANSWER, answers[-1]), events
    assert any(e["type"] == "turn.completed" for e in events)
    assert assert_clean_log(server).count(("POST", "/v1/responses")) >= 2


def test_claude_code_print_completes_a_turn_through_a_tool_call(server, tmp_path):
    claude = client_binary("claude")
    line = doc_block("Claude Code speaks the Messages API", "bash").replace("\\\n", " ").strip()
    assert line.endswith(" claude"), line  # the page's command line, run as it is written
    line = line.replace("127.0.0.1:8000", server.url[7:]).removesuffix("claude")
    done = run_client(line + f"{shlex.quote(str(claude))} -p 'Say hi.' --output-format json",
                      {}, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert not result["is_error"] and result["num_turns"] == 2, result
    assert re.fullmatch(ANSWER, result["result"]), result
    assert assert_clean_log(server).count(("POST", "/v1/messages")) >= 2
