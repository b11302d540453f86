"""A uniform view of an mlx-lm causal LM: embeddings, final normed hidden state, logits.

Speculation needs the hidden state the logits are computed from (MTP input), and mlx-lm
models expose it as `model.model(...)`; the head is `lm_head` or the tied embeddings. An
EAGLE-3 head also reads intermediate layers' outputs: `tap_layers` makes those layers keep
their output during the same forward, and `forward` returns them beside the final state.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class ModelView:
    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = model.model
        # Multimodal wrappers (Kimi K2.5) keep the head on their language model.
        self.head_owner = getattr(model, "language_model", model)
        self.tied = not hasattr(self.head_owner, "lm_head")

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def hidden(self, tokens: mx.array, cache=None) -> mx.array:
        return self.inner(tokens, cache=cache)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.inner.embed_tokens.as_linear(hidden)
        return self.head_owner.lm_head(hidden)

    def forward(self, tokens: mx.array, cache=None) -> tuple[mx.array, mx.array]:
        """-> (logits, states) in one pass: states = the final hidden state, then the tapped
        layers' outputs where layers are tapped ([..., H · (1 + taps)])."""
        h = self.hidden(tokens, cache)
        return self.logits(h), self.states(h)

    @property
    def states_width(self) -> int:
        """The width of `states`: the hidden size times (1 + tapped layers)."""
        taps = getattr(self.model, TAPS_ATTR, None)
        return int(self.inner.norm.weight.shape[0]) * (1 + (len(taps.layers) if taps else 0))

    def states(self, hidden: mx.array) -> mx.array:
        """The final hidden state of the forward just run, with the tapped layers' outputs."""
        taps = getattr(self.model, TAPS_ATTR, None)
        return hidden if taps is None else taps.joined(hidden)

    def hidden_is_final(self) -> bool:
        """Does hidden -> logits reproduce the full forward? MTP needs the exact hidden state."""
        return self.matches_full_forward(mx.array([[0, 1, 2]]))

    def matches_full_forward(self, tokens: mx.array) -> bool:
        """True when hidden->logits reproduces model(tokens) (no soft-capping etc. in between)."""
        direct = self.model(tokens)
        via_hidden, _ = self.forward(tokens)
        return bool(mx.allclose(direct, via_hidden, atol=1e-3, rtol=1e-3).item())


TAPS_ATTR = "_macspec_taps"


class Taps:
    """Target layers whose outputs a forward keeps (a plain object: not part of the module
    tree, so parameters and sharding never see it)."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self.outputs: dict[int, mx.array] = {}

    def joined(self, hidden: mx.array) -> mx.array:
        parts = [self.outputs[i] for i in self.layers]  # a layer may be read twice
        self.outputs = {}
        return mx.concatenate([hidden, *(p.astype(hidden.dtype) for p in parts)], axis=-1)


def tapped_columns(states: mx.array | None, final_width: int, width: int) -> mx.array | None:
    """The tapped layers' `width` columns of `states` (after the final state); None for states
    kept before the layers were tapped (a prefix entry made by another method)."""
    if states is None or states.shape[-1] < final_width + width:
        return None
    return states[..., final_width:final_width + width]


def join_states(blocks: list[mx.array]) -> mx.array:
    """Blocks of one row's states, oldest first, joined once, when read: a row keeps one block a
    step (a lazy join frees none of them, and joining the history every 16 steps copied it again
    each time: reading 16 rows' states after 2,000 steps took 10.8 s, in one join 0.6 s). Taps
    installed mid-flight (a request loaded an EAGLE-3 head) widen later blocks; the row keeps the
    width all blocks share."""
    if len(blocks) == 1:
        return blocks[0]
    width = min(b.shape[-1] for b in blocks)
    return mx.concatenate([b[..., :width] if b.shape[-1] > width else b for b in blocks])


def tap_layers(model: nn.Module, layers: tuple[int, ...]) -> Taps:
    """Make `layers` (indices into the decoder stack) keep their outputs on every forward; the
    layer objects get a subclass, so their weights and names stay as they are. Idempotent for
    the same layers; other layers than already tapped are refused (one set per target)."""
    existing = getattr(model, TAPS_ATTR, None)
    if existing is not None:
        if existing.layers != tuple(layers):
            raise ValueError(f"the target's layers {existing.layers} are tapped already; "
                             f"{tuple(layers)} asked")
        return existing
    taps = Taps(tuple(layers))
    stack = ModelView(model).inner.layers
    for index in sorted(set(taps.layers)):
        layer = stack[index]
        cls = type(layer)
        layer.__class__ = type(f"Tapped{cls.__name__}", (cls,), {"__call__": _tapped_call})
        object.__setattr__(layer, "_macspec_tap", (taps, index))
    object.__setattr__(model, TAPS_ATTR, taps)
    return taps


def _tapped_call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    taps, index = self._macspec_tap
    taps.outputs[index] = out[0] if isinstance(out, tuple) else out
    return out
