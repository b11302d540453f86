"""Train a DFlash block drafter for an mlx-lm target (z-lab's recipe, at this machine's scale).

What it trains: at random anchors a of teacher-forced text, the block [token a, mask, ..., mask]
(positions a .. a + B - 1), attending to the fused context of positions < a and to the whole
block, predicts the target's next-token distribution at positions a .. a + B - 2 (block outputs
1 .. B - 1); the loss is the forward KL, position j weighted decay^(j-1) (later drafts matter
less: they count only when every earlier one was accepted). Many anchors of one sequence train
together: each block is its own attention row over the sequence's shared context keys.
The target's embeddings and output head stay frozen (the drafter has none of its own). With a
draft vocabulary (the EAGLE-3 head's), both distributions are taken over it, as EAGLE-3's loss
is: a sixth of SmolLM2's output rows per position, so ~5x the blocks per CPU minute.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import corpus
from ..models.dflash import ContextKV, DFlashDrafter, OutputHead, drafter_config, save_drafter
from ..models.view import ModelView, tap_layers
from . import train
from .eagle3 import _windows, target_states

logger = logging.getLogger(__name__)


@dataclass
class DFlashRecipe:
    target: str = "embedded:tiny-target"
    layers: int = 2  # drafter layers
    # The target layers it reads (None: the reference's spread, one per drafter layer). The tiny
    # target's EAGLE-3 head reads (1, 3, 4): one tap serves both on one server.
    target_layers: tuple[int, ...] | None = (1, 3, 4)
    block_size: int = 8
    anchors: int = 8  # blocks trained per sequence per step
    decay: float = 0.8
    train_tokens: int = 160_000
    heldout_tokens: int = 16_000
    schedule: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(
        steps=800, batch_size=16, seq_len=128, lr=2e-3, warmup=30, log_every=50, compile=False))
    seed: int = 0


RECIPES = {
    "full": DFlashRecipe(),
    "smoke": DFlashRecipe(train_tokens=4_000, heldout_tokens=1_000, schedule=train.TrainSchedule(
        steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1, compile=False)),
}


def init_drafter(view: ModelView, config, seed: int, copy_layers: bool = True,
                 vocab_ids: np.ndarray | None = None) -> DFlashDrafter:
    """fc starts as "take the highest tapped layer" (the context a drafter most needs first: what
    the target is about to say). With `copy_layers`, its layers start as the target's last ones
    (as EAGLE-3's head starts as the last: already a map from late states to the output head's
    space), `hidden_norm` as the first copy's input norm and `norm` as the target's final norm;
    whatever has no same-shaped twin (q/k norms, an MoE target's MLP) stays random. `vocab_ids`:
    the draft vocabulary's target ids (config.draft_vocab_size of them)."""
    mx.random.seed(seed)
    drafter = DFlashDrafter(config)
    drafter.vocab_ids = vocab_ids
    width = config.hidden_size
    fc = mx.zeros((width, width * len(config.target_layer_ids)))
    drafter.fc.weight = fc.at[:, -width:].add(mx.eye(width))
    if copy_layers:
        sources = view.inner.layers[-len(drafter.layers):]
        for layer, source in zip(drafter.layers, sources):
            layer.update(tree_unflatten(same_shaped(source, layer)))
        drafter.hidden_norm.weight = sources[0].input_layernorm.weight
        drafter.norm.weight = view.inner.norm.weight
    return drafter


def same_shaped(source: nn.Module, target: nn.Module) -> list[tuple[str, mx.array]]:
    """`source`'s parameters that `target` has under the same name and shape."""
    mine = dict(tree_flatten(target.parameters()))
    return [(name, value) for name, value in tree_flatten(source.parameters())
            if name in mine and mine[name].shape == value.shape and mine[name].dtype == value.dtype]


def block_logits(drafter: DFlashDrafter, head: OutputHead, tokens: mx.array, fused: mx.array,
                 anchors: mx.array) -> mx.array:
    """tokens [B, L], fused [B, L, K·H], anchors [B, A] -> draft-vocabulary logits [B·A, size - 1, V]
    of every anchor's block, each block attending to the context before its anchor and to itself:
    the drafter's serving forward, its cache a ContextKV per layer."""
    size, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    batch, length = tokens.shape
    rows = anchors.reshape(-1)  # [R]: one attention row per block
    heads = mx.take_along_axis(tokens, anchors, axis=1).reshape(-1, 1)
    block = mx.concatenate([heads, mx.full((rows.shape[0], size - 1), mask_id, dtype=heads.dtype)], axis=1)
    ctx = drafter.hidden_norm(drafter.fc(fused))
    caches = [ContextKV(*(mx.repeat(a, anchors.shape[1], axis=0)
                          for a in layer.self_attn.keys_values(ctx, mx.zeros((batch,), mx.int32))))
              for layer in drafter.layers]
    visible = mx.concatenate([mx.arange(length)[None] < rows[:, None], mx.ones((rows.shape[0], size), mx.bool_)],
                             axis=1)[:, None, None, :]
    states = drafter(head.view.embed(block).astype(ctx.dtype), rows, caches, visible)
    return head.draft(states[:, 1:])


def anchor_positions(anchors: mx.array, size: int) -> mx.array:
    """Positions anchor .. anchor + size - 2 of every anchor [B, A] -> [B, A·(size - 1)]: where
    the target's next-token distributions teach the block's outputs 1 .. size - 1."""
    return (anchors[..., None] + mx.arange(size - 1)).reshape(anchors.shape[0], -1)


def weighted_loss(drafter, head: OutputHead, tokens, fused, teacher, anchors, decay: float) -> mx.array:
    """Forward KL per block position, position j weighted decay^(j-1); `teacher`: the target's
    logits over the draft vocabulary at every block's positions [B·A, size - 1, V]."""
    logits = block_logits(drafter, head, tokens, fused, anchors).astype(mx.float32)
    target = teacher.astype(mx.float32)
    p_log = target - mx.logsumexp(target, axis=-1, keepdims=True)
    q_log = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kl = (mx.exp(p_log) * (p_log - q_log)).sum(-1)  # [R, size - 1]
    weights = decay ** mx.arange(teacher.shape[1], dtype=mx.float32)
    return (kl * weights).sum() / (weights.sum() * kl.shape[0])


def batches(records, states, recipe: DFlashRecipe, score, seed: int, endless: bool = True):
    """(tokens [B, L], fused [B, L, K·H], teacher logits [B·A, size - 1, V], anchors [B, A]):
    L = the shortest picked sequence (prompt + answer) cut to seq_len; anchors lie in the answer
    (a chat prompt is the user's text, which the target never writes); the teacher's logits,
    `score`(final states), are computed at the anchors' positions only (a 49k vocabulary over
    every position would dominate)."""
    rng = np.random.default_rng(seed)
    sched, size = recipe.schedule, recipe.block_size
    usable = [i for i, r in enumerate(records)
              if min(len(r["prompt_ids"]) + len(r["answer_ids"]), sched.seq_len) - size + 1 > max(1, len(r["prompt_ids"]))]
    order = iter(usable)
    while True:
        picks = [usable[j] for j in rng.integers(0, len(usable), sched.batch_size)] if endless else \
            [i for _, i in zip(range(sched.batch_size), order)]
        if not picks:
            return
        seqs = [records[i]["prompt_ids"] + records[i]["answer_ids"] for i in picks]
        length = min(sched.seq_len, *(len(q) for q in seqs))
        starts = [max(1, len(records[i]["prompt_ids"])) for i in picks]
        last = length - size + 1  # an anchor's block must end inside the window
        usable_rows = [j for j, a in enumerate(starts) if a < last]
        if not usable_rows:
            continue
        picks, seqs, starts = ([x[j] for j in usable_rows] for x in (picks, seqs, starts))
        tokens = mx.array([q[:length] for q in seqs])
        final = mx.array(np.stack([states[i][0][:length] for i in picks]).astype(np.float32))
        fused = mx.array(np.stack([states[i][1][:length] for i in picks]).astype(np.float32))
        anchors = mx.array(np.stack([rng.integers(a, last + 1, recipe.anchors) for a in starts]), dtype=mx.int32)
        at = anchor_positions(anchors, size)
        picked = mx.take_along_axis(final, at[..., None], axis=1)  # [B, A·(size-1), H]
        teacher = score(picked)
        teacher = teacher.reshape(-1, size - 1, teacher.shape[-1])
        mx.eval(teacher)
        yield tokens, fused, teacher, anchors


def agreement(drafter, head: OutputHead, held, size: int) -> list[float]:
    """Top-1 agreement with the target per block position on held-out text (`held`: batches
    scored with the target's whole vocabulary): about the greedy acceptance at draft j given
    every earlier draft accepted."""
    hits, counts = np.zeros(size - 1), np.zeros(size - 1)
    for tokens, fused, teacher, anchors in held:
        drafts = block_logits(drafter, head, tokens, fused, anchors).argmax(-1)
        if head.ids is not None:
            drafts = head.ids[drafts]
        same = drafts == teacher.argmax(-1)
        hits += np.array(same.sum(0))
        counts += same.shape[0]
    return [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)]


