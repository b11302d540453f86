"""Load an mlx-lm model dir (the target or a draft, sharded under TP) and an MTP head from a
target's checkpoint. Which dir a model reference means is the loader's business (loader.py)."""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import ModelLoadError, UnsupportedModelError
from . import cpu_prefill, expert_union, window_attention
from .mtp import (MTPHead, dequantized_params, head_summary, make_block_like, output_rows,
                  quantize_as_stored, quantized_modules)
from .textconfig import language_config
from .view import ModelView

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    path: Path
    config: dict
    hidden_is_final: bool | None = None  # hidden -> logits == full forward; None = not checked



def compute_dtype(requested: str) -> mx.Dtype | None:
    """auto: float32 on CPU (half and quantized matmuls are slow there), as stored elsewhere."""
    if requested == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return getattr(mx, requested)


def _classes_without_mtp(config: dict):
    """mlx-lm's model classes, with sanitize dropping the MTP layer(s) wherever they sit
    (mlx-lm strips only DeepSeek-V3's own index 61); load_mtp_head reads them separately."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    first, count = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers") or 0
    if not count or first is None:
        return model_cls, args_cls
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + count))

    class WithoutMTP(model_cls):
        def sanitize(self, weights):
            weights = {k: v for k, v in weights.items() if not k.startswith(prefixes)}
            return super().sanitize(weights) if hasattr(model_cls, "sanitize") else weights

    WithoutMTP.__name__ = WithoutMTP.__qualname__ = model_cls.__name__
    return WithoutMTP, args_cls


def load_dir(path: Path, dtype: str = "auto", trust_remote_code: bool = False, group=None) -> LoadedModel:
    """An mlx-lm model dir -> the model (its MTP layer left out), tokenizer and config.
    `group` (an mx.distributed group of size > 1): keep only this rank's tensor shard."""
    from mlx_lm.utils import load_model as mlx_load_model, load_tokenizer

    try:
        # Lazy, so a sharded rank never materialises the weights it drops.
        model, config = mlx_load_model(path, lazy=True, get_model_classes=_classes_without_mtp,
                                       trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, KeyError, OSError) as err:
        raise ModelLoadError(f"{path}: cannot load model: {err}") from None
    # macspec checks prompts against kv.max_context with an error that names the fix;
    # transformers' own check only warns, misleadingly ("will result in indexing errors").
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(inner, "model_max_length"):
        inner.model_max_length = 1 << 60
    config = language_config(config)
    if group is not None and group.size() > 1:
        _shard(model, group, path, config)
    target_dtype = compute_dtype(dtype)
    if target_dtype is not None:
        model.set_dtype(target_dtype)
    mx.eval(model.parameters())
    cpu_prefill.install()  # its model module's attention and SiLU (where the switch is on)
    window_attention.install()  # CUDA: verify windows unfused (no cuDNN graph per shape)
    expert_union.install()  # MoE layers: a step's distinct experts read once each
    return LoadedModel(model, tokenizer, path, config)


def _shard(model: nn.Module, group, path: Path, config: dict) -> None:
    if not hasattr(model, "shard"):
        raise UnsupportedModelError(f"{path}: mlx-lm's {config.get('model_type')!r} model has no "
                                    "tensor-parallel shard(); use tensor_parallel = 1")
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or 0
    if heads and heads % group.size():
        if not _shard_mlps_only(model, group):
            raise UnsupportedModelError(f"{path}: {heads} KV heads do not split over "
                                        f"{group.size()} ranks, and its MLPs cannot be sharded alone")
        logger.info("%s: %d KV heads do not split over %d ranks: attention runs whole on every "
                    "rank, the MLPs are sharded", path.name, heads, group.size())
        return
    model.shard(group)


def _shard_mlps_only(model: nn.Module, group) -> bool:
    """Tensor parallelism for a model whose heads do not divide (SmolLM2: 3 KV heads over 2
    ranks): every rank keeps the whole attention and its KV, and the gated MLPs (most of the
    weights) are split, one all-reduce per layer. -> False if the layers are not gated MLPs."""
    from mlx.nn.layers.distributed import shard_linear

    layers = ModelView(model).inner.layers
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not all(m is not None and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
               and m.gate_proj.weight.shape[0] % group.size() == 0 for m in mlps):
        return False
    for mlp in mlps:
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    return True


