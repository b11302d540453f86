"""Small CPU matmuls run at the row count measured fastest (models/row_padding.py): the choice
from timings, the same values padded or not, lossless greedy decoding through the engine with
rows padded, and a machine's table kept for the next start."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from macspec.config import load_profile
from macspec.engine.launch import calibrated_engine
from macspec.engine.runtime import Runtime
from macspec.models import row_padding
from macspec.sampling import SamplingParams

PADS = [0, 1] + [-(-rows // 8) * 8 for rows in range(2, 65)]  # 2-8 rows at 8, 9-16 at 16...: this machine's choice


def test_each_count_runs_at_the_fastest_count_at_or_above_it_when_that_pays():
    # OpenBLAS on this machine, 2 threads: multiples of 8 fast, their tails slow; one row fastest.
    seconds = {1: 28.1, 2: 33.2, 3: 35.6, 4: 33.7, 5: 42.6, 6: 49.7, 7: 40.4, 8: 30.0, 9: 38.0,
               10: 44.7, 11: 45.5, 12: 45.5, 13: 53.8, 14: 60.1, 15: 50.7, 16: 39.6}
    assert row_padding.choose(seconds) == [0, 1, 8, 8, 8, 8, 8, 8, 8, 9, 16, 16, 16, 16, 16, 16, 16]
    rising = {rows: 10.0 + rows for rows in range(1, 9)}  # a library with no slow tails
    assert row_padding.choose(rising) == list(range(9))
    noise = {rows: 10.0 if rows % 4 else 9.8 for rows in range(1, 9)}  # 2 % faster: noise, not a gain
    assert row_padding.choose(noise) == list(range(9))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 48)
        self.embed = nn.Embedding(100, 64)
        self.quantized = nn.QuantizedLinear(64, 64)


def test_padded_rows_give_the_values_and_shapes_of_the_rows_as_given():
    model = _Model()
    x = mx.random.normal((3, 2, 64))  # 6 rows: run at 8
    expected = model.proj(x), model.embed.as_linear(x), model.quantized(x)
    with row_padding.fixed(PADS[:17]):
        assert row_padding.route(model) == 2  # the float layers; a quantized one's kernel is MLX's own
        assert row_padding.route(model) == 0  # once
        got = model.proj(x), model.embed.as_linear(x), model.quantized(x)
    for want, have in zip(expected, got):
        assert have.shape == want.shape
        assert mx.allclose(have, want, atol=1e-5).item()
    assert model.embed(mx.array([[1, 2]])).shape == (1, 2, 64)  # still an embedding


@pytest.mark.slow
def test_greedy_decoding_with_rows_padded_stays_lossless(prompts):
    """Every method's greedy rows, batched (rows × windows of 2-16 products run padded), equal
    plain decoding's on the same padded runtime."""
    profile = load_profile("tiny")
    profile.speculative.method = "draft"
    methods = ("draft", "mtp", "eagle3", "ngram")
    with row_padding.fixed(PADS):
        runtime = Runtime.load(profile)
        for method in methods[1:]:
            runtime.ensure_method(method)
        assert all(isinstance(layer, row_padding.PaddedLinear)
                   for _, layer in runtime.target.model.named_modules() if isinstance(layer, nn.Linear))
        engine = calibrated_engine(runtime, max_batch=8)
        rows = prompts[:8]
        plain = engine.generate(rows, [SamplingParams()] * len(rows), 32, method="none")
        spec = engine.generate(rows, [SamplingParams()] * len(rows), 32, num_draft=3,
                               method=[methods[i % len(methods)] for i in range(len(rows))])
        assert engine.status()["row_padding"] == {"on": True, "padded": {str(r): PADS[r] for r in range(2, 65)
                                                                       if PADS[r] != r}}
    for i, (p, s) in enumerate(zip(plain, spec)):
        assert s.error is None, s.error
        assert s.tokens == p.tokens, f"row {i} ({methods[i % len(methods)]}) diverged"
    assert sum(s.stats["spec"]["drafted"] for s in spec) > 0


def test_a_machine_measures_its_table_once(monkeypatch):
    weights = [mx.random.normal((16, 8)), mx.random.normal((8, 16)), mx.random.normal((16, 8))]
    table = row_padding._kept_or_measured(weights)
    assert len(table) == row_padding.TOP_ROWS + 1 and all(to >= rows for rows, to in enumerate(table))

    def timed_again(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(row_padding, "measure", timed_again)
    assert row_padding._kept_or_measured(weights) == table
