"""The CLI through click's CliRunner, on the embedded models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from macspec.cli import main

ROOT = Path(__file__).resolve().parent.parent
COMPLETIONS = {"bash_source": "macspec.bash", "zsh_source": "_macspec", "fish_source": "macspec.fish"}


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_run_streams_text_then_one_stats_line():
    result = invoke("run", "def fibonacci(n):", "--max-tokens", "24")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    stats = result.stderr.strip().splitlines()
    assert len(stats) == 1
    for field in ("prompt", "TTFT", "decode", "method draft", "acceptance", "tok/forward", "BLAS"):
        assert field in stats[0]


def test_run_json_reports_everything():
    result = invoke("run", "import os\n", "--max-tokens", "16", "--json", "--method", "ngram")
    data = json.loads(result.stdout)
    assert data["method"] == "ngram" and data["generated_tokens"] <= 16
    for key in ("text", "prompt_tokens", "ttft_s", "decode_tokens_per_s", "k_max",
                "acceptance_rate", "tokens_per_forward", "finish_reason", "blas", "spec"):
        assert key in data
    assert data["blas"]["name"] in ("openblas", "reference", "accelerate", "unknown")


def test_run_reads_prompt_from_stdin_and_flags_override_profile():
    result = invoke("run", "-", "--json", "--max-tokens", "8", "--method", "none", "--seed", "3",
                    "--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05",
                    "--repetition-penalty", "1.1", input="class Foo:\n")
    data = json.loads(result.stdout)
    assert data["prompt_tokens"] > 2 and data["method"] == "none"
    again = json.loads(invoke("run", "-", "--json", "--max-tokens", "8", "--method", "none",
                              "--seed", "3", "--temperature", "0.7", "--top-p", "0.9",
                              "--top-k", "40", "--min-p", "0.05", "--repetition-penalty", "1.1",
                              input="class Foo:\n").stdout)
    assert again["text"] == data["text"]  # a seed replays exactly


def test_chat_flag_applies_the_template():
    raw = json.loads(invoke("run", "hi", "--json", "--max-tokens", "2", "--raw").stdout)
    chat = json.loads(invoke("run", "hi", "--json", "--max-tokens", "2", "--chat").stdout)
    assert chat["prompt_tokens"] > raw["prompt_tokens"]


@pytest.mark.parametrize("method", ["draft", "mtp", "ngram", "none"])
def test_every_method_runs_from_the_cli(method):
    result = invoke("run", "def f(x):\n    return", "--json", "--max-tokens", "12",
                    "--method", method, "--num-draft", "3", "--fixed-k")
    data = json.loads(result.stdout)
    assert data["method"] == method and data["generated_tokens"] > 0


def test_profiles_list_and_show():
    listing = invoke("profiles", "list").output
    for name in ("tiny", "tiny-mtp", "tiny-ngram", "kimi-tp2", "glm5-mtp"):
        assert name in listing
    shown = invoke("profiles", "show", "kimi-tp2").output
    assert "tensor_parallel = 2" in shown and "# profile" in shown and "# default" in shown
    data = json.loads(invoke("profiles", "show", "tiny", "--json").output)
    assert data["speculative"]["method"] == {"value": "draft", "source": data["file"]}
    assert data["sampling"]["top_p"]["source"] == "default"


@pytest.mark.parametrize("args, message", [
    (["run", "x", "--profile", "nope"], "profile 'nope' not found"),
    (["profiles", "show", "nope"], "profile 'nope' not found"),
    (["run", "x", "--profile", "/no/such.toml"], "/no/such.toml: profile file not found"),
])
def test_errors_are_one_clean_line(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert f"Error: {message}" in result.output
    assert "Traceback" not in result.output


def test_bad_profile_file_from_cli(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[speculative]\nnum_draft_tokens = -1\n")
    result = CliRunner().invoke(main, ["run", "x", "--profile", str(bad)])
    assert result.exit_code == 1
    assert str(bad) in result.output and "speculative.num_draft_tokens = -1" in result.output


def test_unloadable_model_is_a_clean_error(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_text("[model]\npath = '/nowhere/model'\n")
    result = CliRunner().invoke(main, ["run", "x", "--profile", str(bad)])
    assert result.exit_code == 1 and "no such directory" in result.output


def test_incompatible_draft_is_diagnosed_and_fallback_works(tmp_path):
    from .modeldirs import build_model, save_model, tiny_llama_config, write_word_tokenizer

    other = save_model(build_model(tiny_llama_config(16), seed=0), tiny_llama_config(16), tmp_path / "d")
    write_word_tokenizer(other, [f"w{i}" for i in range(16)])
    profile = tmp_path / "p.toml"
    profile.write_text(f"[model]\nchat = false\n[speculative]\nmethod = 'draft'\ndraft_model = '{other}'\n")
    result = CliRunner().invoke(main, ["run", "x", "--profile", str(profile), "--max-tokens", "4"])
    assert result.exit_code == 1 and "vocabularies differ" in result.output
    profile.write_text(profile.read_text() + "allow_fallback = true\n")
    result = CliRunner().invoke(main, ["run", "x", "--profile", str(profile), "--max-tokens", "4", "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 0 and data["method"] == "ngram" and data["requested_method"] == "draft"


def _completion(env: dict) -> str:
    code = "from macspec.cli import main; main(prog_name='macspec')"
    return subprocess.run([sys.executable, "-c", code],
                          env={**os.environ, **env}, capture_output=True, text=True).stdout


@pytest.mark.parametrize("shell", list(COMPLETIONS))
def test_shipped_completion_scripts_are_current(shell):
    expected = (ROOT / "completions" / COMPLETIONS[shell]).read_text()
    generated = _completion({"_MACSPEC_COMPLETE": shell})
    assert generated == expected, \
        f"completions/{COMPLETIONS[shell]} is stale: regenerate with _MACSPEC_COMPLETE={shell} macspec"


def test_profile_option_completes_profile_names():
    out = _completion({"_MACSPEC_COMPLETE": "bash_complete",
                       "COMP_WORDS": "macspec run x --profile ti", "COMP_CWORD": "4"})
    assert "plain,tiny" in out and "plain,tiny-mtp" in out and "kimi" not in out
