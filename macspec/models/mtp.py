"""Multi-token-prediction head in the DeepSeek-V3 / GLM checkpoint layout.

Layer `model.layers.{N}` (N = num_hidden_layers) holds `enorm`, `hnorm`, `eh_proj`, one decoder
block (`self_attn`, `mlp`, `*_layernorm`), `shared_head.norm` and optionally `embed_tokens` and
`shared_head.head` (shared with the target when absent). Input at position t: the target's
final *normed* hidden state h_t and the embedding of token t+1; output: logits for token t+2
and the head's own hidden state, which chains the head for k > 1.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

HEAD_KEYS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, vocab_size: int | None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if vocab_size is not None:
            self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class MTPHead(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float,
                 own_embed_vocab: int | None = None, own_head_vocab: int | None = None):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps, own_head_vocab)
        if own_embed_vocab is not None:
            self.embed_tokens = nn.Embedding(own_embed_vocab, hidden_size)

    def __call__(self, tokens: mx.array, prev_hidden: mx.array, target, cache=None):
        """tokens [B, L] (token t+1), prev_hidden [B, L, H] (state at t) -> (logits, hidden)."""
        embed = self.embed_tokens if "embed_tokens" in self else target.embed
        x = mx.concatenate([self.enorm(embed(tokens)), self.hnorm(prev_hidden)], axis=-1)
        h = self.eh_proj(x)
        # MLA blocks need an array; a CacheList (DSA indexer beside the latent) masks by its first.
        mask = create_attention_mask(h, cache[0] if hasattr(cache, "caches") else cache,
                                     return_array=True)
        h = self.block(h, mask, cache)
        normed = self.shared_head.norm(h)
        if "head" in self.shared_head:
            return self.shared_head.head(normed), h
        return target.logits(normed), h

    def layout_weights(self, layer_index: int) -> dict[str, mx.array]:
        """Flatten to checkpoint names: the block's parameters sit directly under the layer."""
        from mlx.utils import tree_flatten

        out = {}
        for name, value in tree_flatten(self.parameters()):
            name = name[len("block."):] if name.startswith("block.") else name
            out[f"model.layers.{layer_index}.{name}"] = value
        return out

    @staticmethod
    def from_layout(weights: dict[str, mx.array], layer_index: int) -> dict[str, mx.array]:
        """Checkpoint names -> this module's parameter names."""
        prefix = f"model.layers.{layer_index}."
        out = {}
        for key, value in weights.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            out[name if name.split(".")[0] in HEAD_KEYS else "block." + name] = value
        return out


def make_block_like(model: nn.Module, layer_index: int) -> nn.Module:
    """A fresh decoder block of the target's own class (MoE where the target's config says so)."""
    block_cls = type(model.layers[-1])
    params = list(inspect.signature(block_cls.__init__).parameters)[1:]
    args = model.args
    kwargs = {}
    if "layer_idx" in params:
        kwargs["layer_idx"] = layer_index
    first = params[0]
    kwargs[first] = args
    return block_cls(**kwargs)
