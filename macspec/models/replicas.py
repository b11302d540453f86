"""Miniature replicas of the seed models: Kimi K2.5, its Moonlight draft, GLM-5 with its MTP layer.

Each replica is a plain mlx-lm model dir whose `config.json` has the real checkpoint's
`model_type` and keys (the values scaled down), its weights laid out and quantized as the
mlx-community conversion ships them, and the embedded tiny tokenizer. They are generated offline
and deterministically (fixed seeds, no data but the replica's own outputs) in seconds:

- `kimi-k25-mini`: `kimi_k25` wrapping a deepseek_v3 `text_config` (MLA with q/kv LoRA ranks and
  YaRN rope, MoE with a shared expert, sigmoid `noaux_tc` routing with a correction bias,
  `first_k_dense_replace`), weights under `language_model.`, 4-bit affine, group 32.
- `moonlight-mini`: the draft, deepseek_v3 as Moonlight-16B-A3B (no q LoRA: a plain `q_proj`,
  no YaRN), 4-bit, group 32, the same tokenizer. Its weights are a truncated copy of the Kimi
  replica as written (dequantized): its first DRAFT_LAYERS layers, each q LoRA folded into one
  projection, the same embeddings and head.
- `glm5-mini`: `glm_moe_dsa` (MLA + the DeepSeek sparse attention indexer, index_topk small
  enough that it selects within short prompts), 4-bit body, group 64, and its MTP layer
  `model.layers.{num_hidden_layers}.*` unquantized (bfloat16, as GLM-5 ships it) in
  `mtp.safetensors` (mlx-lm's loader reads model*.safetensors only). The MTP head is built in
  closed form from the target (see _mtp_from_first_layer), no training.

Random weights are dressed to behave like a trained model where speculation can tell: later
layers refine rather than rewrite (layer i writes DEPTH_DECAY**i of its output), so a truncated
copy (the draft, the MTP head) agrees with the target often but not always: greedy acceptance
lands between 0.3 and 0.9, and both the accept and the reject paths run. The output head is
peaked (T=0.7 sampling is not noise) and the special tokens' rows are zero, so generation runs
to max_tokens instead of stopping at random.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .store import embedded_dir

logger = logging.getLogger(__name__)

TOKENIZER_SOURCE = "tiny-target"  # embedded model whose tokenizer every replica ships
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB_SIZE = 4096  # the embedded tokenizer's; checked against tokenizer.json when writing
SPECIAL_IDS = (0, 1, 2, 3)  # <|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>
EOS_IDS = [0, 2]
HEAD_SCALE = 6.0  # output head gain: peaked enough that T=0.7 sampling is not noise
SAFETENSORS_META = {"format": "mlx"}

# ---------------------------------------------------------------------------------------------
# config.json of each replica: every key of the real checkpoint's config, values scaled down.
# ---------------------------------------------------------------------------------------------

KIMI_TEXT = {  # moonshotai/Kimi-K2.5 text_config (DeepSeek-V3 architecture), scaled down
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 1,
    "eos_token_id": EOS_IDS,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 128,  # 7168
    "initializer_range": 0.02,
    "intermediate_size": 256,  # 18432
    "kv_lora_rank": 64,  # 512
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 128,  # 2048
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 16,  # 384
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,  # 64
    "num_experts_per_tok": 4,  # 8
    "num_hidden_layers": 4,  # 61
    "num_key_value_heads": 4,  # 64
    "num_nextn_predict_layers": 0,
    "pad_token_id": 3,
    "pretraining_tp": 1,
    "q_lora_rank": 96,  # 1536
    "qk_nope_head_dim": 64,  # 128
    "qk_rope_head_dim": 32,  # 64
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "float32",  # bfloat16: what is not quantized is stored in float32 here
    "use_cache": True,
    "v_head_dim": 64,  # 128
    "vocab_size": VOCAB_SIZE,  # 163840
}

KIMI = {  # moonshotai/Kimi-K2.5 (multimodal wrapper; the vision tower is not replicated)
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "bos_token_id": 1,
    "eos_token_id": EOS_IDS,
    "ignore_index": -100,
    "media_placeholder_token_id": 3,
    "pad_token_id": 3,
    "text_config": KIMI_TEXT,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",  # bfloat16: what is not quantized is stored in float32 here
    "use_unified_vision_chunk": True,
}

# moonshotai/Moonlight-16B-A3B-Instruct: the same DeepSeek-V3 keys as Kimi's text_config. Scaled
# down onto the Kimi replica's dims (its draft is the replica's first layers); the real one has
# hidden 2048, intermediate 11264, kv_lora_rank 512, 64 routed + 2 shared experts (top 6),
# 27 layers, 16 heads, qk_nope/qk_rope/v head dims 128/64/128, routed_scaling_factor 2.446.
MOONLIGHT = {
    **KIMI_TEXT,
    "max_position_embeddings": 8192,
    "num_hidden_layers": 2,
    "q_lora_rank": None,  # Moonlight projects queries directly
    "rope_scaling": None,
}

GLM5 = {  # zai-org/GLM-5, scaled down
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "float32",  # bfloat16: what is not quantized is stored in float32 here
    "eos_token_id": EOS_IDS,
    "ep_size": 1,
    "first_k_dense_replace": 1,  # 3
    "head_dim": 32,  # 64 (qk_rope_head_dim)
    "hidden_act": "silu",
    "hidden_size": 128,  # 6144
    "index_head_dim": 64,  # 128
    "index_n_heads": 4,  # 32
    "index_topk": 32,  # 2048: the indexer selects once a sequence passes 32 tokens
    "indexer_rope_interleave": True,
    "initializer_range": 0.02,
    "intermediate_size": 256,  # 12288
    "kv_lora_rank": 64,  # 512
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 128,  # 2048
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 8,  # 256
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,  # 64
    "num_experts_per_tok": 2,  # 8
    "num_hidden_layers": 4,  # 78
    "num_key_value_heads": 4,  # 64
    "num_nextn_predict_layers": 1,
    "pad_token_id": 3,
    "pretraining_tp": 1,
    "q_lora_rank": 128,  # 2048
    "qk_head_dim": 96,  # 256
    "qk_nope_head_dim": 64,  # 192
    "qk_rope_head_dim": 32,  # 64
    "rms_norm_eps": 1e-05,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 64,  # 256
    "vocab_size": VOCAB_SIZE,  # 154880
}

QUANT = {"kimi-k25-mini": 32, "moonlight-mini": 32, "glm5-mini": 64}  # 4-bit affine group size

# Seeds: one per replica, so each builds alone and identically every time.
KIMI_SEED, MOONLIGHT_SEED, GLM5_SEED = 2025, 16, 5
# Tuned on held-out prompts for greedy acceptance ~0.5-0.7 (draft at k=4, MTP at k=3).
KIMI_DEPTH_DECAY = 0.2  # the draft keeps DRAFT_LAYERS of the Kimi replica's 4 layers
DRAFT_LAYERS = 2
GLM5_DEPTH_DECAY = 0.1  # the MTP head is GLM's layer 0 alone


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

def _embedded_tokenizer_dir() -> Path:
    return embedded_dir() / TOKENIZER_SOURCE


def _instantiate(config: dict, seed: int) -> nn.Module:
    """mlx-lm's own classes for `config`, float32, randomly initialised from `seed`."""
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float32)
    return model


