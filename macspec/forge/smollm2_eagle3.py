"""Forge SmolLM2-135M-Instruct's EAGLE-3 head (`macspec forge smollm2-eagle3`).

1. the model's own answers to offline chat prompts (all of chat_prompts', 1 in 10 held out;
   the MTP recipe's stage, shared with it), greedy and every third sampled at T = 0.7;
2. reference pairs (docstrings, pydoc topics) as teacher-forced answers;
3. one forward per sequence keeping the final normed state (the teacher) and the outputs of
   layers 1, 14 and 26 (the head's input), float16, saved;
4. the draft vocabulary: the most frequent tokens of the model's answers (and prompts);
5. the head (forge/eagle3.py): one block started from the target's last layer, trained with
   training-time test over `unroll` chained steps on KL to the target;
6. saved in the published layout (config.json + model.safetensors, bfloat16) with a report.
Each data stage is kept in a work dir under /tmp, so a crash or a new schedule costs one stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from . import chat_prompts, eagle3, smollm2, train
from ..models.eagle3 import save_head
from ..models.view import ModelView, tap_layers

logger = logging.getLogger(__name__)

HEAD_ASSET = "smollm2-eagle3"  # the shipped head's dir under the embedded assets


@dataclass
class Eagle3Recipe:
    answers: smollm2.HeadRecipe = field(default_factory=lambda: smollm2.HeadRecipe(
        num_prompts=783, num_reference=801))
    vocab_size: int = 8192
    unroll: int = 3  # chained steps trained together (training-time test)
    decay: float = 0.8  # step j's loss weight decay^j
    schedule: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(
        steps=480, batch_size=8, seq_len=160, lr=1e-3, warmup=30, log_every=20))
    seed: int = 0


RECIPES = {
    "full": Eagle3Recipe(),
    "smoke": Eagle3Recipe(
        answers=smollm2.HeadRecipe(num_prompts=24, max_tokens=6, chunk=24, num_reference=8,
                                   reference_tokens=16),
        vocab_size=256, unroll=2, schedule=train.TrainSchedule(
            steps=2, batch_size=2, seq_len=48, warmup=1, log_every=1, compile=False)),
}


def states_path(work: Path, records: list[dict], layers: tuple[int, ...], name: str) -> Path:
    key = hashlib.sha256(json.dumps([layers, len(records), records[0]["prompt_ids"][:8]]).encode())
    return work / f"states-{name}-{key.hexdigest()[:8]}.npz"


@dataclass
class TappedData:
    """SmolLM2 with layers 1, 14 and 26 tapped, its answers and the reference pairs, and the
    target's states for each (final, tapped): what its EAGLE-3 head and DFlash drafter train on."""

    loaded: object  # the target (LoadedModel)
    view: ModelView
    layers: tuple[int, ...]
    records: list[dict]
    states: list
    references: list[dict]
    ref_states: list
    answers_s: float


def tapped_data(data: smollm2.HeadRecipe) -> TappedData:
    """Every data stage, resumed from the work dirs."""
    from ..config import load_profile
    from ..engine.runtime import Runtime
    from ..models.loader import load_model

    t0 = time.perf_counter()
    work = smollm2.work_dir(data)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(smollm2.TARGET, dtype="float32")
    prompts = chat_prompts.build_prompts(data.num_prompts, data.seed)
    records = smollm2.generate_answers(Runtime(load_profile("smollm2"), loaded, "none"), prompts,
                                       data, work / "answers.jsonl")
    answers_s = time.perf_counter() - t0
    references = smollm2.reference_records(loaded.tokenizer, data)
    layers = eagle3.default_layers(len(ModelView(loaded.model).inner.layers))
    tap_layers(loaded.model, layers)
    view = ModelView(loaded.model)
    states = eagle3.target_states(view, records, states_path(work, records, layers, "answers"))
    ref_work = smollm2.work_dir(data, smollm2.REFERENCE_FIELDS)
    ref_work.mkdir(parents=True, exist_ok=True)
    ref_states = eagle3.target_states(view, references, states_path(ref_work, references, layers, "reference"))
    return TappedData(loaded, view, layers, records, states, references, ref_states, answers_s)


def forge_head(out: Path, recipe: Eagle3Recipe) -> dict:
    """Every stage, resumed from the work dirs; writes the head into `out`."""
    t0 = time.perf_counter()
    data = recipe.answers
    tapped = tapped_data(data)
    loaded, view, layers, records, states = tapped.loaded, tapped.view, tapped.layers, tapped.records, tapped.states
    references, ref_states, t_answers = tapped.references, tapped.ref_states, tapped.answers_s
    t_data = time.perf_counter() - t0
    train_idx = [i for i, r in enumerate(records) if not r["heldout"]]
    held_idx = [i for i, r in enumerate(records) if r["heldout"]]
    train_recs, held_recs = [records[i] for i in train_idx], [records[i] for i in held_idx]
    vocab_ids, vocab_report = smollm2.head_vocabulary(
        train_recs, recipe.vocab_size, int(view.inner.embed_tokens.weight.shape[0]),
        sorted(loaded.tokenizer.eos_token_ids))
    vocab_report["heldout_answer_coverage"] = smollm2._coverage(held_recs, vocab_ids)
    head = eagle3.init_head(loaded.model, vocab_ids, layers, recipe.seed)
    sched = recipe.schedule
    batches = eagle3.make_batches(train_recs + references, [states[i] for i in train_idx] + ref_states,
                           sched.seq_len, sched.batch_size, recipe.seed)
    t1 = time.perf_counter()
    loss = eagle3.train_head(head, view, batches, sched, recipe.seed, recipe.unroll, recipe.decay)
    t_train = time.perf_counter() - t1
    held = eagle3.make_batches(held_recs, [states[i] for i in held_idx], sched.seq_len, 8, 0, endless=False)
    report = {
        "target": smollm2.TARGET, "format": "EAGLE-3 (SpecForge layout: config.json + model.safetensors)",
        "recipe": {"answers": asdict(data), "vocab_size": recipe.vocab_size, "unroll": recipe.unroll,
                   "decay": recipe.decay, "seed": recipe.seed},
        "schedule": asdict(sched), "target_layers": list(layers),
        "prompts": {"train": len(train_recs), "heldout": len(held_recs), "reference": len(references)},
        "answer_tokens": {"train": sum(len(r["answer_ids"]) for r in train_recs),
                          "heldout": sum(len(r["answer_ids"]) for r in held_recs),
                          "reference": sum(len(r["answer_ids"]) for r in references)},
        **vocab_report,
        "head_params": sum(v.size for _, v in tree_flatten(head.parameters()) if v.dtype != mx.int32),
        "final_loss": round(loss, 4),
        "heldout_top1_agreement_by_step": eagle3.agreement(head, view, held, recipe.unroll),
        "seconds": {"answers": round(t_answers, 1), "data": round(t_data, 1),
                    "train": round(t_train, 1), "total": round(time.perf_counter() - t0, 1)},
    }
    save_head(head, out)
    (out / "head.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("smollm2 EAGLE-3 head: %s", report)
    return report
