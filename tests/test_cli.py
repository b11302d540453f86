"""The CLI through click's CliRunner, on the embedded models."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from macspec.cli import main
from macspec.proposers import METHODS

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


@pytest.mark.parametrize("method", METHODS)
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
    (["run", "word " * 2100, "--max-tokens", "2"], "prompt (2101 tokens) + max_tokens (2) exceeds the "
     "context length 2048; shorten the prompt or max_tokens (this model takes at most 2048)"),
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


# ---- shell completion ------------------------------------------------------------------------
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_show_prints_the_generated_script(shell):
    result = invoke("completions", "show", shell)
    assert result.exit_code == 0
    assert "_macspec_completion" in result.stdout
    name = {"bash": "macspec.bash", "zsh": "_macspec", "fish": "macspec.fish"}[shell]
    assert result.stdout == (ROOT / "completions" / name).read_text()  # the shipped file, too


def test_completions_install_writes_where_each_shell_looks(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    expected = {"bash": tmp_path / ".local/share/bash-completion/completions/macspec",
                "zsh": tmp_path / ".zfunc/_macspec",
                "fish": tmp_path / ".config/fish/completions/macspec.fish"}
    for shell, path in expected.items():
        result = invoke("completions", "install", shell)
        assert result.exit_code == 0, result.output
        assert f"to {path}" in result.stdout
        assert path.read_text() == invoke("completions", "show", shell).stdout
    zsh = invoke("completions", "install", "zsh").stdout
    assert "fpath=(~/.zfunc $fpath)" in zsh and "compinit" in zsh
    (tmp_path / ".zshrc").write_text("fpath=(~/.zfunc $fpath)\n")
    assert "fpath=(" not in invoke("completions", "install", "zsh").stdout


# ---- hints -----------------------------------------------------------------------------------
DOUBLE_PERIOD = re.compile(r"(?<!\.)\.\.(?!\.)")


def test_hub_fetch_error_says_hf_download_with_no_double_period(tmp_path):
    profile = tmp_path / "p.toml"
    profile.write_text("[model]\npath = 'nobody/no-such-model'\n[speculative]\nmethod = 'none'\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-m", "macspec", "run", "x", "--profile", str(profile)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "(hf download nobody/no-such-model)" in result.stderr
    assert "huggingface-cli" not in result.stderr
    assert not DOUBLE_PERIOD.search(result.stderr), result.stderr


def test_doctor_fix_says_hf_download():
    result = CliRunner().invoke(main, ["doctor", "--profile", "kimi-tp2"])
    assert "fix: hf download mlx-community/Kimi-K2.5" in result.output
    assert "huggingface-cli" not in result.output


@pytest.mark.parametrize("files, reason", [
    ({}, "no config.json (the folder is empty)"),
    ({"tokenizer.json": "{}"}, "no config.json"),
    ({"config.json": "{not json"}, "config.json is not valid JSON"),
    ({"config.json": '{"hidden_size": 8}'}, "config.json has no model_type"),
    ({"config.json": '{"model_type": "llama"}'}, "no weights (model*.safetensors)"),
])
def test_doctor_explains_a_local_folder_that_is_not_a_model(tmp_path, files, reason):
    folder = tmp_path / "my-model"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    profile = tmp_path / "p.toml"
    profile.write_text(f"[model]\npath = '{folder}'\n[speculative]\nmethod = 'none'\n")
    result = CliRunner().invoke(main, ["doctor", "--profile", str(profile), "--json"])
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    target = checks["target model"]
    assert result.exit_code == 2 and target["status"] == "fail"
    assert target["detail"].startswith(f"{folder} exists but is not a valid mlx-lm model: {reason}")
    assert "not on this machine" not in result.stdout


# ---- the first ten minutes: --model, misspelt profiles, forge's list -------------------------
TINY_TARGET = ROOT / "macspec" / "assets" / "models" / "tiny-target"


def test_model_flag_runs_an_imported_gguf_and_the_embedded_target(tmp_path, monkeypatch, caplog):
    from .test_gguf import write_tiny_gguf

    monkeypatch.chdir(tmp_path)  # the newcomer's steps, relative paths and all
    caplog.set_level(logging.INFO, logger="macspec.modelflag")
    write_tiny_gguf(tmp_path / "x.gguf")
    assert invoke("import", "x.gguf", "--out", "my-model").exit_code == 0
    mistaken = CliRunner().invoke(main, ["run", "hi", "--profile", "my-model"])
    assert mistaken.exit_code == 1 and "give it as --model my-model" in mistaken.output
    for model in ("my-model", "x.gguf"):
        caplog.clear()
        result = invoke("run", "hi", "--model", model, "--max-tokens", "4", "--json")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["profile"] == "tiny" and data["method"] == "ngram"  # tiny's draft fits tiny only
        assert data["generated_tokens"] <= 4 and "requested_method" not in data
        switched = [r.getMessage() for r in caplog.records if r.name == "macspec.modelflag"]
        assert len(switched) == 1 and "speculative.method = ngram instead of the profile's draft" in switched[0]
    explicit = json.loads(invoke("run", "hi", "--model", "my-model", "--method", "suffix",
                                 "--max-tokens", "4", "--json").stdout)
    assert explicit["method"] == "suffix"
    # The profile's own target, named by its directory: its draft fits, so it stays.
    same = invoke("run", "def f(x):", "--model", str(TINY_TARGET), "--max-tokens", "4", "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["method"] == "draft"


@pytest.mark.parametrize("value, message", [
    ("/no/such/model", "--model /no/such/model: no such file or directory"),
    ("missing.gguf", "--model missing.gguf: no such file or directory"),
    ("tinny-target", "--model tinny-target: no such file or directory, not a model macspec knows"),
    ("built:tiny-huge", "--model built:tiny-huge: no built model 'tiny-huge'"),
    ("EMPTY", "not a model directory (no config.json"),
])
def test_a_bad_model_is_one_error_line_before_any_load(tmp_path, value, message):
    if value == "EMPTY":
        (tmp_path / "empty").mkdir()
        value = str(tmp_path / "empty")
    for command in (["run", "hi"], ["serve", "--port", "0"], ["bench"]):
        result = CliRunner().invoke(main, [*command, "--model", value])
        assert result.exit_code == 1, result.output
        assert result.output.splitlines() == [result.output.strip()]
        assert result.output.startswith("Error: ") and message in result.output


def test_bare_store_names_get_their_prefix():
    from macspec.modelflag import model_reference

    assert model_reference("tiny-target") == "embedded:tiny-target"
    assert model_reference("smollm2") == "pulled:smollm2"
    assert model_reference("tiny-wide") == "built:tiny-wide"
    assert model_reference("glm5-mini") == "built:glm5-mini"
    assert model_reference("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_misspelt_profile_gets_a_did_you_mean(isolated_home):
    result = CliRunner().invoke(main, ["run", "x", "--profile", "tinny"])
    assert result.exit_code == 1
    assert result.output == "Error: profile 'tinny' not found; did you mean 'tiny'?\n"
    (isolated_home / "profiles").mkdir(parents=True)
    (isolated_home / "profiles" / "my-coder.toml").write_text("[speculative]\nmethod = 'suffix'\n")
    mine = CliRunner().invoke(main, ["profiles", "show", "my-codr"])
    assert mine.output == "Error: profile 'my-codr' not found; did you mean 'my-coder'?\n"


def test_bare_forge_lists_what_it_makes():
    from macspec.cli import FORGE_WHATS
    from macspec.models.built import replica_names

    names = [name for name, _ in FORGE_WHATS]
    assert set(replica_names()) <= set(names)
    bare = CliRunner().invoke(main, ["forge"])
    assert bare.exit_code == 2 and "forge family needs --out DIR" in bare.output
    unknown = CliRunner().invoke(main, ["forge", "tiny-huge"])
    assert unknown.exit_code == 2 and "no forge target 'tiny-huge'" in unknown.output
    helped = invoke("forge", "--help").output
    for output in (bare.output, unknown.output, helped):
        listed = [line.split()[0] for line in output.splitlines() if line.startswith("  ")
                  and line.split()[0] in names]
        assert listed == names, output


def test_status_without_servers_is_not_an_error():
    result = invoke("status")
    assert result.exit_code == 0 and result.output == "no servers running (start one with `macspec serve --detach`)\n"
    assert json.loads(invoke("status", "--json").stdout) == {"servers": []}
    asked = CliRunner().invoke(main, ["status", "--port", "8123"])  # a named one that is not there
    assert asked.exit_code == 1 and "no macspec server with port 8123 is running" in asked.output


@pytest.mark.slow
def test_bench_model_flag_serves_that_model(tmp_path):
    from .test_gguf import write_tiny_gguf

    source = write_tiny_gguf(tmp_path / "x.gguf")
    out = subprocess.run([sys.executable, "-m", "macspec", "bench", "--model", str(source),
                          "--scenarios", "single", "--max-tokens", "4", "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["config"]["model"] == str(source) and report["config"]["method"] == "ngram"
    assert f"serving {source}" in report["server_log_excerpt"]