def _language_model(model: nn.Module) -> nn.Module:
    """The module holding `model` and `lm_head` (kimi_k25 nests it under `language_model`)."""
    return model.language_model if hasattr(model, "language_model") else model


OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                      "mlp.shared_experts.down_proj.weight", "mlp.switch_mlp.down_proj.weight")


def _dress(model: nn.Module, seed: int, depth_decay: float = 1.0) -> None:
    """What training leaves and random init lacks: uneven norm gains, a non-zero router bias,
    later layers that refine rather than rewrite (layer i writes depth_decay**i of its output
    into the residual stream), a peaked output head, and special tokens the model never emits."""
    rng = np.random.default_rng(seed)
    lm = _language_model(model)
    updates = []
    for name, value in tree_flatten(lm.parameters()):
        if depth_decay != 1.0 and name.startswith("model.layers.") and name.endswith(OUTPUT_PROJECTIONS):
            layer = int(name.split(".")[2])
            updates.append((name, value * depth_decay ** layer))
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            updates.append((name, mx.array(1.0 + 0.1 * rng.standard_normal(value.shape),
                                           dtype=mx.float32)))
        elif name.endswith("e_score_correction_bias"):
            updates.append((name, mx.array(0.02 * rng.standard_normal(value.shape),
                                           dtype=mx.float32)))
    head = np.array(lm.lm_head.weight) * HEAD_SCALE
    head[list(SPECIAL_IDS)] = 0.0
    updates.append(("lm_head.weight", mx.array(head)))
    lm.load_weights(updates, strict=False)
    mx.eval(lm.parameters())


