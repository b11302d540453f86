"""Shared fixtures: the embedded tiny family, held-out prompts, an isolated user dir."""

from __future__ import annotations

import macspec  # noqa: F401  (loads the fast BLAS before mlx)

import os

import pytest

# Every product at its own row count unless a test picks a padding: a table timed under load must
# not pick which kernel's rounding a test's greedy tokens see (servers the tests start inherit it).
os.environ.setdefault("MACSPEC_ROW_PADS", "none")

from macspec.config import BUILTIN_PROFILE_DIR, load_profile
from macspec.proposers import BY_NAME
from macspec.engine.blocking import Completion
from macspec.engine.engine import Engine
from macspec.engine.launch import calibrated_engine
from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec import corpus



@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MACSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


_RUNTIMES: dict[str, Runtime] = {}


def tiny_runtime(method: str) -> Runtime:
    if method not in _RUNTIMES:
        # The method's own tiny profile where one ships (tiny-mtp, tiny-ngram...), else tiny's.
        # eagle3+suffix takes tiny-eagle3's (the head it names).
        names = {p.stem for p in BUILTIN_PROFILE_DIR.glob("tiny-*.toml")}
        parts = BY_NAME[method].parts if method in BY_NAME else ()
        name = f"tiny-{method}" if f"tiny-{method}" in names else \
            "tiny-eagle3" if parts[:1] == ("eagle3",) else "tiny"
        profile = load_profile(name)
        profile.speculative.method = method
        _RUNTIMES[method] = Runtime.load(profile)
    return _RUNTIMES[method]


@pytest.fixture(scope="session")
def runtime_for():
    return tiny_runtime


_ENGINES: dict[int, Engine] = {}


def engine_for(runtime: Runtime) -> Engine:
    """The engine `serve` uses, synchronous, one per runtime (its cost model calibrated)."""
    if id(runtime) not in _ENGINES:
        _ENGINES[id(runtime)] = calibrated_engine(runtime, max_batch=8)
    return _ENGINES[id(runtime)]


def generate(runtime: Runtime, prompt: list[int], max_tokens: int, params: SamplingParams,
             k: int | None = None, adaptive: bool = False, stop_token_ids: tuple[int, ...] = (),
             method: str | None = None) -> tuple[list[int], Completion]:
    """One request alone (batch of one) through the engine -> (tokens, its Completion)."""
    [done] = engine_for(runtime).generate([prompt], params, max_tokens, num_draft=k, adaptive=adaptive,
                                          stop_token_ids=tuple(stop_token_ids), method=method)
    if done.error is not None:
        raise done.error
    return done.tokens, done


def heldout_prompts(tokenizer, count: int = 24) -> list[list[int]]:
    """Snippets of held-out stdlib files: openings, middles, and file ends (which invite EOS)."""
    texts = [t for t in corpus.read_texts(heldout=True) if len(t) > 600]
    prompts = []
    for i, text in enumerate(texts[:count]):
        if i % 3 == 0:
            snippet = text[:240]
        elif i % 3 == 1:
            middle = len(text) // 2
            snippet = text[middle:middle + 200]
        else:
            snippet = text[-160:]
        prompts.append(tokenizer.encode(snippet, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="session")
def prompts():
    return heldout_prompts(tiny_runtime("none").tokenizer)
