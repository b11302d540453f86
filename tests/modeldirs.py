"""Real mlx-lm model directories with random weights, written on the fly for tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from macspec.models.loader import resolve_path
from macspec.models.mtp import MTPHead, make_block_like


def write_word_tokenizer(out: Path, words: list[str], byte_level: bool = False) -> None:
    """byte_level: ids decode to their words run together (a byte-level decoder, which a
    grammar engine needs to know each token's bytes); else joined by spaces."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if byte_level:  # the last word doubles as EOS: a grammar must be able to end
        tok.decoder = decoders.ByteLevel()
        config["eos_token"] = words[-1]
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def build_model(config: dict, seed: int, scale: float = 1.0):
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if scale != 1.0:
        head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
        head.weight = head.weight * scale
    mx.eval(model.parameters())
    return model


def save_model(model, config: dict, out: Path, mtp_head: MTPHead | None = None,
               mtp_inline: bool = False) -> Path:
    """mtp_inline: the MTP layer inside model.safetensors (DeepSeek/GLM checkpoints, whose
    sanitize drops it); else beside it in mtp.safetensors (llama would reject extra keys)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    if mtp_head is not None:
        mtp = mtp_head.layout_weights(config["num_hidden_layers"])
        if mtp_inline:
            weights.update(mtp)
        else:
            mx.save_safetensors(str(out / "mtp.safetensors"), mtp)
        config = {**config, "num_nextn_predict_layers": 1}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out


def random_mtp_head(model, config: dict, seed: int) -> MTPHead:
    mx.random.seed(seed)
    head = MTPHead(make_block_like(model, config["num_hidden_layers"]), config["hidden_size"],
                   config.get("rms_norm_eps", 1e-5))
    mx.eval(head.parameters())
    return head


def random_eagle3_head(model, config: dict, seed: int, draft_vocab: int, scale: float = 1.0):
    """An EAGLE-3 head over the first `draft_vocab` tokens (the rest never drafted), reading the
    target's layers 0, 0 and last (a 2-layer target)."""
    from macspec.models.eagle3 import Eagle3Config, Eagle3Head

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_config = Eagle3Config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden // 2, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=512, vocab_size=config["vocab_size"], draft_vocab_size=draft_vocab,
        target_hidden_size=hidden, aux_outputs=(0, 0, layers - 1))
    mx.random.seed(seed)
    head = Eagle3Head(head_config)
    head.set_vocab_map(mx.arange(draft_vocab), config["vocab_size"])
    head.lm_head.weight = head.lm_head.weight * scale
    mx.eval(head.parameters())
    return head


def tiny_llama_config(vocab: int, hidden: int = 32, layers: int = 2, eos: list[int] | None = None,
                      tied: bool = True) -> dict:
    cfg = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
           "intermediate_size": 2 * hidden, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": tied, "max_position_embeddings": 512}
    if eos is not None:
        cfg["eos_token_id"] = eos
    return cfg


def random_copy_of_embedded(name: str, out: Path, seed: int) -> Path:
    """Same config and tokenizer as embedded:NAME, random weights: a draft that never agrees."""
    src = resolve_path(f"embedded:{name}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    save_model(build_model(config, seed), config, out)
    return out
