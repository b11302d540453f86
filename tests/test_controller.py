"""The k controller: off when speculation cannot pay, best k when it can, probes that back off."""

from __future__ import annotations

from macspec.config import load_profile
from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec.models.loader import load_model, resolve_path
from macspec.spec.controller import ControllerConfig, KController

from .conftest import generate, heldout_prompts
from .modeldirs import random_copy_of_embedded


def simulate(cost_ms, alpha: float, steps: int = 400, k_max: int = 4) -> KController:
    """Drive the controller with a deterministic acceptance pattern and a cost function."""
    ctl = KController(ControllerConfig(k_max=k_max, probe_min_steps=16, probe_max_steps=128))
    credit = 0.0
    for _ in range(steps):
        k = ctl.choose_k()
        accepted = 0
        for _ in range(k):
            credit += alpha
            if credit < 1.0:
                break
            credit -= 1.0
            accepted += 1
        ctl.observe(k, accepted, cost_ms(k) / 1e3)
    return ctl


def test_compute_bound_backend_turns_speculation_off():
    ctl = simulate(lambda k: 1.0 * (k + 1) + 0.3 * k, alpha=0.8)  # verifying k+1 costs (k+1)x
    assert ctl.is_off and ctl.num_turned_off >= 1 and ctl.best_k() == 0


def test_bandwidth_bound_backend_finds_a_large_k():
    ctl = simulate(lambda k: 1.0 + 0.05 * k, alpha=0.9)  # flat verify, cheap draft
    assert not ctl.is_off and ctl.best_k() >= 3


def test_expensive_draft_lowers_k():
    cheap = simulate(lambda k: 1.0 + 0.05 * k, alpha=0.7).best_k()
    dear = simulate(lambda k: 1.0 + 0.45 * k, alpha=0.7).best_k()
    assert 0 < dear < cheap


def test_probes_back_off_exponentially_and_are_bounded():
    ctl = simulate(lambda k: 1.0 * (k + 1), alpha=0.0, steps=1500)
    assert ctl.is_off
    intervals = ctl.probe_intervals
    assert intervals[:4] == [16, 32, 64, 128] and set(intervals[4:]) == {128}
    assert ctl.num_probes == len(intervals) - 1


def test_probe_that_succeeds_turns_speculation_back_on():
    ctl = simulate(lambda k: 1.0 * (k + 1), alpha=0.0, steps=200)
    assert ctl.is_off
    for _ in range(300):  # the hardware got faster at verifying
        k = ctl.choose_k()
        ctl.observe(k, k, (1.0 + 0.05 * k) / 1e3)
    assert not ctl.is_off and ctl.probe_interval == 16


def _runtime_with_draft(draft_path) -> Runtime:
    profile = load_profile("tiny")
    profile.speculative.probe_min_steps = 8
    profile.speculative.probe_max_steps = 32
    runtime = Runtime.load(profile)
    runtime.draft = load_model(str(draft_path))
    return runtime


def test_random_draft_is_turned_off_quickly_then_probed_with_backoff(tmp_path):
    runtime = _runtime_with_draft(random_copy_of_embedded("tiny-draft", tmp_path / "rnd", seed=7))
    prompt = heldout_prompts(runtime.tokenizer)[0]
    _, gen = generate(runtime, prompt, 300, SamplingParams(repetition_penalty=1.2), k=4, adaptive=True)
    ctl, spec = gen.controller, gen.stats.spec
    assert ctl.num_turned_off >= 1
    # Off within a bounded number of steps: few speculative steps before the first probe.
    assert spec.num_spec_steps <= 12 + 4 * ctl.num_probes
    assert ctl.probe_intervals[:3] == [8, 16, 32]
    assert spec.acceptance_rate < 0.2


def test_target_as_its_own_draft_accepts_everything():
    runtime = _runtime_with_draft(resolve_path("embedded:tiny-target"))
    prompt = heldout_prompts(runtime.tokenizer)[1]
    _, gen = generate(runtime, prompt, 40, SamplingParams(), k=4)
    spec = gen.stats.spec
    assert spec.num_drafted > 0 and spec.acceptance_rate == 1.0
    assert spec.tokens_per_forward > 3.5
