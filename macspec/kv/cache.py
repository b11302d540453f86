"""KV caches that speculation can roll back, and the small operations on them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..errors import UnsupportedModelError


def make_trimmable_cache(model: nn.Module) -> list:
    """A per-layer cache where every entry can drop its last n positions.

    Sliding-window layers get a full KVCache: the model still masks by its window, but the
    rejected positions stay recoverable. Recurrent state (SSM, linear attention) cannot be
    rolled back, so refuse it by name rather than corrupt it.
    """
    cache = make_prompt_cache(model)
    out = []
    for index, layer_cache in enumerate(cache):
        if isinstance(layer_cache, RotatingKVCache):
            layer_cache = KVCache()
        elif not _is_trimmable_type(layer_cache):
            raise UnsupportedModelError(
                f"layer {index} uses {type(layer_cache).__name__}, which cannot be rolled back; "
                "speculative decoding needs trimmable (attention KV) caches; use --method none"
            )
        out.append(layer_cache)
    return out


def _is_trimmable_type(layer_cache) -> bool:
    if hasattr(layer_cache, "caches"):  # CacheList of sub-caches
        return all(_is_trimmable_type(c) for c in layer_cache.caches)
    return callable(getattr(layer_cache, "trim", None)) and layer_cache.is_trimmable()


def trim(cache: list, num_tokens: int) -> None:
    if num_tokens > 0:
        for layer_cache in cache:
            layer_cache.trim(num_tokens)


def eval_cache(cache: list) -> None:
    mx.eval(cache_arrays(cache))


def first_divergence(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def leaves(cache: list) -> list:
    """Per-layer caches flattened: a CacheList (an MLA latent cache beside a DSA indexer's, as
    in GLM-5) contributes its sub-caches, in order. Batched and single-row caches flatten alike."""
    out = []
    for layer_cache in cache:
        out.extend(getattr(layer_cache, "caches", None) or [layer_cache])
    return out


def cache_arrays(cache: list) -> list:
    """Every array a cache holds (for mx.eval)."""
    return [c.state for c in leaves(cache)]