def _quantize(model: nn.Module, config: dict, group_size: int) -> dict:
    """4-bit affine, as mlx_lm.convert -q does it; returns the config with its quantization."""
    def predicate(_path, module):
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=4, class_predicate=predicate)
    mx.eval(model.parameters())
    quant = {"group_size": group_size, "bits": 4, "mode": "affine"}
    return {**config, "quantization": quant, "quantization_config": dict(quant)}


def _save(out: Path, weights: dict[str, mx.array], config: dict,
          file: str = "model.safetensors") -> None:
    mx.save_safetensors(str(out / file), weights, metadata=SAFETENSORS_META)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(out: Path) -> None:
    source = _embedded_tokenizer_dir()
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    if len(vocab) != VOCAB_SIZE:
        raise ValueError(f"embedded tokenizer has {len(vocab)} tokens, replicas expect {VOCAB_SIZE}")
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out / name)


# ---------------------------------------------------------------------------------------------
# Kimi K2.5 and its Moonlight draft
# ---------------------------------------------------------------------------------------------

def kimi_float() -> tuple[nn.Module, dict]:
    """The Kimi replica before quantization (float32)."""
    model = _instantiate(KIMI, KIMI_SEED)
    _dress(model, KIMI_SEED, KIMI_DEPTH_DECAY)
    return model, KIMI


def kimi_quantized() -> tuple[nn.Module, dict]:
    """The Kimi replica as written: quantized, with its config."""
    model, config = kimi_float()
    return model, _quantize(model, config, QUANT["kimi-k25-mini"])


def _dequantized(model: nn.Module, group_size: int) -> dict[str, np.ndarray]:
    """Every parameter of a quantized model as float32 numpy, quantized ones dequantized."""
    params = dict(tree_flatten(model.parameters()))
    out = {}
    for name, value in params.items():
        if name.endswith((".scales", ".biases")):  # quantization data (Linear has .bias)
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base and f"{base}.scales" in params:
            value = mx.dequantize(value, params[f"{base}.scales"], params[f"{base}.biases"],
                                  group_size=group_size, bits=4)
        out[name] = np.array(value.astype(mx.float32))
    return out


def _fold_q_lora(w: dict[str, np.ndarray], prefix: str, rng: np.random.Generator,
                 gain: float) -> np.ndarray:
    """q_b(norm(q_a(x))) as one matrix: RMSNorm's per-token 1/rms replaced by its mean over
    typical inputs (normalised hidden states). What a plain `q_proj` can best do. `gain`
    scales the scores (the draft has no YaRN attention scale to do it)."""
    a = w[f"{prefix}.q_a_proj.weight"]  # [q_lora, hidden]
    g = w[f"{prefix}.q_a_layernorm.weight"]  # [q_lora]
    b = w[f"{prefix}.q_b_proj.weight"]  # [heads * q_head, q_lora]
    x = rng.standard_normal((512, a.shape[1]))
    rms = np.sqrt(((x @ a.T) ** 2).mean(-1)).mean()
    return gain * (b * g[None, :]) @ a / rms


def _yarn_score_gain(text_config: dict) -> float:
    """The factor mlx-lm's DeepSeek-V3 attention multiplies its scale by under YaRN."""
    scaling = text_config.get("rope_scaling") or {}
    mscale_all_dim, factor = scaling.get("mscale_all_dim", 0), scaling.get("factor", 1)
    if not mscale_all_dim or factor <= 1:
        return 1.0
    s = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return s * s


