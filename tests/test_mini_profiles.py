"""kimi-tp2-mini and glm5-mtp-mini are kimi-tp2 and glm5-mtp on any machine: their resolved
values may differ only in model paths, sizes and hosts, so the minis cannot drift from the seeds."""

from __future__ import annotations

import pytest

from macspec.config import load_profile

NAMES = {"name", "description"}
SIZES = {"hardware.memory_gb", "hardware.wired_limit_mb", "kv.max_context", "kv.prefill_chunk",
         "sampling.max_tokens", "server.max_output_tokens"}
# The machines: two local ring ranks instead of two Mac Studios over JACCL (chip, RDMA devices,
# coordinator and the remote interpreter describe those Macs).
HOSTS = {"hardware.chip", "parallel.backend", "parallel.hosts", "parallel.ibv_devices",
         "parallel.coordinator", "parallel.python"}

PAIRS = {
    "kimi-tp2": ("kimi-tp2-mini", NAMES | SIZES | HOSTS | {"model.path", "speculative.draft_model"}),
    "glm5-mtp": ("glm5-mtp-mini", NAMES | SIZES | {"hardware.chip", "model.path"}),
}


def flatten(profile) -> dict:
    """Every resolved value (defaults included) as `section.key` -> value, plus name/description."""
    flat = {"name": profile.name, "description": profile.description}
    for section, values in profile.resolved().items():
        flat.update({f"{section}.{key}": value for key, (value, _source) in values.items()})
    return flat


@pytest.mark.parametrize("seed", sorted(PAIRS))
def test_mini_differs_from_its_seed_only_in_paths_sizes_and_hosts(seed):
    mini, allowed = PAIRS[seed]
    real, small = flatten(load_profile(seed)), flatten(load_profile(mini))
    assert real.keys() == small.keys()
    differing = {key for key in real if real[key] != small[key]}
    assert differing == allowed, {k: (real[k], small[k]) for k in differing ^ allowed}


@pytest.mark.parametrize("seed", sorted(PAIRS))
def test_mini_values_are_the_miniature_ones(seed):
    mini = load_profile(PAIRS[seed][0])
    assert mini.name == PAIRS[seed][0]
    paths = [mini.model.path] + ([mini.speculative.draft_model] if mini.speculative.draft_model else [])
    assert all(p.startswith("built:") for p in paths), paths
    real = load_profile(seed)
    for key in ("hardware.memory_gb", "hardware.wired_limit_mb", "kv.max_context",
                "kv.prefill_chunk", "sampling.max_tokens"):
        section, name = key.split(".")
        assert getattr(getattr(mini, section), name) < getattr(getattr(real, section), name), key
    assert mini.hardware.chip is None
    par = mini.parallel
    assert par.tensor_parallel == real.parallel.tensor_parallel
    if par.tensor_parallel > 1:
        assert par.backend == "ring" and par.hosts == ["127.0.0.1"] * par.tensor_parallel
        assert par.ibv_devices is None and par.coordinator is None


def test_mini_paths_name_the_replicas():
    from macspec.models.replicas import REPLICAS

    kimi, glm = load_profile("kimi-tp2-mini"), load_profile("glm5-mtp-mini")
    assert kimi.model.path == "built:kimi-k25-mini"
    assert kimi.speculative.draft_model == "built:moonlight-mini"
    assert glm.model.path == "built:glm5-mini"
    for path in (kimi.model.path, kimi.speculative.draft_model, glm.model.path):
        assert path[len("built:"):] in REPLICAS
