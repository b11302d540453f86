"""Multi-token-prediction head in the DeepSeek-V3 / GLM checkpoint layout.

Layer `model.layers.{N}` (N = num_hidden_layers) holds `enorm`, `hnorm`, `eh_proj`, one decoder
block (`self_attn`, `mlp`, `*_layernorm`), `shared_head.norm` and optionally `embed_tokens` and
`shared_head.head` (shared with the target when absent). Input at position t: the target's
final *normed* hidden state h_t and the embedding of token t+1; output: logits for token t+2
and the head's own hidden state, which chains the head for k > 1.

A head may predict over a subset of the target's vocabulary (`shared_head.vocab_ids`; its
`shared_head.head` holds those rows of the target's output head unless the file has its own):
a draft step then reads a fraction of the target's LM head. Its logits are scattered into the target's vocabulary with -inf elsewhere, so proposers see the
usual width and never draft outside the subset; the target's verification keeps it lossless.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from . import draft_vocab

HEAD_KEYS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, vocab_size: int | None,
                 vocab_ids: mx.array | None = None):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if vocab_size is not None:
            self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        if vocab_ids is not None:  # row i of `head` scores target token vocab_ids[i]
            self.vocab_ids = vocab_ids.astype(mx.int32)
            self.freeze(keys=["vocab_ids"], recurse=False)


class MTPHead(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float,
                 own_embed_vocab: int | None = None, own_head_vocab: int | None = None,
                 vocab_ids: mx.array | None = None, target_vocab: int | None = None):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        if vocab_ids is not None:
            if target_vocab is None:
                raise ValueError("a head over a vocabulary subset needs the target's vocab size")
            own_head_vocab = vocab_ids.shape[0]
        self.shared_head = SharedHead(hidden_size, eps, own_head_vocab, vocab_ids)
        self.target_vocab = target_vocab
        if own_embed_vocab is not None:
            self.embed_tokens = nn.Embedding(own_embed_vocab, hidden_size)

    @property
    def has_subset_vocab(self) -> bool:
        return "vocab_ids" in self.shared_head

    def __call__(self, tokens: mx.array, prev_hidden: mx.array, target, cache=None):
        """tokens [B, L] (token t+1), prev_hidden [B, L, H] (state at t) -> (logits over the
        target's vocabulary, hidden)."""
        h = self.hidden(tokens, prev_hidden, target, cache)
        return self.logits(h, target), h

    def hidden(self, tokens: mx.array, prev_hidden: mx.array, target, cache=None) -> mx.array:
        """The block's output states [B, L, H] alone: logits are read where a draft is made."""
        h, mask = self._block_input(tokens, prev_hidden, target, cache)
        return self.block(h, mask, cache)

    def logits(self, h: mx.array, target) -> mx.array:
        """Output states -> logits over the target's vocabulary."""
        logits = self._own_logits(h, target)
        return self.to_target_vocab(logits) if self.has_subset_vocab else logits

    def _own_logits(self, h: mx.array, target) -> mx.array:
        """Output states -> logits over the head's own vocabulary (the target's, shared, if none)."""
        normed = self.shared_head.norm(h)
        return self.shared_head.head(normed) if "head" in self.shared_head else target.logits(normed)

    def to_target_vocab(self, logits: mx.array) -> mx.array:
        """Subset logits [..., N] -> [..., target vocab], -inf outside the subset."""
        return draft_vocab.to_target_vocab(logits, self.shared_head.vocab_ids, self.target_vocab)

    def forward(self, tokens: mx.array, prev_hidden: mx.array, target, cache=None):
        """As __call__, with the logits over the head's own vocabulary (training)."""
        h = self.hidden(tokens, prev_hidden, target, cache)
        return self._own_logits(h, target), h

    def feed(self, tokens: mx.array, prev_hidden: mx.array, target, cache) -> None:
        """Write these positions' keys and values into `cache` without their outputs: the block's
        attention alone, as the block calls it (its MLP, an MoE's experts, is skipped)."""
        h, mask = self._block_input(tokens, prev_hidden, target, cache)
        self.block.self_attn(self.block.input_layernorm(h), mask, cache)

    def _block_input(self, tokens: mx.array, prev_hidden: mx.array, target, cache):
        embed = self.embed_tokens if "embed_tokens" in self else target.embed
        x = mx.concatenate([self.enorm(embed(tokens)), self.hnorm(prev_hidden)], axis=-1)
        h = self.eh_proj(x)
        # MLA blocks need an array; a CacheList (DSA indexer beside the latent) masks by its first.
        mask = create_attention_mask(h, cache[0] if hasattr(cache, "caches") else cache,
                                     return_array=True)
        return h, mask

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


def output_rows(view, ids: mx.array) -> mx.array:
    """The target's output-head rows [N, H] for token `ids`, dequantized where quantized."""
    if view.tied:
        return view.embed(ids)  # a QuantizedEmbedding dequantizes the rows it returns
    lm_head = view.head_owner.lm_head
    if "scales" not in lm_head:
        return lm_head.weight[ids]
    biases = lm_head.get("biases")
    return mx.dequantize(lm_head.weight[ids], lm_head.scales[ids],
                         None if biases is None else biases[ids],
                         group_size=lm_head.group_size, bits=lm_head.bits)


def checkpoint_name(name: str, layer_index: int) -> str:
    """A head parameter or module name -> its name in the checkpoint (`model.layers.{N}.…`)."""
    name = name[len("block."):] if name.startswith("block.") else name
    return f"model.layers.{layer_index}.{name}"


def quantize_as_stored(head: MTPHead, params: dict[str, mx.array], quantization: dict,
                       layer_index: int) -> None:
    """Quantize the modules whose weights `params` holds quantized, as mlx-lm's load_model
    quantizes the target: the config's per-layer entry first, else the packing the stored
    shapes imply (the top-level group_size/bits where mlx-lm cannot infer it)."""
    try:
        from mlx_lm.utils import infer_quant_config
    except ImportError:  # mlx-lm < 0.31: the config's defaults
        infer_quant_config = None
    defaults = {"group_size": quantization.get("group_size", 64),
                "bits": quantization.get("bits", 4), "mode": quantization.get("mode", "affine")}

    def predicate(path: str, module: nn.Module):
        override = quantization.get(checkpoint_name(path, layer_index))
        if override is not None:
            return override
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in params:
            return False
        return infer_quant_config(path, module, params) if infer_quant_config else defaults

    nn.quantize(head, **defaults, class_predicate=predicate)


def quantized_modules(head: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in head.named_modules() if "scales" in m and hasattr(m, "bits")}


def dequantized_params(head: nn.Module) -> dict[str, mx.array]:
    """The head's parameters with every quantized weight unpacked (for a float head)."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(head.parameters()))
    for name, m in quantized_modules(head).items():
        for part in ("scales", "biases", "global_scale"):
            params.pop(f"{name}.{part}", None)
        params[f"{name}.weight"] = mx.dequantize(
            m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits,
            mode=m.mode, dtype=m.scales.dtype if m.mode == "affine" else mx.bfloat16)
    return params


def head_summary(head: nn.Module) -> str:
    """Its own bytes and how they are stored, e.g. '1.2 MB, 4-bit g64 (affine)'."""
    from mlx.utils import tree_flatten

    size = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    kinds = sorted({f"{m.bits}-bit g{m.group_size} ({m.mode})" for m in quantized_modules(head).values()})
    return f"{size / 1e6:.1f} MB, " + (", ".join(kinds) if kinds else "not quantized")
