"""DFlash block drafters in the layout z-lab publishes them in (and SGLang, vLLM, mlx-vlm load).

A drafter directory holds `config.json` (`DFlashDraftModel`, Qwen3 keys for its shape,
`block_size`, `num_target_layers`, and `dflash_config.{target_layer_ids, mask_token_id}`) and
safetensors with `fc` (the tapped target layers' outputs, concatenated, K·H -> H), `hidden_norm`,
`layers.i.*` (Qwen3 decoder layers: q/k norms, no biases) and `norm`. It has no embeddings and
no output head: the target's are used. macspec's forged drafters may add a draft vocabulary as
EAGLE-3 publishes one (`draft_vocab_size`, `d2t`): the drafts are then scored with the target's
output rows for those tokens only (models/draft_vocab.py); drafters without it load unchanged.

Context: each committed position's tapped states become `ctx = hidden_norm(fc(states))`, and
every layer reads ctx only as extra keys and values (`k_norm(k_proj(ctx))` under RoPE at the
position's own index, `v_proj(ctx)`), kept in the drafter's cache. Drafting: one forward over a
block [b, M, ..., M] (b the last committed token at position s, M the mask token, positions
s..s+B-1), attending without a causal mask to the cached context and the whole block; the
outputs at block positions 1..B-1 are the drafts. The block's own keys are never kept.
(docs/architecture.md, "DFlash"; z-lab/dflash `model.py`, SGLang `models/dflash.py`.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from ..errors import ModelLoadError
from . import draft_vocab, row_padding
from .mtp import output_rows
from .window_attention import fast_attention

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]  # target layers whose outputs it reads (0-based)
    mask_token_id: int
    draft_vocab_size: int | None = None  # None: drafts score the target's whole vocabulary

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> "DFlashConfig":
        archs = raw.get("architectures") or []
        if not any("dflash" in a.lower() for a in archs):
            raise ModelLoadError(f"{where}: architectures {archs} is not a DFlash drafter "
                                 "(expected DFlashDraftModel)")
        nested = raw.get("dflash_config") or {}
        merged = {**nested, **{k: v for k, v in raw.items() if k != "dflash_config"}}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "block_size", "num_target_layers", "mask_token_id") if k not in merged]
        if missing:
            raise ModelLoadError(f"{where}: missing {', '.join(missing)}")
        layers, target_layers = merged["num_hidden_layers"], merged["num_target_layers"]
        ids = merged.get("target_layer_ids") or default_target_layers(target_layers, layers)
        if merged["block_size"] < 2:
            raise ModelLoadError(f"{where}: block_size {merged['block_size']} drafts nothing (at least 2)")
        heads = merged["num_attention_heads"]
        rope = merged.get("rope_parameters") or {}
        return cls(
            hidden_size=merged["hidden_size"], intermediate_size=merged["intermediate_size"],
            num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=merged.get("num_key_value_heads", heads),
            head_dim=merged.get("head_dim") or merged["hidden_size"] // heads,
            rms_norm_eps=merged.get("rms_norm_eps", 1e-6),
            rope_theta=merged.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=merged.get("rope_scaling"),
            max_position_embeddings=merged.get("max_position_embeddings", 32768),
            vocab_size=merged["vocab_size"], block_size=merged["block_size"],
            num_target_layers=target_layers, target_layer_ids=tuple(int(i) for i in ids),
            mask_token_id=int(merged["mask_token_id"]),
            draft_vocab_size=None if merged.get("draft_vocab_size") in (None, merged["vocab_size"])
            else int(merged["draft_vocab_size"]))


def default_target_layers(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """The reference's choice when a config names none: evenly from layer 1 to L - 3 (clamped
    into the stack for targets of under 4 layers, which the reference never meets)."""
    if num_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(min(max(round(1 + i * span / (num_layers - 1)), 0), num_target_layers - 1)
                 for i in range(num_layers))


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        dim, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, config.head_dim)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rope = initialize_rope(head_dim, config.rope_theta, False, config.rope_scaling,
                                    config.max_position_embeddings)

    def keys_values(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """x [B, N, D] at `positions` [B] (each row's first) -> keys, values [B, KV, N, hd]."""
        batch, length, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(batch, length, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(batch, length, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(keys, offset=positions), values

    def __call__(self, x: mx.array, positions: mx.array, cache, mask: mx.array) -> mx.array:
        """The block attends to the cached context and to itself (no causal mask); `cache` is
        a BatchLayerCache whose window the block is written into (and never kept), or a
        ContextKV."""
        batch, length, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(batch, length, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=positions)
        keys, values = cache.update_and_fetch(*self.keys_values(x, positions))
        out = fast_attention(queries, keys, values, self.scale, mask)  # CUDA: no cuDNN graph per shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, positions, cache, mask):
        h = x + self.self_attn(self.input_layernorm(x), positions, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class ContextKV:
    """Keys and values ahead of the block, in place of the serving cache: in training each
    block reads its sequence's whole context (the mask hides what lies past its anchor)."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.hidden_size * len(config.target_layer_ids), config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.vocab_ids: np.ndarray | None = None  # the draft vocabulary's target ids (None: all)

    @property
    def fused_width(self) -> int:
        return self.fc.weight.shape[1]

    def context(self, states: mx.array, positions: mx.array, caches) -> None:
        """Write the context entries of tapped `states` [B, N, K·H] at `positions` [B] into
        every layer's cache (the caller's BatchKV window)."""
        ctx = self.hidden_norm(self.fc(states))
        for layer, cache in zip(self.layers, caches):
            cache.update_and_fetch(*layer.self_attn.keys_values(ctx, positions))

    def __call__(self, embeds: mx.array, positions: mx.array, caches, mask: mx.array) -> mx.array:
        """The block's embeddings [B, N, H] -> its final normed states [B, N, H]."""
        h = embeds
        for layer, cache in zip(self.layers, caches):
            h = layer(h, positions, cache, mask)
        return self.norm(h)


@dataclass
class OutputHead:
    """What scores a drafter's states: the target's output head, or its rows for the drafter's
    draft vocabulary (gathered once, dequantized where the target is quantized)."""

    view: object  # the target's ModelView
    width: int  # the target's logits width
    ids: mx.array | None = None
    rows: mx.array | None = None

    @classmethod
    def of(cls, drafter: DFlashDrafter, view, width: int, dtype=None) -> "OutputHead":
        if drafter.vocab_ids is None:
            return cls(view, width)
        ids = mx.array(drafter.vocab_ids)
        rows = output_rows(view, ids)
        return cls(view, width, ids, rows.astype(dtype or rows.dtype))

    def draft(self, states: mx.array) -> mx.array:
        """Logits over the draft vocabulary (the target's whole one where there is none)."""
        if self.ids is None:
            return self.view.logits(states)
        return row_padding.padded(states, lambda x: x @ self.rows.T)  # a Linear's product, routed alike

    def target(self, states: mx.array) -> mx.array:
        """Logits over the target's vocabulary, -inf outside the draft vocabulary."""
        logits = self.draft(states)
        return logits if self.ids is None else draft_vocab.to_target_vocab(logits, self.ids, self.width)


def drafter_config(target_config: dict, layers: int = 2, block_size: int = 8, mask_token_id: int | None = None,
                   target_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None) -> DFlashConfig:
    """A drafter shaped like the target's layers (the reference's choice), reading
    `target_layers` of them (default: one per drafter layer, picked as the reference picks
    them); the mask token defaults to the last id; drafts score the whole vocabulary unless a
    `draft_vocab_size` is given."""
    text = target_config.get("text_config") or target_config
    depth, heads = text["num_hidden_layers"], text["num_attention_heads"]
    return DFlashConfig(
        hidden_size=text["hidden_size"], intermediate_size=text.get("intermediate_size", 4 * text["hidden_size"]),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=text.get("rope_theta", 10000.0),
        rope_scaling=None, max_position_embeddings=text.get("max_position_embeddings", 4096),
        vocab_size=text["vocab_size"], block_size=block_size, num_target_layers=depth,
        target_layer_ids=tuple(target_layers) if target_layers else default_target_layers(depth, layers),
        mask_token_id=text["vocab_size"] - 1 if mask_token_id is None else mask_token_id,
        draft_vocab_size=draft_vocab_size)


def published_config(config: DFlashConfig) -> dict:
    """config.json as z-lab writes it (Qwen3 keys, the DFlash ones top-level and nested)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": config.block_size,
            "num_target_layers": config.num_target_layers, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "intermediate_size": config.intermediate_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "rope_scaling": config.rope_scaling, "max_position_embeddings": config.max_position_embeddings,
            "vocab_size": config.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
            **({} if config.draft_vocab_size is None else {"draft_vocab_size": config.draft_vocab_size}),
            "dflash_config": {"mask_token_id": config.mask_token_id,
                              "target_layer_ids": list(config.target_layer_ids)}}


def save_drafter(drafter: DFlashDrafter, out: Path, dtype=mx.bfloat16, extra: dict | None = None) -> Path:
    """The drafter in the published layout: config.json + model.safetensors."""
    from mlx.utils import tree_flatten

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(drafter.parameters())}
    if drafter.vocab_ids is not None:
        weights["d2t"] = draft_vocab.d2t(drafter.vocab_ids)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps({**published_config(drafter.config), **(extra or {})}, indent=2) + "\n")
    return out


def random_drafter(out: Path, target_config: dict, seed: int = 0, vocab_ids=None, **shape) -> Path:
    """A drafter with random weights (tests; the seed replicas until one is trained), over the
    draft vocabulary `vocab_ids` where given."""
    mx.random.seed(seed)
    size = None if vocab_ids is None else len(vocab_ids)
    drafter = DFlashDrafter(drafter_config(target_config, draft_vocab_size=size, **shape))
    drafter.vocab_ids = None if vocab_ids is None else np.asarray(vocab_ids, dtype=np.int32)
    return save_drafter(drafter, out)


def read_config(path: Path) -> tuple[DFlashConfig, list[Path]]:
    """A drafter directory's config and its weight files (refused when either is missing)."""
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no {CONFIG_FILE} (a DFlash drafter directory has config.json "
                             "and model*.safetensors)")
    config = DFlashConfig.from_dict(json.loads(config_file.read_text()), str(path))
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no safetensors weights")
    return config, files


def read_drafter(path: Path) -> tuple[DFlashConfig, dict[str, mx.array]]:
    config, files = read_config(path)
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return config, weights


def fit_problems(config: DFlashConfig, target_hidden: int, target_layers: int, target_vocab: int) -> list[str]:
    """Why a drafter does not fit a target (empty: it fits)."""
    problems = []
    if config.hidden_size != target_hidden:
        problems.append(f"hidden size {config.hidden_size}, the target's is {target_hidden}")
    if config.num_target_layers != target_layers:
        problems.append(f"made for a target of {config.num_target_layers} layers, this one has {target_layers}")
    if any(not 0 <= i < target_layers for i in config.target_layer_ids):
        problems.append(f"target layers {list(config.target_layer_ids)} outside 0..{target_layers - 1}")
    if not 0 <= config.mask_token_id < target_vocab:
        problems.append(f"mask token {config.mask_token_id} outside the target's {target_vocab} embeddings")
    return problems


def check_files(path: Path, target_config: dict | None) -> str:
    """doctor: the drafter's config read and checked against the target's (nothing loaded)."""
    config, _ = read_config(path)
    if target_config is not None:
        text = target_config.get("text_config") or target_config
        problems = fit_problems(config, text["hidden_size"], text["num_hidden_layers"], text["vocab_size"])
        if problems:
            raise ModelLoadError(f"{path}: does not fit the target: " + "; ".join(problems))
    return (f"block {config.block_size}, {config.num_hidden_layers} layers, reads target layers "
            f"{list(config.target_layer_ids)}")


def build_drafter(config: DFlashConfig, weights: dict[str, mx.array], target_hidden: int,
                  target_layers: int, target_vocab: int, dtype, where: str) -> DFlashDrafter:
    """The drafter, its shapes checked against the target it is loaded for."""
    problems = fit_problems(config, target_hidden, target_layers, target_vocab)
    if problems:
        raise ModelLoadError(f"{where}: this DFlash drafter does not fit the target: " + "; ".join(problems))
    drafter = DFlashDrafter(config)
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    d2t = weights.pop("d2t", None)
    if config.draft_vocab_size is not None:
        drafter.vocab_ids = np.array(draft_vocab.target_ids(
            d2t, config.draft_vocab_size, config.vocab_size, target_vocab, f"DFlash drafter {where}"))
    try:
        drafter.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise ModelLoadError(f"{where}: its weights do not match a DFlash drafter of this config: {err}") from None
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    return drafter
