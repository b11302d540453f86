"""Disk prefix store: round trip, restart index from headers, LRU bound, damaged files."""

import logging

import mlx.core as mx
import pytest

from macspec.kv.disk import MIN_TOKENS, DiskPrefixStore


def _layers(length, mla=False):
    if mla:  # MLA/CacheList leaves: a latent and a rope-key array of other widths
        return [(mx.random.normal((1, 1, length, 16)), mx.random.normal((1, 1, length, 4)))
                for _ in range(2)]
    return [(mx.random.normal((1, 2, length, 8)), mx.random.normal((1, 2, length, 8)))
            for _ in range(3)]


@pytest.mark.parametrize("mla", [False, True])
def test_round_trip_survives_restart(tmp_path, mla):
    tokens = list(range(140))
    layers, states = _layers(140, mla), mx.random.normal((140, 32))
    DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30).save(tokens, layers, states)
    store = DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30)  # a restart: index from headers
    shared, entry = store.longest(tokens[:130] + [999, 1000])  # shares part of the entry
    assert shared == 130 and entry.tokens == tuple(tokens)
    got_layers, got_states = store.load(entry)
    for leaf, got in zip(layers, got_layers):
        for a, b in zip(leaf, got):
            assert mx.array_equal(a, b)
    assert mx.array_equal(states, got_states)
    assert store.as_dict()["loads"] == 1


def test_other_model_or_shard_is_invisible(tmp_path):
    DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30).save(list(range(130)), _layers(130))
    assert DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30).longest(list(range(132)))[0] == 130
    assert DiskPrefixStore(tmp_path, "d2", "0/1", 1 << 30).longest(list(range(132))) == (0, None)
    assert DiskPrefixStore(tmp_path, "d1", "0/2", 1 << 30).longest(list(range(132))) == (0, None)


def test_eviction_keeps_the_bound(tmp_path):
    store = DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30)
    store.save(list(range(130)), _layers(130))
    one = store.nbytes
    store.max_bytes = int(one * 2.5)
    for start in range(1, 6):
        store.save(list(range(start * 1000, start * 1000 + 130)), _layers(130))
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk <= store.max_bytes and store.evictions >= 3


def test_damaged_file_warns_and_is_deleted(tmp_path, caplog):
    tokens = list(range(200))
    DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30).save(tokens, _layers(200))
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    store = DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30)
    _, entry = store.longest(tokens + [1])
    with caplog.at_level(logging.WARNING):
        assert store.load(entry) is None
    assert str(path) in caplog.text and not path.exists() and store.corrupt == 1


def test_garbage_header_is_dropped_at_start(tmp_path, caplog):
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with caplog.at_level(logging.WARNING):
        store = DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30)
    assert store.corrupt == 1 and not (tmp_path / "junk.safetensors").exists()


def test_short_prefixes_stay_in_ram_and_longer_entries_replace_their_prefixes(tmp_path):
    store = DiskPrefixStore(tmp_path, "d1", "0/1", 1 << 30)
    store.save(list(range(MIN_TOKENS - 1)), _layers(MIN_TOKENS - 1))
    assert not store.entries  # cheaper to prefill again than to write and read
    store.save(list(range(150)), _layers(150))
    store.save(list(range(300)), _layers(300))  # the next turn of the same conversation
    assert [len(e.tokens) for e in store.entries.values()] == [300]
    assert len(list(tmp_path.iterdir())) == 1
