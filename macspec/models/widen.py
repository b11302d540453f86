"""Function-preserving widening of a llama target: the bandwidth-bound stand-in built:tiny-wide.

Hidden size, heads and MLP are zero-padded; RMSNorm weights scale by sqrt(d/D) and eps by
d/D so the padded norms equal the original ones; new heads and MLP units read and write zeros.
The wide model has a real model's cost ratio to the small draft and produces the same logits.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

from .mtp import MTPHead, make_block_like


def widened_config(config: dict, hidden: int) -> dict:
    # Same head_dim (the attention scale) and the same q-per-kv ratio (the GQA grouping).
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    ratio = config["num_attention_heads"] // config["num_key_value_heads"]
    if hidden % (head_dim * ratio) or hidden < config["hidden_size"]:
        raise ValueError(f"hidden {hidden} must be a multiple of {head_dim * ratio}, "
                         f"at least {config['hidden_size']}")
    heads = hidden // head_dim
    scale = hidden / config["hidden_size"]
    return {**config, "hidden_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads // ratio, "head_dim": head_dim,
            "intermediate_size": int(config["intermediate_size"] * scale),
            "rms_norm_eps": config["rms_norm_eps"] / scale}


def _pad(w: mx.array, shape: tuple[int, ...]) -> mx.array:
    return mx.pad(w, [(0, n - o) for o, n in zip(w.shape, shape)])


def _widen_param(name: str, w: mx.array, wide_shape: tuple[int, ...], norm_scale: float,
                 small_hidden: int, wide_hidden: int) -> mx.array:
    if name.endswith("norm.weight"):
        return _pad(w * norm_scale, wide_shape)
    if name.endswith("eh_proj.weight"):  # input is [enorm(e) (D), hnorm(h) (D)]
        e, h = w[:, :small_hidden], w[:, small_hidden:]
        rows = wide_shape[0]
        return mx.concatenate([_pad(e, (rows, wide_hidden)), _pad(h, (rows, wide_hidden))], axis=1)
    return _pad(w, wide_shape)


def _widen_into(small: nn.Module, wide: nn.Module, small_hidden: int, wide_hidden: int) -> None:
    scale = math.sqrt(small_hidden / wide_hidden)
    wide_params = dict(tree_flatten(wide.parameters()))
    new = {name: _widen_param(name, w, wide_params[name].shape, scale, small_hidden, wide_hidden)
           for name, w in tree_flatten(small.parameters())}
    wide.update(tree_unflatten(list(new.items())))
    mx.eval(wide.parameters())


def widen_target(model: nn.Module, config: dict, hidden: int) -> tuple[nn.Module, dict]:
    wide_cfg = widened_config(config, hidden)
    wide = llama.Model(llama.ModelArgs.from_dict(wide_cfg))
    _widen_into(model, wide, config["hidden_size"], hidden)
    return wide, wide_cfg


def widen_mtp_head(head: MTPHead, wide_model: nn.Module, config: dict, wide_cfg: dict) -> MTPHead:
    wide_head = MTPHead(make_block_like(wide_model, wide_cfg["num_hidden_layers"]),
                        wide_cfg["hidden_size"], wide_cfg["rms_norm_eps"])
    _widen_into(head, wide_head, config["hidden_size"], wide_cfg["hidden_size"])
    return wide_head
