"""KV and weight estimates against what the engine really allocates; admission control
through a real server with a small KV budget."""

from __future__ import annotations

import pytest

from concurrent.futures import ThreadPoolExecutor

import requests

from macspec.kv.batched import BatchKV, layout_of
from macspec.kv.cache import make_trimmable_cache
from macspec.monitor.memory import KVBudget, kv_bytes_per_token, weight_sizes

from .serverutil import RunningServer, runtime_with

KIMI_LIKE = {"num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
             "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64}


def test_kv_estimate_equals_the_engine_allocation(runtime_for):
    import mlx.core as mx

    runtime = runtime_for("none")
    model = runtime.target.model
    cache = make_trimmable_cache(model)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    kv = BatchKV(layout_of(cache))
    kv.add_row(cache, 5)
    dtype_bytes = model.model.norm.weight.dtype.size
    assert kv.row_nbytes(100) == 100 * kv_bytes_per_token(runtime.target.config, dtype_bytes)


def test_mla_latent_cache_is_not_split_by_tp_but_gqa_is():
    mla = kv_bytes_per_token(KIMI_LIKE, 2)
    assert mla == 61 * (512 + 64) * 2  # 70 KB/token: the latent, not 64 heads x 2 x 128
    assert kv_bytes_per_token(KIMI_LIKE, 2, tp=2) == mla
    gqa = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token(gqa, 2) == 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(gqa, 2, tp=2) == kv_bytes_per_token(gqa, 2) // 2


def test_weight_sizes_from_headers(runtime_for):
    runtime = runtime_for("none")
    sizes = weight_sizes(runtime.target.path)
    from mlx.utils import tree_flatten

    in_memory = sum(v.nbytes for _, v in tree_flatten(runtime.target.model.parameters()))
    assert sizes.per_rank(1, float32=True) == in_memory  # bf16 files, float32 on CPU
    assert sizes.per_rank(2) < sizes.total


def test_budget_accounting():
    budget = KVBudget(1000, 10_000, "test")
    assert budget.fits(budget.need(8), held_elsewhere=0)
    budget.reserved = 6000
    assert not budget.fits(budget.need(5), held_elsewhere=0)
    assert not budget.fits(budget.need(3), held_elsewhere=2000)


@pytest.mark.slow
def test_admission_waits_for_memory_and_refuses_what_never_fits():
    runtime = runtime_with("tiny", kv__kv_budget_mb=2, kv__prefix_cache_mb=0)
    with RunningServer(runtime, max_batch=8) as server:
        per_token = server.engine.engine.scheduler.memory.bytes_per_token
        body = {"prompt": "def f(x):", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda _: requests.post(server.url + "/v1/completions", json=body,
                                                              timeout=120), range(3)))
        assert all(r.status_code == 200 for r in replies)
        assert all(r.json()["usage"]["completion_tokens"] == 150 for r in replies)
        status = requests.get(server.url + "/v1/status", timeout=10).json()["engine"]
        # ~1.3 MB each at full length: a 2 MB budget runs them one at a time, never together.
        assert status["batch_size_histogram"].keys() == {"1"}
        assert status["admission"]["admission_waits"] >= 1
        assert status["admission"]["kv_reserved_bytes"] == 0 and status["running"] == 0
        too_big = requests.post(server.url + "/v1/completions", timeout=30,
                                json={"prompt": "x", "max_tokens": 1900})
        assert too_big.status_code == 400
        error = too_big.json()["error"]
        assert error["param"] == "max_tokens" and "KV budget is 2.0 MB" in error["message"]
        runtime = server.runtime
        prompt = len(runtime.tokenizer.encode("x", add_special_tokens=False))
        k = runtime.profile.speculative.num_draft_tokens
        need = (prompt + 1900 + k + 1) * runtime.kv_bytes_per_token(runtime.method)  # full length, proposer too
        assert need > 1902 * per_token
        assert f"needs {need / 2**20:.1f} MB of KV" in error["message"], error["message"]
        assert requests.get(server.url + "/health", timeout=5).json()["status"] == "ok"
        metrics = requests.get(server.url + "/metrics", timeout=5).text
        assert 'macspec_memory_bytes{kind="kv_budget"} 2.097152e+06' in metrics
