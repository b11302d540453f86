"""Profiles: every shipped one loads without its models; every mistake names file, key, value."""

from __future__ import annotations

import pytest

from macspec.config import find_profile, list_profiles, load_profile, load_profile_file
from macspec.errors import ProfileError
from macspec.proposers import METHODS

SHIPPED = ["tiny", "tiny-mtp", "tiny-ngram", "tiny-wide", "kimi-tp2", "glm5-mtp"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_without_models(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description


def test_kimi_profile_is_tp2_over_jaccl_with_moonlight_draft():
    p = load_profile("kimi-tp2")
    assert (p.parallel.tensor_parallel, p.parallel.backend) == (2, "jaccl")
    assert len(p.parallel.hosts) == 2 and p.parallel.ibv_devices[0][1]
    assert "Moonlight" in p.speculative.draft_model and p.speculative.method == "draft"


def test_glm5_profile_uses_mtp():
    assert load_profile("glm5-mtp").speculative.method == "mtp"


def write(tmp_path, text, name="bad.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, fragments", [
    ("[model]\npaht = 'x'\n", ["unknown key model.paht", "allowed keys:", "path"]),
    ("[server]\nprefix_cache_disk_gb = 2\n", ["unknown key server.prefix_cache_disk_gb (did you mean kv.prefix_cache_disk_gb?)"]),
    ("[speculative]\nnum_draft_tokens = 0\n", ["speculative.num_draft_tokens = 0", "in [1, 32]"]),
    ("[speculative]\nmethod = 'eagle'\n", ["speculative.method = 'eagle'", ", ".join(map(repr, METHODS))]),
    ("[sampling]\ntemperature = 'hot'\n", ["sampling.temperature = 'hot'", "a number"]),
    ("[sampling]\ntop_k = 1.5\n", ["sampling.top_k = 1.5", "an integer"]),
    ("[model]\nchat = 'yes'\n", ["model.chat = 'yes'", "true or false"]),
    ("[engine]\nx = 1\n", ["unknown key 'engine'", "[model]"]),
    ("model = 3\n", ["[model] must be a table"]),
    ("[model\npath='x'\n", ["invalid TOML"]),
    ("[speculative]\nmethod = 'draft'\n", ["needs speculative.draft_model"]),
    ("[parallel]\ntensor_parallel = 2\n", ["needs parallel.backend"]),
    ("[parallel]\ntensor_parallel = 2\nbackend = 'ring'\nhosts = ['a', 'b', 'c']\n",
     ["parallel.hosts has 3 entries", "expected 2"]),
    ("[parallel]\nibv_devices = [['', 'x']]\n", ["parallel.ibv_devices", "square"]),
    ("[speculative]\nngram_min = 5\nngram_max = 2\n", ["ngram_min = 5 exceeds"]),
    ("[kv]\nkv_bits = 8\n", ["kv.kv_bits is no longer a profile key", "MLA", "delete it"]),
])
def test_profile_errors_name_file_key_and_value(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile_file(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_and_unknown_profiles(tmp_path):
    with pytest.raises(ProfileError, match="profile file not found"):
        find_profile(str(tmp_path / "nope.toml"))
    with pytest.raises(ProfileError, match="profile 'nope' not found .* known profiles: .*tiny"):
        find_profile("nope")


def test_non_utf8_profile(tmp_path):
    path = tmp_path / "latin.toml"
    path.write_bytes(b"name = '\xe9'\n")
    with pytest.raises(ProfileError, match="not UTF-8"):
        load_profile_file(path)


def test_user_dir_shadows_builtins_and_name_defaults_to_file_stem(isolated_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./profiles here: the user dir comes next
    (isolated_home / "profiles").mkdir(parents=True)
    (isolated_home / "profiles" / "tiny.toml").write_text("[sampling]\nmax_tokens = 7\n")
    (isolated_home / "profiles" / "mine.toml").write_text("[speculative]\nmethod = 'ngram'\n")
    assert load_profile("tiny").sampling.max_tokens == 7
    assert load_profile("mine").name == "mine"
    assert set(SHIPPED) | {"mine"} <= set(list_profiles())


def test_override_records_its_origin_and_is_validated():
    profile = load_profile("tiny")
    profile.override("sampling.temperature", 0.5, "--temperature")
    resolved = profile.resolved()
    assert resolved["sampling"]["temperature"] == (0.5, "--temperature")
    assert resolved["sampling"]["top_p"] == (1.0, "default")
    assert resolved["speculative"]["method"][1].endswith("tiny.toml")
    with pytest.raises(ProfileError, match="--num-draft"):
        profile.override("speculative.num_draft_tokens", 99, "--num-draft")


def test_docs_list_every_profile_key():
    import dataclasses
    from pathlib import Path

    from macspec.config import SECTIONS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "profiles.md").read_text()
    for section, cls in SECTIONS.items():
        assert f"## [{section}]" in doc
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc, f"docs/profiles.md lacks {section}.{f.name}"
