"""Forge SmolLM2-135M-Instruct's DFlash block drafter (`macspec forge smollm2-dflash`).

The EAGLE-3 head's data at the EAGLE-3 head's budget (forge/smollm2_eagle3.py): the model's own
answers to the offline chat prompts (1 in 10 held out) and the reference pairs, with the target's
final state and the outputs of layers 1, 14 and 26, the layers the EAGLE-3 head reads (one tap
serves both on one server). The drafter (forge/dflash.py) is trained at random anchors inside the
answers to predict the target's next-token distribution at every block position, over a
draft vocabulary picked as the EAGLE-3 head's (the answers' 8,192 most frequent tokens); saved in z-lab's layout
(config.json + model.safetensors, bfloat16) plus that vocabulary as EAGLE-3 saves one (`d2t`),
with a report (drafter.json).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx.utils import tree_flatten

from . import dflash, smollm2, train
from .smollm2_eagle3 import RECIPES as EAGLE3_RECIPES, tapped_data
from ..models.dflash import OutputHead, drafter_config, save_drafter

logger = logging.getLogger(__name__)

DRAFTER_ASSET = "smollm2-dflash"  # the shipped drafter's dir under the embedded assets


@dataclass
class SmolDFlashRecipe:
    answers: smollm2.HeadRecipe = field(default_factory=lambda: EAGLE3_RECIPES["full"].answers)
    layers: int = 2  # 7.5M parameters in its layers + fc: the EAGLE-3 head has 9.8M
    vocab_size: int | None = 8192  # the draft vocabulary, picked as the EAGLE-3 head's (None: all 49k)
    # Blocks of 4 at 32 anchors cost a step what blocks of 8 at 16 did, and give drafts 1..3 (the
    # ones the engine accepts: past 3 it read <= 0.02) twice the blocks: 0.47 at the first, not 0.42.
    block_size: int = 4
    anchors: int = 32  # blocks per sequence per step
    decay: float = 0.8
    schedule: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(
        steps=960, batch_size=8, seq_len=160, lr=1e-3, warmup=30, log_every=20, compile=False))
    seed: int = 0


RECIPES = {
    "full": SmolDFlashRecipe(),
    "smoke": SmolDFlashRecipe(answers=EAGLE3_RECIPES["smoke"].answers, vocab_size=256, block_size=4, anchors=2,
                              schedule=train.TrainSchedule(steps=2, batch_size=2, seq_len=48, warmup=1,
                                                           log_every=1, compile=False)),
}


def forge_drafter(out: Path, recipe: SmolDFlashRecipe) -> dict:
    """Every stage, resumed from the EAGLE-3 forge's work dirs; writes the drafter into `out`."""
    t0 = time.perf_counter()
    tapped = tapped_data(recipe.answers)
    view, layers, records, states = tapped.view, tapped.layers, tapped.records, tapped.states
    references, ref_states = tapped.references, tapped.ref_states
    t_data = time.perf_counter() - t0
    train_idx = [i for i, r in enumerate(records) if not r["heldout"]]
    held_idx = [i for i, r in enumerate(records) if r["heldout"]]
    vocab_ids, vocab_report = None, None
    if recipe.vocab_size is not None:  # as the EAGLE-3 head picks its own, from the same answers
        vocab_ids, vocab_report = smollm2.head_vocabulary(
            [records[i] for i in train_idx], recipe.vocab_size, int(view.inner.embed_tokens.weight.shape[0]),
            sorted(tapped.loaded.tokenizer.eos_token_ids))
        vocab_report["heldout_answer_coverage"] = smollm2._coverage([records[i] for i in held_idx], vocab_ids)
    config = drafter_config(tapped.loaded.config, recipe.layers, recipe.block_size, target_layers=layers,
                            draft_vocab_size=recipe.vocab_size)
    train_recs = [records[i] for i in train_idx] + references
    train_states = [states[i] for i in train_idx] + ref_states
    drafter = dflash.init_drafter(view, config, recipe.seed, vocab_ids=vocab_ids)
    head = OutputHead.of(drafter, view, config.vocab_size)

    def loss_fn(tokens, fused, teacher, anchors):
        return dflash.weighted_loss(drafter, head, tokens, fused, teacher, anchors, recipe.decay)

    t1 = time.perf_counter()
    loss = train._run(drafter, loss_fn, lambda batch: batch, recipe.schedule, recipe.seed, None, "dflash",
                      dflash.batches(train_recs, train_states, recipe, head.draft, recipe.seed))
    t_train = time.perf_counter() - t1
    held = dflash.batches([records[i] for i in held_idx], [states[i] for i in held_idx], recipe, view.logits, 0,
                          endless=False)
    report = {
        "target": smollm2.TARGET, "format": "DFlash (z-lab layout: config.json + model.safetensors)",
        "recipe": {k: v for k, v in asdict(recipe).items() if k != "schedule"},
        "schedule": asdict(recipe.schedule), "target_layers": list(layers),
        "prompts": {"train": len(train_idx), "heldout": len(held_idx), "reference": len(references)},
        "drafter_params": sum(v.size for _, v in tree_flatten(drafter.parameters())),
        "final_loss": round(loss, 4),
        "vocabulary": vocab_report,
        "heldout_top1_agreement_by_position": dflash.agreement(drafter, head, held, recipe.block_size),
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1),
                    "total": round(time.perf_counter() - t0, 1)},
    }
    save_drafter(drafter, out)
    (out / "drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("smollm2 DFlash drafter: %s", report)
    return report
