"""A uniform view of an mlx-lm causal LM: embeddings, final normed hidden state, logits.

Speculation needs the hidden state the logits are computed from (MTP input), and mlx-lm
models expose it as `model.model(...)`; the head is `lm_head` or the tied embeddings.
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
        """-> (logits, hidden) in one pass."""
        h = self.hidden(tokens, cache)
        return self.logits(h), h

    def hidden_is_final(self) -> bool:
        """Does hidden -> logits reproduce the full forward? MTP needs the exact hidden state."""
        return self.matches_full_forward(mx.array([[0, 1, 2]]))

    def matches_full_forward(self, tokens: mx.array) -> bool:
        """True when hidden->logits reproduces model(tokens) (no soft-capping etc. in between)."""
        direct = self.model(tokens)
        via_hidden, _ = self.forward(tokens)
        return bool(mx.allclose(direct, via_hidden, atol=1e-3, rtol=1e-3).item())
