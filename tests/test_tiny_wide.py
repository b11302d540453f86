"""built:tiny-wide: the widened embedded target, built into the cache on first use.

The build mechanism (atomic rename, lock, stale temp dirs, Ctrl-C) is tested with a stand-in
writer; the real build at a small width (tiny-wide-N) and the profile at full width are slow."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from macspec.cli import main
from macspec.config import load_profile
from macspec.errors import ModelLoadError
from macspec.models import built
from macspec.models.checkpoint import load_mtp_head
from macspec.models.loader import find_local_model, load_model, resolve_path


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def fake_writer(monkeypatch):
    """Replaces the real build (seconds, a model load) with one writing a stamped stub dir."""
    calls = []

    def write(out: Path, hidden: int) -> None:
        calls.append(hidden)
        (out / "config.json").write_text("{}")
        (out / built.STAMP).write_text(json.dumps(built._stamp(hidden)))

    monkeypatch.setattr(built, "_write_wide", write)
    return calls


def test_names_and_cache_location(isolated_home):
    assert built.wide_hidden("tiny-wide") == built.WIDE_HIDDEN == 1664
    assert built.wide_hidden("tiny-wide-512") == 512
    assert built.built_dir("tiny-wide") == isolated_home / "cache" / "models" / "tiny-wide"
    with pytest.raises(ModelLoadError, match="no built model 'nope'.*tiny-wide"):
        resolve_path("built:nope")
    with pytest.raises(ModelLoadError, match="'tiny-wide-300': hidden 300 must be a multiple of 128"):
        resolve_path("built:tiny-wide-300")


def test_lookup_never_builds_and_first_resolve_builds_once(isolated_home, fake_writer):
    assert find_local_model("built:tiny-wide") is None
    assert fake_writer == [] and not built.built_dir("tiny-wide").exists()
    path = resolve_path("built:tiny-wide")
    stamp_mtime = (path / built.STAMP).stat().st_mtime_ns
    assert resolve_path("built:tiny-wide") == path == find_local_model("built:tiny-wide")
    assert fake_writer == [1664]
    assert (path / built.STAMP).stat().st_mtime_ns == stamp_mtime
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny-wide.lock", "tiny-wide"]


def test_stale_build_and_leftover_temp_dirs_are_replaced(isolated_home, fake_writer):
    path = resolve_path("built:tiny-wide-256")
    leftover = path.parent / ".tiny-wide-256.tmp-99999"  # a build killed mid-way
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    stamp = json.loads((path / built.STAMP).read_text())
    (path / built.STAMP).write_text(json.dumps({**stamp, "source": "re-forged"}))
    assert find_local_model("built:tiny-wide-256") is None
    assert resolve_path("built:tiny-wide-256") == path
    assert fake_writer == [256, 256]
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny-wide-256.lock", "tiny-wide-256"]


def test_interrupted_build_leaves_no_dir(isolated_home, monkeypatch):
    def interrupted(out: Path, hidden: int) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(built, "_write_wide", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_path("built:tiny-wide-256")
    parent = built.built_dir("tiny-wide-256").parent
    assert [p.name for p in parent.iterdir()] == [".tiny-wide-256.lock"]


def test_concurrent_first_uses_build_once(isolated_home, fake_writer, monkeypatch):
    real = built._write_wide
    started = threading.Event()

    def slow(out: Path, hidden: int) -> None:
        started.set()
        threading.Event().wait(0.3)  # the other caller arrives while this one builds
        real(out, hidden)

    monkeypatch.setattr(built, "_write_wide", slow)
    paths = []
    first = threading.Thread(target=lambda: paths.append(resolve_path("built:tiny-wide-256")))
    first.start()
    started.wait(5)
    paths.append(resolve_path("built:tiny-wide-256"))  # blocks on the lock, then finds it built
    first.join()
    assert fake_writer == [256] and paths[0] == paths[1]


def test_forge_refuses_to_replace_a_foreign_dir(tmp_path):
    (tmp_path / "mine").mkdir()
    result = CliRunner().invoke(main, ["forge", "tiny-wide", "--out", str(tmp_path / "mine")])
    assert result.exit_code == 1 and "is not a macspec build" in result.output
    result = CliRunner().invoke(main, ["forge", "tiny-huge"])  # a usage error, listing targets
    assert result.exit_code == 2 and "no forge target 'tiny-huge'" in result.output
    assert "tiny-wide-N" in result.output
    result = CliRunner().invoke(main, ["forge"])
    assert result.exit_code == 2 and "needs --out" in result.output


def test_profile_and_doctor_before_the_first_build(isolated_home):
    from macspec.monitor.doctor import FAIL, Doctor

    profile = load_profile("tiny-wide")
    assert profile.model.path == "built:tiny-wide" and profile.model.dtype == "float32"
    assert profile.speculative.draft_model == "embedded:tiny-draft"
    assert (profile.speculative.num_draft_tokens, profile.kv.max_context) == (4, 4096)
    doctor = Doctor(profile)
    doctor.models()
    doctor.fit()
    checks = {c.name: c for c in doctor.checks}
    assert checks["target model"].status == "ok" and "not built yet" in checks["target model"].detail
    assert all(c.status != FAIL for c in doctor.checks), doctor.checks
    assert not built.built_dir("tiny-wide").exists()


@pytest.mark.slow
def test_built_dir_is_a_plain_mlx_lm_dir_with_the_same_logits_and_mtp(isolated_home):
    import mlx_lm

    from macspec.models.view import ModelView

    small = load_model("embedded:tiny-target", dtype="float32")
    tokens = mx.array([small.tokenizer.encode("def parse(text):\n    return")])
    small_logits, small_h = ModelView(small.model).forward(tokens)

    path = resolve_path("built:tiny-wide-512")
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 512 and config["num_nextn_predict_layers"] == 1
    model, _ = mlx_lm.load(str(path))  # what mlx_lm.server --model DIR does
    assert mx.allclose(model(tokens), small_logits, atol=1e-4).item()

    wide = load_model("built:tiny-wide-512")
    wide_logits, wide_h = ModelView(wide.model).forward(tokens)
    assert mx.allclose(wide_logits, small_logits, atol=1e-4).item()
    wide_mtp, _ = load_mtp_head(wide)(tokens[:, 1:], wide_h[:, :-1], ModelView(wide.model))
    small_mtp, _ = load_mtp_head(small)(tokens[:, 1:], small_h[:, :-1], ModelView(small.model))
    assert mx.allclose(wide_mtp, small_mtp, atol=1e-4).item()
    assert (wide_mtp.argmax(-1) == small_mtp.argmax(-1)).all().item()


@pytest.mark.slow
def test_forge_cli_builds_into_out_and_rebuilds_in_place(tmp_path):
    out = tmp_path / "wide"
    result = invoke("forge", "tiny-wide-384", "--out", str(out))
    assert result.exit_code == 0 and f"in {out}" in result.output
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 384
    assert (out / "mtp.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert load_mtp_head(load_model(str(out))) is not None
    assert invoke("forge", "tiny-wide-384", "--out", str(out)).exit_code == 0  # explicit: rebuilds
    assert sorted(p.name for p in tmp_path.iterdir()) == [".wide.lock", "wide"]


@pytest.fixture(scope="module")
def wide_home(tmp_path_factory):
    return tmp_path_factory.mktemp("wide-home")  # one full-width build for the tests below


@pytest.mark.slow
def test_run_profile_tiny_wide_builds_then_reuses(wide_home, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(wide_home))
    result = invoke("run", "def parse(", "--profile", "tiny-wide", "--max-tokens", "8")
    assert result.exit_code == 0 and result.stdout.strip()
    assert "method draft" in result.stderr
    path = find_local_model("built:tiny-wide")
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 1664
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    mtp = json.loads(invoke("run", "def parse(", "--profile", "tiny-wide", "--max-tokens", "8",
                            "--json", "--method", "mtp").stdout)
    assert mtp["method"] == "mtp" and mtp["text"]
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_doctor_after_the_build_checks_the_built_dir(wide_home, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(wide_home))
    resolve_path("built:tiny-wide")  # built by the test above, or here when run alone
    data = json.loads(invoke("doctor", "--profile", "tiny-wide", "--json").stdout)
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["target model"]["status"] == "ok" and "llama" in checks["target model"]["detail"]
    assert checks["draft tokenizer"]["status"] == "ok"
    assert checks["MTP head"]["status"] == "ok"
    assert checks["fits in memory"]["status"] in ("ok", "warn")
