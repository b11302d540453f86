"""Miniature replicas of the seed models: Kimi K2.5, its Moonlight draft, GLM-5 with its MTP layer.

Each replica is a plain mlx-lm model dir whose `config.json` has the real checkpoint's
`model_type` and keys (the values scaled down), its weights laid out and quantized as the
mlx-community conversion ships them, and the embedded tiny tokenizer. They are generated offline
and deterministically (fixed seeds, no data but the replica's own outputs) in seconds:

- `kimi-k25-mini`: `kimi_k25` wrapping a deepseek_v3 `text_config` (MLA with q/kv LoRA ranks and
  YaRN rope, MoE with a shared expert, sigmoid `noaux_tc` routing with a correction bias,
  `first_k_dense_replace`), weights under `language_model.`, 4-bit affine, group 32.
- `moonlight-mini`: the draft, deepseek_v3 as Moonlight-16B-A3B (no q LoRA: a plain `q_proj`),
  4-bit, group 64, the same tokenizer. Its weights are a derived copy of the Kimi replica's:
  its first layers, its q LoRA folded into one projection, the output head (the only part a
  draft can copy exactly) perturbed. Greedy acceptance against the Kimi replica is partial by
  construction (see DRAFT_* below), so both the accept and the reject paths run.
- `glm5-mini`: `glm_moe_dsa` (MLA + DeepSeek sparse attention indexer, index_topk small enough
  to select within short prompts), 4-bit body, group 64, and its MTP layer
  `model.layers.{num_hidden_layers}.*` unquantized (bfloat16, as GLM-5 ships it) in
  `mtp.safetensors`, distilled for a few seconds on the quantized replica's own samples.

The target's output rows of the special tokens are zero, so greedy and tempered generation run
to max_tokens (a random-weight model would otherwise stop at random).
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
    "torch_dtype": "bfloat16",
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
    "torch_dtype": "bfloat16",
    "use_unified_vision_chunk": True,
}

MOONLIGHT = {  # moonshotai/Moonlight-16B-A3B-Instruct, scaled down onto the Kimi replica's dims
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
    "hidden_size": 128,  # 2048
    "initializer_range": 0.02,
    "intermediate_size": 256,  # 11264
    "kv_lora_rank": 64,  # 512
    "max_position_embeddings": 8192,
    "moe_intermediate_size": 128,  # 1408
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 16,  # 64
    "n_shared_experts": 1,  # 2
    "norm_topk_prob": True,
    "num_attention_heads": 4,  # 16
    "num_experts_per_tok": 4,  # 6
    "num_hidden_layers": 2,  # 27
    "num_key_value_heads": 4,  # 16
    "num_nextn_predict_layers": 0,
    "pad_token_id": 3,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,  # 128
    "qk_rope_head_dim": 32,  # 64
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,  # 2.446: the draft keeps its target's expert scale
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 64,  # 128
    "vocab_size": VOCAB_SIZE,  # 163840
}

GLM5 = {  # zai-org/GLM-5, scaled down
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
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

QUANT = {"kimi-k25-mini": 32, "moonlight-mini": 64, "glm5-mini": 64}  # 4-bit affine group size

# Seeds: one per replica, so each builds alone and identically every time.
KIMI_SEED, MOONLIGHT_SEED, GLM5_SEED = 2025, 16, 5
# The draft: the target's first DRAFT_LAYERS layers, and its output head perturbed by
# Gaussian noise of relative scale DRAFT_HEAD_NOISE (tuned for greedy acceptance ~0.5-0.7 at k=4).
DRAFT_LAYERS = 2
DRAFT_HEAD_NOISE = 0.35
# The GLM MTP head: distilled on the quantized replica's own samples (see _train_mtp).
MTP_STEPS, MTP_BATCH, MTP_SEQ, MTP_LR = 150, 16, 48, 3e-3


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

def _embedded_tokenizer_dir() -> Path:
    from ..models.loader import embedded_dir

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


def _dress(model: nn.Module, seed: int) -> None:
    """What training leaves and random init lacks: uneven norm gains, a non-zero router bias,
    a peaked output head, and special tokens the model never emits."""
    rng = np.random.default_rng(seed)
    lm = _language_model(model)
    updates = []
    for name, value in tree_flatten(lm.parameters()):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
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
    _dress(model, KIMI_SEED)
    return model, KIMI


def _fold_q_lora(attn, rng: np.random.Generator) -> mx.array:
    """q_b(norm(q_a(x))) as one matrix: RMSNorm's per-token 1/rms replaced by its mean over
    typical inputs (normalised hidden states). What a plain `q_proj` can best do."""
    a = np.array(attn.q_a_proj.weight)  # [q_lora, hidden]
    g = np.array(attn.q_a_layernorm.weight)  # [q_lora]
    b = np.array(attn.q_b_proj.weight)  # [heads * q_head, q_lora]
    x = rng.standard_normal((512, a.shape[1]))
    rms = np.sqrt(((x @ a.T) ** 2).mean(-1)).mean()
    return mx.array((b * g[None, :]) @ a / rms, dtype=mx.float32)


def moonlight_float() -> tuple[nn.Module, dict]:
    """The draft before quantization: the Kimi replica's first DRAFT_LAYERS layers, its q LoRA
    folded into `q_proj`, the same embeddings and final norm, the output head perturbed."""
    target, _ = kimi_float()
    lm = target.language_model
    rng = np.random.default_rng(MOONLIGHT_SEED)
    draft = _instantiate(MOONLIGHT, MOONLIGHT_SEED)
    keep = tuple(f"model.layers.{i}." for i in range(DRAFT_LAYERS))
    weights = []
    for name, value in tree_flatten(lm.parameters()):
        if name.startswith("model.layers.") and not name.startswith(keep):
            continue
        if ".q_a_proj." in name or ".q_a_layernorm." in name or ".q_b_proj." in name:
            continue
        weights.append((name, value))
    for i in range(DRAFT_LAYERS):
        weights.append((f"model.layers.{i}.self_attn.q_proj.weight",
                        _fold_q_lora(lm.model.layers[i].self_attn, rng)))
    head = np.array(lm.lm_head.weight)
    noise = rng.standard_normal(head.shape) * head.std() * DRAFT_HEAD_NOISE
    noise[list(SPECIAL_IDS)] = 0.0
    weights = [(k, v) for k, v in weights if k != "lm_head.weight"]
    weights.append(("lm_head.weight", mx.array(head + noise, dtype=mx.float32)))
    draft.load_weights(weights, strict=True)
    mx.eval(draft.parameters())
    return draft, MOONLIGHT


def _write_kimi(out: Path) -> dict:
    model, config = kimi_float()
    config = _quantize(model, config, QUANT["kimi-k25-mini"])
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
    model = _instantiate(GLM5, GLM5_SEED)
    _dress(model, GLM5_SEED)
    return model, GLM5


def _sample(model: nn.Module, view, batch: int, length: int, temperature: float,
            key: mx.array) -> mx.array:
    """`batch` sequences the model writes itself from a random first token."""
    from mlx_lm.models.cache import make_prompt_cache

    k_first, key = mx.random.split(key)
    tokens = mx.random.randint(len(SPECIAL_IDS), VOCAB_SIZE, (batch, 1), key=k_first)
    cache = make_prompt_cache(model)
    out = [tokens]
    for _ in range(length - 1):
        logits = view.logits(view.hidden(out[-1], cache))[:, -1]
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            k, key = mx.random.split(key)
            nxt = mx.random.categorical(logits / temperature, key=k)
        out.append(nxt[:, None].astype(mx.int32))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=1)


def _train_mtp(target: nn.Module, config: dict):
    """An MTP head distilled (forward KL at t+2) on sequences the quantized target writes itself,
    greedy and at temperature 1: a few seconds, deterministic."""
    import mlx.optimizers as optim

    from ..models.mtp import MTPHead, make_block_like
    from ..models.view import ModelView

    view = ModelView(target)
    mx.random.seed(GLM5_SEED + 1)
    head = MTPHead(make_block_like(target, config["num_hidden_layers"]), config["hidden_size"],
                   config["rms_norm_eps"])
    # Start from the target's last block: the same function of its input, a head start.
    last = dict(tree_flatten(target.model.layers[-1].parameters()))
    if not any(k.endswith(".scales") for k in last):
        head.block.load_weights(list(last.items()))
    head.shared_head.norm.weight = target.model.norm.weight
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())

    key = mx.random.key(GLM5_SEED + 2)
    seqs = []
    for temperature in (0.0, 1.0, 0.7):
        key, k = mx.random.split(key)
        seqs.append(_sample(target, view, MTP_BATCH * 2, MTP_SEQ + 2, temperature, k))
    data = mx.concatenate(seqs, axis=0)
    hidden_all, teacher_all = [], []
    for i in range(0, data.shape[0], MTP_BATCH):
        logits, hidden = view.forward(data[i:i + MTP_BATCH, :-1])
        mx.eval(logits, hidden)
        hidden_all.append(hidden)
        teacher_all.append(nn.log_softmax(logits, axis=-1))
    hidden_all = mx.concatenate(hidden_all)
    teacher_all = mx.concatenate(teacher_all)

    def loss_fn(tokens, hidden, teacher):
        logits, _ = head(tokens[:, 1:-1], hidden[:, :-1], view)
        s = nn.log_softmax(logits, axis=-1)
        t = teacher[:, 1:]
        return (mx.exp(t) * (t - s)).sum(-1).mean()

    optimizer = optim.Adam(learning_rate=optim.cosine_decay(MTP_LR, MTP_STEPS, MTP_LR * 0.05))
    step = nn.value_and_grad(head, loss_fn)
    rng = np.random.default_rng(GLM5_SEED + 3)
    n = data.shape[0]
    losses = []
    for _ in range(MTP_STEPS):
        idx = mx.array(rng.choice(n, size=MTP_BATCH, replace=False))
        loss, grads = step(data[idx], hidden_all[idx], teacher_all[idx])
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        losses.append(loss.item())
    return head, {"mtp_kl_first": round(losses[0], 3), "mtp_kl_last": round(float(np.mean(losses[-10:])), 3)}


def _write_glm5(out: Path) -> dict:
    model, config = glm5_float()
    config = _quantize(model, config, QUANT["glm5-mini"])
    _save(out, dict(tree_flatten(model.parameters())), config)
    # The MTP head learns the target as it runs: the quantized body, computed in float32.
    model.set_dtype(mx.float32)
    head, report = _train_mtp(model, config)
    mtp = {k: v.astype(mx.bfloat16) for k, v in head.layout_weights(config["num_hidden_layers"]).items()}
    _save(out, mtp, None, file="mtp.safetensors")
    return report


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
                "Moonlight draft replica for kimi-k25-mini: deepseek_v3, 4-bit g64"),
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
