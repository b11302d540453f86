"""The README's quick starts, run as written: `macspec run` prints a stats line shaped like the
one the README explains; `macspec serve` answers the README's curl command and its openai and
anthropic snippets (only the address changes: a free port instead of 8000). Quick start 3
(pull, import) needs the network or a GGUF file, so its commands are only parsed by the CLI."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from .serverutil import Foreground

README = Path(__file__).resolve().parent.parent / "README.md"
ADDRESS = "127.0.0.1:8000"  # what the README's clients talk to
# The fields "Reading the stats line" explains; the BLAS kernels' name is absent on macOS.
STATS = re.compile(r"prompt \d+ tok \| TTFT [\d.]+ ms \| decode [\d.]+ tok/s \((?P<n>\d+) tok\) \| "
                   r"method \S+ k<=\d+ \(mean [\d.]+\) \| acceptance [\d.]+ \| [\d.]+ tok/forward \| "
                   r"speculation [^|]+ \| BLAS \S+( \S+)?")


def section(title: str) -> str:
    """The README's text under the `## title…` heading, up to the next `## `."""
    text = README.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def console_commands(text: str) -> list[list[str]]:
    """argv of every `$ macspec …` line in the section's console blocks (comments dropped)."""
    lines = [line[2:] for block in blocks(text, "console") for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("macspec ")]


def block_with(text: str, language: str, needle: str) -> str:
    found = [block for block in blocks(text, language) if needle in block]
    assert len(found) == 1, f"expected one ```{language} block with {needle!r}: {found}"
    return found[0]


def serve_argv() -> list[str]:
    """The quick start's own serve command, e.g. ["macspec", "serve"]."""
    line = block_with(section("Quick start 2"), "bash", "macspec serve").strip()
    return shlex.split(line, comments=True)


def client_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MACSPEC_API_KEY"}  # the README's keyless server
    proxyless = "127.0.0.1,localhost"
    return {**env, "MACSPEC_HOME": str(home), "HF_HUB_OFFLINE": "1", "NO_PROXY": proxyless,
            "no_proxy": proxyless}


def parse_cli(argv: list[str]) -> None:
    """Parse argv as the CLI would, without running the command (click's own validation)."""
    from macspec.cli import main

    assert argv[0] == "macspec", argv
    parent = click.Context(main, info_name="macspec")
    command = main.get_command(parent, argv[1])
    assert command is not None, f"no command {argv[1]!r}"
    command.make_context(argv[1], argv[2:], parent=parent).close()


def test_the_quick_start_commands_parse(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `import model.Q4_0.gguf` needs the file to exist
    commands = [*console_commands(section("Quick start 1")), serve_argv(),
                *console_commands(section("Quick start 3"))]
    for argv in commands:
        for arg in argv:
            if arg.endswith(".gguf"):
                (tmp_path / arg).touch()
    assert [argv[1] for argv in commands] == ["run", "serve", "pull", "run", "import", "run"]
    for argv in commands:
        try:
            parse_cli(argv)
        except click.ClickException as err:
            pytest.fail(f"{shlex.join(argv)}: {err.format_message()}")


def test_the_readme_stats_line_has_the_fields_it_explains():
    block = blocks(section("Quick start 1"), "console")[0]
    assert STATS.search(block), block


@pytest.mark.slow
def test_the_run_quick_start_prints_text_and_a_stats_line(tmp_path):
    [argv] = console_commands(section("Quick start 1"))
    max_tokens = int(argv[argv.index("--max-tokens") + 1])
    macspec = Path(sys.executable).with_name("macspec")
    command = [str(macspec)] if macspec.exists() else [sys.executable, "-m", "macspec"]
    done = subprocess.run(command + argv[1:], env=client_env(tmp_path / "home"), cwd=tmp_path,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), done.stdout
    stats = STATS.search(done.stderr.splitlines()[-1])
    assert stats, done.stderr
    assert 0 < int(stats["n"]) <= max_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart")
    argv = serve_argv()
    assert argv[:2] == ["macspec", "serve"], argv
    srv = Foreground(root / "home", *argv[2:], env=client_env(root / "home"))
    assert srv.record["profile"] == "tiny", srv.record  # the README's default profile
    yield srv
    srv.proc.terminate()
    assert srv.wait() == 0


def run_here(argv: list[str], server, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=client_env(server.home), cwd=tmp_path, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300)


def at(server, code: str) -> str:
    assert ADDRESS in code, code
    return code.replace(ADDRESS, server.url.removeprefix("http://"))


def access_count(server, path: str) -> int:
    """Requests to `path` the server answered 200, from its access log."""
    pattern = re.compile(rf"macspec\.access: \S+ POST {re.escape(path)} 200 ")
    return sum(1 for line in server.log.read_text().splitlines() if pattern.search(line))


@pytest.mark.slow
def test_the_curl_quick_start_gets_a_chat_completion(server, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    before = access_count(server, "/v1/chat/completions")
    command = at(server, block_with(section("Quick start 2"), "bash", "curl "))
    done = run_here(["bash", "-c", command], server, tmp_path)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["object"] == "chat.completion", reply
    assert isinstance(reply["choices"][0]["message"]["content"], str), reply
    assert reply["usage"]["completion_tokens"] > 0, reply
    assert access_count(server, "/v1/chat/completions") == before + 1


@pytest.mark.slow
@pytest.mark.parametrize("needle, path", [("from openai import", "/v1/chat/completions"),
                                          ("import anthropic", "/v1/messages")])
def test_the_python_quick_starts_print_a_reply(server, tmp_path, needle, path):
    before = access_count(server, path)
    code = at(server, block_with(section("Quick start 2"), "python", needle))
    done = run_here([sys.executable, "-c", code], server, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.removesuffix("\n"), repr(done.stdout)  # the model's text, printed
    assert access_count(server, path) == before + 1