def forge_drafter(out: Path, recipe: DFlashRecipe) -> dict:
    """A drafter for `recipe.target`, in the published layout, with a report (drafter.json)."""
    from ..models.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model(recipe.target, dtype="float32")
    config = drafter_config(loaded.config, recipe.layers, recipe.block_size, target_layers=recipe.target_layers)
    tap_layers(loaded.model, config.target_layer_ids)
    view = ModelView(loaded.model)
    sched = recipe.schedule
    train_recs = _windows(loaded.tokenizer, corpus.read_texts(heldout=False), recipe.train_tokens, sched.seq_len)
    held_recs = _windows(loaded.tokenizer, corpus.read_texts(heldout=True), recipe.heldout_tokens, sched.seq_len)
    train_states = target_states(view, train_recs, None, batch=32)
    held_states = target_states(view, held_recs, None, batch=32)
    drafter = init_drafter(view, config, recipe.seed)
    head = OutputHead.of(drafter, view, config.vocab_size)

    def loss_fn(tokens, fused, teacher, anchors):
        return weighted_loss(drafter, head, tokens, fused, teacher, anchors, recipe.decay)

    loss = train._run(drafter, loss_fn, lambda batch: batch, sched, recipe.seed, None, "dflash",
                      batches(train_recs, train_states, recipe, head.draft, recipe.seed))
    held = batches(held_recs, held_states, recipe, view.logits, 0, endless=False)
    report = {"target": recipe.target, "recipe": {k: v for k, v in asdict(recipe).items() if k != "schedule"},
              "schedule": asdict(sched), "train_tokens": sum(len(r["answer_ids"]) for r in train_recs),
              "final_loss": round(loss, 4),
              "heldout_top1_agreement_by_position": agreement(drafter, head, held, recipe.block_size),
              "seconds": round(time.perf_counter() - t0, 1)}
    save_drafter(drafter, out)
    (out / "drafter.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("DFlash drafter for %s: %s", recipe.target, report)
    return report