def moonlight_float(layers: int = DRAFT_LAYERS) -> tuple[nn.Module, dict]:
    """The draft before quantization, derived from the Kimi replica as written (dequantized, so
    re-quantizing the copied matrices at the same group size is exact): its first `layers`
    layers, each q LoRA folded into a plain `q_proj`, the same embeddings, norm and head."""
    target, _ = kimi_quantized()
    w = {k[len("language_model."):]: v
         for k, v in _dequantized(target, QUANT["kimi-k25-mini"]).items()}
    rng = np.random.default_rng(MOONLIGHT_SEED)
    config = {**MOONLIGHT, "num_hidden_layers": layers}
    draft = _instantiate(config, MOONLIGHT_SEED)
    keep = tuple(f"model.layers.{i}." for i in range(layers))
    weights = {}
    for name, value in w.items():
        if name.startswith("model.layers.") and not name.startswith(keep):
            continue
        if ".q_a_proj." in name or ".q_a_layernorm." in name or ".q_b_proj." in name:
            continue
        weights[name] = value
    gain = _yarn_score_gain(KIMI_TEXT)
    for i in range(layers):
        prefix = f"model.layers.{i}.self_attn"
        weights[f"{prefix}.q_proj.weight"] = _fold_q_lora(w, prefix, rng, gain)
    draft.load_weights([(k, mx.array(v, dtype=mx.float32)) for k, v in weights.items()], strict=True)
    mx.eval(draft.parameters())
    return draft, config


def _write_kimi(out: Path) -> dict:
    model, config = kimi_quantized()
    _save(out, dict(tree_flatten(model.parameters())), config)
    return {}


def _write_moonlight(out: Path) -> dict:
    model, config = moonlight_float()
    config = _quantize(model, config, QUANT["moonlight-mini"])
    _save(out, dict(tree_flatten(model.parameters())), config)
    return {}


# ---------------------------------------------------------------------------------------------
# GLM-5 and its MTP layer
# ---------------------------------------------------------------------------------------------

def glm5_float() -> tuple[nn.Module, dict]:
    """The GLM-5 replica before quantization (float32)."""
    model = _instantiate(GLM5, GLM5_SEED)
    _dress(model, GLM5_SEED, GLM5_DEPTH_DECAY)
    return model, GLM5


def _dense_as_moe(w: dict[str, np.ndarray], dense: str, config: dict) -> dict[str, np.ndarray]:
    """A dense SwiGLU MLP (`dense`.{gate,up,down}_proj) as the MoE block of an MTP layer,
    exactly: its hidden units split between the shared expert and every routed expert (each
    routed output is weighted by normalised top-k scores times routed_scaling_factor)."""
    shared = config["moe_intermediate_size"] * config["n_shared_experts"]
    routed = config["moe_intermediate_size"]
    gate, up, down = (w[f"{dense}.{p}_proj.weight"] for p in ("gate", "up", "down"))
    if gate.shape[0] != shared + routed:
        raise ValueError(f"dense intermediate {gate.shape[0]} != shared {shared} + routed {routed}")
    experts = config["n_routed_experts"]
    scale = 1.0 / config["routed_scaling_factor"]
    stack = lambda m: np.repeat(m[None], experts, axis=0)  # noqa: E731
    return {
        "mlp.shared_experts.gate_proj.weight": gate[:shared],
        "mlp.shared_experts.up_proj.weight": up[:shared],
        "mlp.shared_experts.down_proj.weight": down[:, :shared],
        "mlp.switch_mlp.gate_proj.weight": stack(gate[shared:]),
        "mlp.switch_mlp.up_proj.weight": stack(up[shared:]),
        "mlp.switch_mlp.down_proj.weight": stack(down[:, shared:] * scale),
        "mlp.gate.weight": np.zeros((experts, config["hidden_size"]), np.float32),
        "mlp.gate.e_score_correction_bias": np.zeros((experts,), np.float32),
    }


