"""Forge the embedded family end to end and write standard mlx-lm model dirs."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .. import corpus
from . import tokenizer, train
from .evaluate import evaluate_family

logger = logging.getLogger(__name__)


@dataclass
class ForgeRecipe:
    vocab_size: int = 4096
    hidden: int = 256
    target_layers: int = 6
    draft_layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    target: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(steps=450))
    draft: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(steps=500))
    mtp: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(steps=250))
    seed: int = 0
    max_train_files: int | None = None


RECIPES = {
    "full": ForgeRecipe(),
    # A few steps on a slice of the corpus: proves the pipeline, not the quality.
    "smoke": ForgeRecipe(
        vocab_size=512, hidden=64, target_layers=2, draft_layers=1, heads=2, kv_heads=1,
        intermediate=128,
        target=train.TrainSchedule(steps=3, batch_size=2, seq_len=32, warmup=1, log_every=1,
                                     compile=False),
        draft=train.TrainSchedule(steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1,
                                     compile=False),
        mtp=train.TrainSchedule(steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1,
                                     compile=False),
        max_train_files=20,
    ),
}


def _save_model(model, config: dict, tok, out_dir: Path, extra: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps({**config, **(extra or {})}, indent=2) + "\n")
    tokenizer.save_tokenizer(tok, out_dir)


def _encode(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(tokenizer.EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def _reuse_target(target_dir: Path):
    """The target, tokenizer and MTP head of an earlier forge (the slow 2/3 of the work)."""
    from tokenizers import Tokenizer

    from ..models.checkpoint import load_mtp_head

    from ..models.loader import load_model

    loaded = load_model(str(target_dir), dtype="float32")
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return tok, loaded.model, load_mtp_head(loaded)


def forge(out_dir: Path, recipe: ForgeRecipe, reuse_target: bool = False) -> dict:
    """Writes out_dir/{tiny-target,tiny-draft}; returns the report (also saved as forge.json).

    reuse_target: keep out_dir/tiny-target (tokenizer, target, MTP head) and re-distill only
    the draft, from the bfloat16-rounded target as saved."""
    t0 = time.perf_counter()
    mx.random.seed(recipe.seed)
    r = recipe
    target_dir, draft_dir = out_dir / "tiny-target", out_dir / "tiny-draft"
    train_texts = corpus.read_texts(heldout=False)[: recipe.max_train_files]
    heldout_texts = corpus.read_texts(heldout=True)[: recipe.max_train_files]
    if reuse_target:
        tok, target, head = _reuse_target(target_dir)
    else:
        tok = tokenizer.train_tokenizer(train_texts, recipe.vocab_size)
    train_ids, heldout_ids = _encode(tok, train_texts), _encode(tok, heldout_texts)
    logger.info("corpus: %d train tokens, %d held-out tokens", len(train_ids), len(heldout_ids))

    eos_ids = tokenizer.eos_token_ids(tok)
    target_cfg = train.llama_config(r.vocab_size, r.hidden, r.target_layers, r.heads,
                                    r.kv_heads, r.intermediate, eos_ids)
    draft_cfg = train.llama_config(r.vocab_size, r.hidden, r.draft_layers, r.heads,
                                   r.kv_heads, r.intermediate, eos_ids)
    if not reuse_target:
        target = train.build_llama(target_cfg)
        train.train_target(target, train_ids, r.target, r.seed)
        head = train.make_mtp_head(target)
        train.train_mtp(head, target, train_ids, r.mtp, r.seed + 2)
        _save_model(target, target_cfg, tok, target_dir, {"num_nextn_predict_layers": 1})
        mtp_weights = {k: v.astype(mx.bfloat16) for k, v in head.layout_weights(r.target_layers).items()}
        mx.save_safetensors(str(target_dir / "mtp.safetensors"), mtp_weights, metadata={"format": "mlx"})
    draft = train.build_llama(draft_cfg)
    train.distill_draft(draft, target, train_ids, r.draft, r.seed + 1)
    _save_model(draft, draft_cfg, tok, draft_dir)

    report = {
        "recipe": {k: v for k, v in r.__dict__.items() if not isinstance(v, train.TrainSchedule)},
        "schedules": {name: getattr(r, name).__dict__ for name in ("target", "draft", "mtp")},
        "reused_target": reuse_target,
        "target_params": sum(v.size for _, v in tree_flatten(target.parameters())),
        "draft_params": sum(v.size for _, v in tree_flatten(draft.parameters())),
        "mtp_params": sum(v.size for _, v in tree_flatten(head.parameters())),
        **evaluate_family(target, draft, head, heldout_ids),
        "train_tokens": int(len(train_ids)),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out_dir / "forge.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("forge done: %s", report)
    return report
