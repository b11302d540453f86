"""KV cache for a batch of running sequences, each with its own length.

Rows are left-aligned in per-layer buffers [B, H, capacity, D]; row i's committed tokens fill
positions [0, length_i). A forward writes its N new positions at [length_i, length_i + N) and
the mask hides everything past each row's own window, so rolling back rejected drafts is just
not advancing length_i (dead slots are overwritten by the next step). Padding sits at the end
of each row, which keeps a row's attention sums identical to an unpadded forward.
"""

from __future__ import annotations

import mlx.core as mx

from .cache import leaves

CAPACITY_STEP = 256  # buffers grow along the sequence axis in chunks of this many positions


class BatchLayerCache:
    """The per-layer object mlx-lm attention sees: offset, update_and_fetch, make_mask."""

    def __init__(self, owner: "BatchKV"):
        self.owner = owner
        self.buffers: tuple[mx.array, ...] | None = None  # (keys, values) [B, H, cap, D]

    @property
    def offset(self) -> mx.array:
        return self.owner.offsets

    @property
    def state(self):
        return self.buffers or ()

    @property
    def keys(self):  # mlx-lm's pipeline code may read or set .keys; expose the key buffer
        return None if self.buffers is None else self.buffers[0]

    @keys.setter
    def keys(self, value):
        if self.buffers is not None:
            self.buffers = (value, *self.buffers[1:])

    @property
    def values(self):
        return None if self.buffers is None else self.buffers[1]

    @values.setter
    def values(self, value):  # a DSA indexer resets its unused values this way
        if self.buffers is not None:
            self.buffers = (self.buffers[0], value)

    def is_trimmable(self) -> bool:
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        owner = self.owner
        idx = owner.write_index  # [B, 1, N, 1] absolute positions of the new entries
        out = []
        for buf, new in zip(self.buffers, (keys, values)):
            index = mx.broadcast_to(idx, new.shape)
            out.append(mx.put_along_axis(buf, index, new.astype(buf.dtype), axis=2))
        self.buffers = tuple(out)
        span = owner.span
        return tuple(b[:, :, :span] for b in self.buffers)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        owner = self.owner
        if owner.num_rows == 1 and owner.window == 1 and window_size is None:
            return None  # one row, one query: every cached key is visible (as mlx-lm decodes)
        return owner.mask(window_size)


class BatchCacheList:
    """mlx-lm's CacheList, batched: one BatchLayerCache per sub-cache, all sharing the rows."""

    def __init__(self, owner: "BatchKV", count: int):
        self.caches = tuple(BatchLayerCache(owner) for _ in range(count))

    def __getitem__(self, index: int) -> BatchLayerCache:
        return self.caches[index]

    @property
    def state(self):
        return [c.state for c in self.caches]

    def is_trimmable(self) -> bool:
        return True


class BatchKV:
    def __init__(self, layout: list[int]):
        """`layout`: per layer, 0 for a plain KV cache or the sub-cache count of a CacheList
        (see `layout_of`)."""
        self.layers = [BatchCacheList(self, n) if n else BatchLayerCache(self) for n in layout]
        self.leaves: list[BatchLayerCache] = leaves(self.layers)
        self.lengths: list[int] = []
        self.capacity = 0
        self.window = 0
        self.offsets = mx.array([], dtype=mx.int32)
        self.write_index: mx.array | None = None
        self.span = 0

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def add_row(self, row_cache: list, length: int) -> int:
        """Append a sequence whose (single-row) mlx-lm caches hold `length` positions."""
        self._ensure_capacity(length)
        for layer, source in zip(self.leaves, leaves(row_cache)):
            rows = tuple(self._padded(a[:, :, :length]) for a in source.state[:2])
            if layer.buffers is None:
                layer.buffers = rows
            else:
                layer.buffers = tuple(mx.concatenate([b, r]) for b, r in zip(layer.buffers, rows))
        self.lengths.append(length)
        self._eval()
        return len(self.lengths) - 1

    def remove_row(self, index: int) -> None:
        del self.lengths[index]
        if not self.lengths:  # drop the buffers so memory returns to the baseline
            for layer in self.leaves:
                layer.buffers = None
            self.capacity = 0
            return
        keep = mx.array([i for i in range(len(self.lengths) + 1) if i != index])
        for layer in self.leaves:
            layer.buffers = tuple(mx.take(b, keep, axis=0) for b in layer.buffers)
        self._shrink_if_sparse()
        self._eval()

    def export_row(self, index: int, length: int) -> list[tuple[mx.array, ...]]:
        """Copies of row `index`'s first `length` positions, per leaf cache (for the prefix cache)."""
        out = [tuple(mx.contiguous(b[index:index + 1, :, :length]) for b in layer.buffers)
               for layer in self.leaves]
        mx.eval(out)
        return out

    def row_nbytes(self, length: int) -> int:
        """Bytes one row's first `length` positions take (every row has the same layout)."""
        per_position = sum(b.nbytes // (b.shape[0] * b.shape[2])
                           for layer in self.leaves if layer.buffers for b in layer.buffers)
        return per_position * length

    def begin(self, window: int) -> None:
        """Prepare a forward of `window` new positions for every row."""
        self.window = window
        self._ensure_capacity(max(self.lengths) + window)
        lengths = mx.array(self.lengths, dtype=mx.int32)
        self.offsets = lengths
        self.write_index = (lengths[:, None] + mx.arange(window, dtype=mx.int32))[:, None, :, None]
        self.span = max(self.lengths) + window

    def advance(self, index: int, num_tokens: int) -> None:
        self.lengths[index] += num_tokens

    def mask(self, window_size: int | None) -> mx.array:
        """[B, 1, N, span]: query j of row i (position length_i + j) sees keys <= itself."""
        query_pos = self.offsets[:, None] + mx.arange(self.window, dtype=mx.int32)  # [B, N]
        key_pos = mx.arange(self.span, dtype=mx.int32)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        if window_size is not None:
            mask = mask & (key_pos[None, None, :] > query_pos[:, :, None] - window_size)
        return mask[:, None]

    def _padded(self, a: mx.array) -> mx.array:
        pad = self.capacity - a.shape[2]
        return mx.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad > 0 else a

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_capacity = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
        grow = new_capacity - self.capacity
        for layer in self.leaves:
            if layer.buffers is not None:
                layer.buffers = tuple(mx.pad(b, [(0, 0), (0, 0), (0, grow), (0, 0)])
                                      for b in layer.buffers)
        self.capacity = new_capacity

    def _shrink_if_sparse(self) -> None:
        # A long request that left should not pin its capacity for the short ones still running.
        needed = -(-(max(self.lengths) + CAPACITY_STEP) // CAPACITY_STEP) * CAPACITY_STEP
        if needed * 2 <= self.capacity:
            for layer in self.leaves:
                layer.buffers = tuple(mx.contiguous(b[:, :, :needed]) for b in layer.buffers)
            self.capacity = needed

    def _eval(self) -> None:
        mx.eval([layer.buffers for layer in self.leaves if layer.buffers is not None])

    def nbytes(self) -> int:
        return sum(b.nbytes for layer in self.leaves if layer.buffers for b in layer.buffers)


def layout_of(cache: list) -> list[int]:
    """The BatchKV layout matching a model's single-row cache (see BatchKV)."""
    return [len(c.caches) if hasattr(c, "caches") else 0 for c in cache]