def _mtp_weight_files(path: Path, layer: int) -> list[Path]:
    index = path / "model.safetensors.index.json"
    prefix = f"model.layers.{layer}."
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {path / f for k, f in weight_map.items() if k.startswith(prefix)}
        files.update(Path(f) for f in glob.glob(str(path / "mtp*.safetensors")))
        return sorted(files)
    return sorted(Path(f) for f in glob.glob(str(path / "*.safetensors")))


def load_mtp_head(target: LoadedModel, dequantize: bool = False) -> MTPHead:
    """The MTP layer `model.layers.{num_hidden_layers}.*` from the target's own files, quantized
    as stored (`dequantize`: unpacked to the compute dtype, for speculative.mtp_dequantize)."""
    config, path = target.config, target.path
    layer = config.get("num_hidden_layers")
    if not config.get("num_nextn_predict_layers"):
        raise UnsupportedModelError(
            f"{path}: the config has no MTP layer (num_nextn_predict_layers is 0 or missing); "
            "use --method draft or ngram")
    if target.hidden_is_final is None:  # under TP every rank checked it together at start
        target.hidden_is_final = ModelView(target.model).hidden_is_final()
    if not target.hidden_is_final:
        raise UnsupportedModelError(f"{path}: this architecture transforms the hidden state "
                                    "after the final norm; MTP needs it exactly")
    prefix = f"model.layers.{layer}."
    weights: dict[str, mx.array] = {}
    for file in _mtp_weight_files(path, layer):
        weights.update({k: v for k, v in mx.load(str(file)).items() if k.startswith(prefix)})
    if not weights:
        raise UnsupportedModelError(
            f"{path}: config declares an MTP layer but no weights named {prefix}* were found "
            "(mlx_lm.convert strips them; keep them when converting, or use --method draft)")
    head = _build_head(target.model, weights, layer, config, dequantize)
    logger.info("MTP head (layer %d of %s): %s", layer, path.name, head_summary(head))
    return head


def _vocab_rows(model: nn.Module, config: dict) -> int:
    """The target's logits width (a padded embedding may exceed the config's vocab_size)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return int(embed.weight.shape[0]) if embed is not None else int(config["vocab_size"])


def _build_head(model: nn.Module, weights: dict[str, mx.array], layer: int, config: dict,
                dequantize: bool = False) -> MTPHead:
    # The embedding and output head are shared with the target (DeepSeek-V3); drop copies. A
    # head over a vocabulary subset (shared_head.vocab_ids) has its own, smaller output head:
    # stored, or else the target's output rows for those ids.
    prefix = f"model.layers.{layer}."
    vocab_ids = weights.get(f"{prefix}shared_head.vocab_ids")
    shared = (f"{prefix}embed_tokens.",) + (() if vocab_ids is not None else (f"{prefix}shared_head.head.",))
    weights = {k: v for k, v in weights.items() if not k.startswith(shared)}
    if vocab_ids is not None and f"{prefix}shared_head.head.weight" not in weights:
        weights[f"{prefix}shared_head.head.weight"] = output_rows(ModelView(model), vocab_ids)
    # Expert weights may be stored per expert; the target's sanitize stacks them for layer 0.
    as_layer0 = {k.replace(f"model.layers.{layer}.", "model.layers.0.", 1): v for k, v in weights.items()}
    if hasattr(model, "sanitize"):
        as_layer0 = model.sanitize(dict(as_layer0))
    params = MTPHead.from_layout(as_layer0, 0)
    head = _new_head(model, layer, config, vocab_ids)
    # Quantized modules where the file stores them quantized: the bytes as shipped, read as such.
    quantize_as_stored(head, params, _quantization(config), layer)
    _load_head_weights(head, params, layer)
    if dequantize and quantized_modules(head):
        params, head = dequantized_params(head), _new_head(model, layer, config, vocab_ids)
        _load_head_weights(head, params, layer)
    head.set_dtype(model.model.norm.weight.dtype)  # the compute dtype, even when quantized
    mx.eval(head.parameters())
    return head


def _quantization(config: dict) -> dict:
    return config.get("quantization") or config.get("quantization_config") or {}


def _new_head(model: nn.Module, layer: int, config: dict, vocab_ids) -> MTPHead:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    return MTPHead(make_block_like(model, layer), hidden, eps, vocab_ids=vocab_ids,
                   target_vocab=None if vocab_ids is None else _vocab_rows(model, config))


def _load_head_weights(head: MTPHead, params: dict[str, mx.array], layer: int) -> None:
    try:
        head.load_weights(list(params.items()), strict=True)
    except ValueError as err:
        raise UnsupportedModelError(f"MTP layer {layer} does not match the target's block: {err}") from None