def _mtp_from_first_layer(target: nn.Module, w: dict[str, np.ndarray], config: dict):
    """The MTP head the replica's shape admits in closed form: `eh_proj` passes the next token's
    embedding through (undoing `enorm`'s scale), the block is the target's layer 0, and the
    shared head its final norm. It computes the target truncated to its dominant first layer
    one position ahead; later layers (GLM5_DEPTH_DECAY) are what it misses."""
    from .mtp import MTPHead, make_block_like

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    embed = w["model.embed_tokens.weight"]
    rms = float(np.sqrt((embed[len(SPECIAL_IDS):] ** 2).mean(-1)).mean())
    params = {
        "enorm.weight": np.ones(hidden, np.float32),
        "hnorm.weight": np.ones(hidden, np.float32),
        "eh_proj.weight": np.concatenate([rms * np.eye(hidden), np.zeros((hidden, hidden))],
                                         axis=1).astype(np.float32),
        "shared_head.norm.weight": w["model.norm.weight"],
    }
    first = "model.layers.0."
    for name, value in w.items():
        if name.startswith(first) and ".mlp." not in name:
            params["block." + name[len(first):]] = value
    dense_is_first = config["first_k_dense_replace"] > 0
    if dense_is_first:
        params.update({"block." + k: v for k, v in _dense_as_moe(w, first + "mlp", config).items()})
    else:
        params.update({"block." + k[len(first):]: v for k, v in w.items()
                       if k.startswith(first + "mlp.")})
    head = MTPHead(make_block_like(target, layers), hidden, config["rms_norm_eps"])
    head.load_weights([(k, mx.array(v, dtype=mx.float32)) for k, v in params.items()], strict=True)
    mx.eval(head.parameters())
    return head


def _write_glm5(out: Path) -> dict:
    model, config = glm5_float()
    config = _quantize(model, config, QUANT["glm5-mini"])
    _save(out, dict(tree_flatten(model.parameters())), config)
    # The MTP head is derived from the target as it runs: the quantized body, dequantized.
    head = _mtp_from_first_layer(model, _dequantized(model, QUANT["glm5-mini"]), config)
    mtp = {k: v.astype(mx.bfloat16) for k, v in head.layout_weights(config["num_hidden_layers"]).items()}
    _save(out, mtp, None, file="mtp.safetensors")
    return {}


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Replica:
    name: str
    mimics: str  # the Hugging Face checkpoint whose config and layout it replicates
    write: Callable[[Path], dict]
    description: str


REPLICAS: dict[str, Replica] = {
    r.name: r for r in (
        Replica("kimi-k25-mini", "mlx-community/Kimi-K2.5", _write_kimi,
                "Kimi K2.5 replica: kimi_k25 / deepseek_v3 MLA + MoE, 4-bit g32"),
        Replica("moonlight-mini", "mlx-community/Moonlight-16B-A3B-Instruct-4-bit",
                _write_moonlight,
                "Moonlight draft replica for kimi-k25-mini: deepseek_v3, 4-bit g32"),
        Replica("glm5-mini", "mlx-community/GLM-5-4bit", _write_glm5,
                "GLM-5 replica: glm_moe_dsa (DSA indexer), 4-bit g64, bf16 MTP layer"),
    )
}


def write_replica(name: str, out: Path) -> dict:
    """Write replica `name` into the existing empty dir `out`; returns a small report."""
    replica = REPLICAS[name]
    start = time.perf_counter()
    _copy_tokenizer(out)
    report = replica.write(out) or {}
    report = {"replica": name, "mimics": replica.mimics, **report,
              "seconds": round(time.perf_counter() - start, 2),
              "bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file())}
    logger.info("replica %s written to %s: %s", name, out, report)
    return report


def recipe_digest() -> bytes:
    """What a replica's bytes depend on besides its name: this generator and the tokenizer."""
    import hashlib

    digest = hashlib.sha256(Path(__file__).read_bytes())
    source = _embedded_tokenizer_dir()
    for name in TOKENIZER_FILES:
        digest.update(name.encode() + (source / name).read_bytes())
    return digest.digest()
