"""A drafter's own output vocabulary: a subset of the target's tokens, as EAGLE-3 publishes it.

Draft id i scores target id i + d2t[i] (`d2t`, offsets, in the weights file). A head over 8k of
SmolLM2's 49k tokens reads a sixth of the output rows per drafted position and trains on a
sixth of the softmax; tokens outside it are never drafted (their logits are -inf).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..errors import ModelLoadError


def target_ids(d2t: mx.array | None, size: int, vocab_size: int, target_vocab: int, what: str) -> mx.array:
    """The target ids of a draft vocabulary of `size` from its `d2t` offsets (none: the whole
    vocabulary, which `size` must then be), refused with the reason where they cannot be."""
    if d2t is None:
        if size != vocab_size:
            raise ModelLoadError(f"{what}: draft_vocab_size {size} < vocab_size {vocab_size} "
                                 "but no d2t maps draft ids to target ids")
        return mx.arange(size, dtype=mx.int32)
    if d2t.shape != (size,):
        raise ModelLoadError(f"{what}: d2t has shape {tuple(d2t.shape)}; draft_vocab_size is {size}")
    ids = d2t.astype(mx.int64) + mx.arange(size, dtype=mx.int64)
    low, high = int(ids.min().item()), int(ids.max().item())
    if low < 0 or high >= target_vocab:
        raise ModelLoadError(f"{what}: d2t maps draft ids onto target ids {low}..{high}, "
                             f"outside the target's vocabulary of {target_vocab}")
    if len(set(ids.tolist())) != size:
        raise ModelLoadError(f"{what}: d2t maps two draft ids onto one target id")
    return ids.astype(mx.int32)


def d2t(ids: mx.array) -> mx.array:
    """The offsets saved for target `ids` (draft id i -> ids[i])."""
    ids = np.array(ids).astype(np.int64)
    return mx.array(ids - np.arange(ids.shape[0]))


def to_target_vocab(logits: mx.array, ids: mx.array, width: int) -> mx.array:
    """Draft-vocabulary logits [..., N] -> [..., width], -inf outside the draft vocabulary."""
    full = mx.full((*logits.shape[:-1], width), -mx.inf, dtype=logits.dtype)
    return mx.put_along_axis(full, mx.broadcast_to(ids, logits.shape), logits, axis=-1)
