"""Speculation in a shared batch: each proposer drafts for all of its rows in one forward per
chain step, the whole step reads back in one host sync, and the controller starts a request
from what its method earned before (in memory, and across restarts from the state dir)."""

from __future__ import annotations

import json
import signal

import pytest
import requests

from macspec.engine.launch import calibrated_engine
from macspec.engine.runtime import Runtime
from macspec.config import load_profile
from macspec.models.loader import load_model
from macspec.sampling import SamplingParams
from macspec.speculative.draft import DraftGroup
from macspec.proposers import METHODS

from .conftest import engine_for, generate, tiny_runtime
from .modeldirs import random_copy_of_embedded
from .serverutil import Foreground

pytestmark = pytest.mark.slow

GREEDY = SamplingParams()


def test_a_batch_of_draft_rows_is_one_group_and_equals_each_row_alone(prompts):
    runtime = tiny_runtime("draft")
    engine = engine_for(runtime)
    batch = prompts[:4]
    alone = [generate(runtime, p, 40, GREEDY, k=4)[0] for p in batch]
    forwards = {}
    original = DraftGroup._next_logits

    def counting(self, tokens):  # one chain step: how many rows does one draft forward carry?
        forwards[tokens.shape[0]] = forwards.get(tokens.shape[0], 0) + 1
        return original(self, tokens)

    DraftGroup._next_logits = counting
    saved = engine.max_batch, engine.scheduler.max_batch
    try:
        engine.max_batch = engine.scheduler.max_batch = 4
        out = engine.generate(batch, GREEDY, 40, num_draft=4, adaptive=False)
    finally:
        DraftGroup._next_logits = original
        engine.max_batch, engine.scheduler.max_batch = saved
    assert [c.tokens for c in out] == alone
    assert max(forwards) == 4, forwards  # all four rows in one draft forward
    assert all(c.stats["acceptance_rate"] > 0 for c in out)


@pytest.mark.parametrize("method", METHODS)
def test_one_host_sync_per_decode_step(prompts, method):
    runtime = tiny_runtime(method)
    engine = calibrated_engine(runtime, max_batch=4)
    before_syncs, before_steps = engine.stats.host_syncs, engine.stats.totals["steps"]
    params = [GREEDY, SamplingParams(temperature=0.7, seed=1), SamplingParams(repetition_penalty=1.2),
              GREEDY]
    out = engine.generate(prompts[:4], params, 32, num_draft=3, adaptive=False)
    assert all(c.error is None and len(c.tokens) == 32 for c in out)
    steps = engine.stats.totals["steps"] - before_steps
    assert steps > 0 and engine.stats.host_syncs - before_syncs == steps
    status = engine.status()
    assert status["host_syncs_per_step"] == 1.0
    # /v1/status's step mix: every step at its row count and window, with what it committed
    cells = [(int(w), c) for by_window in status["steps_by_window"].values() for w, c in by_window.items()]
    assert sum(c["steps"] for _, c in cells) == engine.stats.totals["steps"]
    assert max(w for w, _ in cells) <= 4 and sum(c["tokens"] for _, c in cells) >= 4 * 31


def test_a_new_request_starts_from_the_methods_prior(tmp_path, prompts):
    """A useless draft: the first request learns it, the next one starts with speculation
    nearly off instead of exploring from the optimistic default."""
    useless = random_copy_of_embedded("tiny-draft", tmp_path / "random-draft", seed=3)
    profile = load_profile("tiny")
    profile.speculative.draft_model = str(useless)
    target = tiny_runtime("none").target
    runtime = Runtime(profile, target, "draft", draft=load_model(str(useless)))
    engine = calibrated_engine(runtime, max_batch=1)
    first = engine.generate([prompts[0]], GREEDY, 48, adaptive=False)[0]  # k = 4 every step
    prior = engine.status()["acceptance_priors"]["draft"]["drafts"]
    assert max(prior) < 0.2, prior
    second = engine.generate([prompts[1]], GREEDY, 48)[0]
    estimate = second.stats["spec"]["acceptance_estimate"]["drafts"]
    assert estimate[0] < 0.3, second.stats["spec"]
    assert second.stats["spec"]["drafted"] < first.stats["spec"]["drafted"] / 4, (first.stats, second.stats)


def test_run_and_a_restarted_server_start_from_the_acceptance_earlier_runs_measured(isolated_home):
    """`macspec run` keeps what each method accepted; the next run and `macspec serve` start
    there (not at the optimistic default), and the server keeps what it measured when it stops."""
    from click.testing import CliRunner

    from macspec.cli import main

    result = CliRunner().invoke(main, ["run", "def parse(self, text):", "--max-tokens", "24", "--json",
                                       "--fixed-k"])
    assert result.exit_code == 0, result.output
    saved = json.loads((isolated_home / "state" / "acceptance-priors.json").read_text())
    key = next(k for k in saved if k.startswith("draft|") and k.endswith("tiny-draft"))
    assert len(saved[key]) == 4 and all(0 <= a <= 1 for a in saved[key])
    saved[key] = [0.01, 0.01, 0.01, 0.01]  # a prior saying the draft never agrees
    (isolated_home / "state" / "acceptance-priors.json").write_text(json.dumps(saved))
    # Two tokens: the one decode step measures plain decoding (nothing drafted yet), so the
    # estimate is where the request started.
    again = CliRunner().invoke(main, ["run", "def parse(self, text):", "--max-tokens", "2", "--json"])
    stats = json.loads(again.output.strip().splitlines()[-1])
    assert stats["spec"]["acceptance_estimate"]["drafts"][0] < 0.2  # the saved prior, not 0.7
    server = Foreground(isolated_home)  # `macspec serve` on the same home
    try:
        status = requests.get(server.url + "/v1/status", timeout=10).json()["engine"]
        assert status["acceptance_priors"]["draft"]["drafts"][0] < 0.2  # before any request
        body = {"prompt": "def parse(self, text):", "max_tokens": 24,
                "speculative": {"num_draft_tokens": 4, "adaptive": False}}
        assert requests.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log.read_text()
    kept = json.loads((isolated_home / "state" / "acceptance-priors.json").read_text())[key]
    assert kept[0] > 0.05, kept  # the server's drafts, measured and kept for the next start
