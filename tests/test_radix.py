"""The radix index answers as the linear scan it replaced: the longest shared prefix."""

from __future__ import annotations

import random

from macspec.kv.cache import first_divergence
from macspec.kv.prefix import PrefixCache
from macspec.kv.radix import RadixTree


def _linear(keys, prompt) -> int:
    return max((first_divergence(k, prompt) for k in keys), default=0)


def test_longest_match_equals_a_linear_scan_under_inserts_and_removes():
    rng = random.Random(0)
    tree, keys = RadixTree(), set()
    base = [rng.randrange(4) for _ in range(40)]
    for step in range(600):
        cut = rng.randrange(len(base))
        key = tuple(base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(1, 12))])
        if key in keys and rng.random() < 0.5:
            tree.remove(key)
            keys.discard(key)
        elif key not in keys:
            tree.insert(key)
            keys.add(key)
        prompt = base[:rng.randrange(len(base))] + [rng.randrange(4) for _ in range(5)]
        length, found = tree.longest_match(prompt)
        assert length == _linear(keys, prompt), step
        if length:
            assert first_divergence(found, prompt) == length and found in keys
        on_path = set(tree.keys_on_path(key))
        assert on_path == {k for k in keys if key[:len(k)] == k}


def test_prefix_cache_drops_covered_entries_and_evicts_lru():
    cache = PrefixCache(max_bytes=100)
    first, _ = cache.store([1, 2, 3, 4, 5], 40)
    second, dropped = cache.store([1, 2, 3, 4, 5, 6, 7], 40)
    assert dropped == [first]  # the longer one covers it
    assert cache.lookup([1, 2, 3, 4, 5, 6, 9, 9]) == (6, second)
    third, dropped = cache.store([9, 9, 9, 9, 9], 40)
    other, dropped = cache.store([8, 8, 8, 8, 8], 40)
    assert dropped == [second]  # least recently used goes first
    assert cache.lookup([1, 2, 3, 4, 5]) == (0, None)
    assert cache.lookup([9, 9, 9, 9, 9, 1]) == (5, third)


def test_a_row_needing_states_takes_the_entry_that_kept_them():
    """Sampled answers to one prompt are stored side by side; only one came from an MTP row and
    kept the head's states. An MTP row must take that one, not whichever the tree reaches first."""
    cache = PrefixCache(max_bytes=10_000)
    prompt = list(range(10, 40))
    plain = [cache.store(prompt + [1, answer, 2, 3], 10)[0] for answer in (5, 6, 7)]
    with_states, _ = cache.store(prompt + [1, 8, 2], 10)
    kept = {with_states: len(prompt) + 3}
    assert cache.lookup(prompt + [99], usable=lambda entry: kept.get(entry, 0)) == (len(prompt), with_states)
    assert cache.lookup(prompt + [1, 8, 2, 4], usable=lambda entry: kept.get(entry, 0)) == (len(prompt) + 3, with_states)
    # Shorter usable prefixes still count: an ancestor that kept states for part of the prompt.
    kept = {plain[0]: 12}
    assert cache.lookup(prompt + [99], usable=lambda entry: kept.get(entry, 0)) == (12, plain[0])
    assert cache.lookup(prompt + [99], usable=lambda entry: 0) == (0, None)
