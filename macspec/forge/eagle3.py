"""Train an EAGLE-3 head for any mlx-lm target (the recipe; forge/smollm2_eagle3.py feeds it).

What EAGLE-3 trains (Li et al. 2025, SpecForge):
- inputs: the target's outputs of three layers (low, middle, high) fused by `fc`, and the
  embedding of the next token; no loss on the features themselves;
- "training-time test": the head is unrolled `unroll` steps, step j feeding its own output state
  of step j-1, as inference chains it. At origin t, step j sits at position t + j, and its
  attention sees step 0's keys at positions <= t (the true context) plus, of steps 1..j, only
  origin t's own keys: exactly the chain inference builds on a verified prefix;
- the loss: forward KL to the target's next-token distribution over the draft vocabulary at each
  step, weighted decay^j, on answer positions only.
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

from ..models.eagle3 import Eagle3Config, Eagle3Head
from ..models.mtp import output_rows
from ..models.view import ModelView
from ..sampling import fast_exp, log_normalize
from .. import corpus
from . import train

logger = logging.getLogger(__name__)


def head_config(target: nn.Module, draft_vocab: int, aux_outputs: tuple[int, ...]) -> Eagle3Config:
    """A head shaped like one of the target's own layers (so it can start as a copy of it)."""
    args = target.args
    return Eagle3Config(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        head_dim=getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
        rms_norm_eps=args.rms_norm_eps, rope_theta=getattr(args, "rope_theta", 10000.0),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", 4096) or 4096,
        vocab_size=args.vocab_size, draft_vocab_size=draft_vocab,
        target_hidden_size=args.hidden_size, aux_outputs=tuple(aux_outputs))


def default_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle, high: the outputs of layers 1, L/2 - 1 and L - 4 (SpecForge's default)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def init_head(target: nn.Module, vocab_ids: np.ndarray, aux_outputs: tuple[int, ...], seed: int) -> Eagle3Head:
    """The block starts as the target's last layer reading the fused state (its attention's
    embedding half small), fc as "take the high layer", norm the final norm, lm_head the
    target's output rows for the draft vocabulary (kept frozen: EAGLE keeps the LM head)."""
    mx.random.seed(seed)
    view = ModelView(target)
    config = head_config(target, len(vocab_ids), aux_outputs)
    head = Eagle3Head(config)
    ids = mx.array(vocab_ids.astype(np.int32))
    head.set_vocab_map(ids, int(view.inner.embed_tokens.weight.shape[0]))
    last = view.inner.layers[-1]
    width = config.hidden_size
    block = head.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        theirs = getattr(last.self_attn, name).weight
        noise = 0.02 * mx.random.normal((theirs.shape[0], width))
        getattr(block.self_attn, name).weight = mx.concatenate([noise, theirs], axis=1)
    block.self_attn.o_proj.weight = last.self_attn.o_proj.weight
    block.mlp.update(last.mlp.parameters())
    block.hidden_norm.weight = last.input_layernorm.weight
    block.post_attention_layernorm.weight = last.post_attention_layernorm.weight
    eye = mx.eye(width)
    head.fc.weight = mx.concatenate([0.02 * mx.random.normal((width, 2 * width)), eye], axis=1)
    head.norm.weight = view.inner.norm.weight
    head.lm_head.weight = output_rows(view, ids)
    head.lm_head.freeze()
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    return head


def _attention(block, x: mx.array, step: int, keys: list, values: list) -> mx.array:
    """Step `step`'s attention over [B, T] origins (see the module doc for what it sees)."""
    attn = block.self_attn
    B, T, _ = x.shape
    heads, kv_heads = attn.n_heads, attn.n_kv_heads
    q = attn.q_proj(x).reshape(B, T, heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, T, kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, T, kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q, offset=step), attn.rope(k, offset=step)
    if kv_heads != heads:
        k, v = (mx.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
    keys.append(k)
    values.append(v)
    scale = attn.scale
    causal = mx.triu(mx.full((T, T), -mx.inf), k=1)
    scores = [(q * scale) @ keys[0].transpose(0, 1, 3, 2) + causal]
    scores += [((q * scale) * kj).sum(-1, keepdims=True) for kj in keys[1:]]
    scores = mx.concatenate(scores, axis=-1)
    probs = fast_exp(log_normalize(scores))  # MLX's CPU exp is slow (see _kl)
    out = probs[..., :T] @ values[0]
    for i, vj in enumerate(values[1:]):
        out = out + probs[..., T + i:T + i + 1] * vj
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


def unrolled(head: Eagle3Head, view: ModelView, tokens: mx.array, fused: mx.array, unroll: int):
    """-> draft-vocabulary logits [unroll][B, T, N] for origins t = 0..T-1 (T = L - 1 - unroll):
    step j reads token t+1+j and predicts token t+2+j."""
    L = tokens.shape[1]
    T = L - 1 - unroll
    block = head.midlayer
    hidden = head.fc(fused[:, :T])
    keys, values, out = [], [], []
    for j in range(unroll):
        embeds = view.embed(tokens[:, 1 + j:1 + j + T]).astype(hidden.dtype)
        x = mx.concatenate([block.input_layernorm(embeds), block.hidden_norm(hidden)], axis=-1)
        h = hidden + _attention(block, x, j, keys, values)
        h = h + block.mlp(block.post_attention_layernorm(h))
        out.append(head.lm_head(head.norm(h)))
        hidden = h
    return out


def _kl(teacher_logits: mx.array, student_logits: mx.array, mask: mx.array) -> mx.array:
    """Forward KL(teacher || student) per position, masked mean; exp as a power of two (MLX's
    CPU exp is ~10x slower, and a step takes tens of millions of them)."""
    t = log_normalize(mx.stop_gradient(teacher_logits.astype(mx.float32)))
    s = log_normalize(student_logits)
    kl = (fast_exp(t) * (t - s)).sum(-1)
    return (kl * mask).sum() / mx.maximum(mask.sum(), 1)


def ttt_loss(head, view, tokens, fused, teacher, mask, unroll: int, decay: float) -> mx.array:
    """teacher [B, L, N]: the target's logits at each position over the draft vocabulary;
    mask [B, L]: 1 where the token at that index is an answer token (a prediction target)."""
    T = tokens.shape[1] - 1 - unroll
    total, weight = 0.0, 0.0
    for j, logits in enumerate(unrolled(head, view, tokens, fused, unroll)):
        w = decay ** j
        total = total + w * _kl(teacher[:, 1 + j:1 + j + T], logits, mask[:, 2 + j:2 + j + T])
        weight += w
    return total / weight


def train_head(head: Eagle3Head, view: ModelView, batches, sched: train.TrainSchedule, seed: int,
               unroll: int, decay: float = 0.8) -> float:
    """`batches` yields (tokens [B, L], fused [B, L, 3H], final [B, L, H], mask [B, L])."""
    rows = head.lm_head.weight  # frozen: the target's output rows

    def loss_fn(tokens, fused, teacher, mask):
        return ttt_loss(head, view, tokens, fused, teacher, mask, unroll, decay)

    def inputs(batch):
        tokens, fused, final, mask = batch
        teacher = final @ rows.T
        mx.eval(teacher)
        return tokens, fused, teacher, mask

    return train._run(head, loss_fn, inputs, sched, seed, None, "eagle3", batches)


def agreement(head: Eagle3Head, view: ModelView, batches, unroll: int) -> list[float]:
    """Top-1 agreement with the target at each chained step, on answer positions: step j given
    the true tokens before it, i.e. about the acceptance at draft position j + 1 (greedy)."""
    rows = head.lm_head.weight
    hits, counts = np.zeros(unroll), np.zeros(unroll)
    for tokens, fused, final, mask in batches:
        T = tokens.shape[1] - 1 - unroll
        teacher = final @ rows.T
        for j, logits in enumerate(unrolled(head, view, tokens, fused, unroll)):
            same = (logits.argmax(-1) == teacher[:, 1 + j:1 + j + T].argmax(-1)).astype(mx.float32)
            m = mask[:, 2 + j:2 + j + T]
            hits[j] += (same * m).sum().item()
            counts[j] += m.sum().item()
    return [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts)]


# ---- data: the target's states and batches over them ----------------------------------------

def target_states(view: ModelView, records: list[dict], path: Path | None, batch: int = 8):
    """Per record: (final normed state [n, H], the tapped layers' outputs [n, 3H]), float16;
    kept in `path` (None: not kept)."""
    if path is not None and path.is_file():
        with np.load(path) as saved:
            return [(saved[f"f{i}"], saved[f"a{i}"]) for i in range(len(records))]
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in records]
    width = int(view.inner.norm.weight.shape[0])
    out: list = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths pad little
    t0 = time.perf_counter()
    for b in range(0, len(order), batch):
        group = order[b:b + batch]
        longest = max(len(seqs[i]) for i in group)
        tokens = mx.array([seqs[i] + [0] * (longest - len(seqs[i])) for i in group])
        states = view.states(view.hidden(tokens)).astype(mx.float16)  # right padding: exact
        mx.eval(states)
        for row, i in enumerate(group):
            s = np.array(states[row, :len(seqs[i])])
            out[i] = (s[:, :width], s[:, width:])
        if b // batch % 20 == 0:
            logger.info("states %d/%d (%.0fs)", b + len(group), len(seqs), time.perf_counter() - t0)
    if path is None:
        return out
    np.savez(path, **{f"f{i}": f for i, (f, _) in enumerate(out)},
             **{f"a{i}": a for i, (_, a) in enumerate(out)})
    return out


def make_batches(records: list[dict], states: list, seq_len: int, batch_size: int, seed: int,
                 endless: bool = True):
    """Batches (tokens [B, L], fused [B, L, 3H], final [B, L, H], mask [B, L]): the last L
    positions of random sequences (each once, in order, when not `endless`); mask[p] = 1 where
    token p is an answer token."""
    rng = np.random.default_rng(seed)
    width, fused_width = states[0][0].shape[1], states[0][1].shape[1]
    order = iter(range(len(records)))
    while True:
        picks = rng.integers(0, len(records), batch_size) if endless else \
            [i for _, i in zip(range(batch_size), order)]
        if not len(picks):
            return
        tokens = np.zeros((len(picks), seq_len), np.int32)
        final = np.zeros((len(picks), seq_len, width), np.float32)
        fused = np.zeros((len(picks), seq_len, fused_width), np.float32)
        mask = np.zeros((len(picks), seq_len), np.float32)
        for row, i in enumerate(picks):
            r = records[i]
            seq = r["prompt_ids"] + r["answer_ids"]
            cut = max(0, len(seq) - seq_len)
            n = len(seq) - cut
            tokens[row, :n] = seq[cut:]
            final[row, :n], fused[row, :n] = states[i][0][cut:], states[i][1][cut:]
            mask[row, max(len(r["prompt_ids"]) - cut, 0):n] = 1.0
        yield mx.array(tokens), mx.array(fused), mx.array(final), mx.array(mask)


# ---- a head for the embedded target, from the corpus it was trained on -----------------------

@dataclass
class CorpusRecipe:
    """Teacher-forced windows of the standard library's sources (the tiny family's corpus)."""
    target: str = "embedded:tiny-target"
    layers: tuple[int, ...] = (1, 3, 4)  # of 6: low, middle, high (the default collides at L = 6)
    train_tokens: int = 160_000
    heldout_tokens: int = 16_000
    unroll: int = 3
    schedule: train.TrainSchedule = field(default_factory=lambda: train.TrainSchedule(
        steps=300, batch_size=16, seq_len=128, lr=2e-3, warmup=20, log_every=50))
    seed: int = 0


CORPUS_RECIPES = {
    "full": CorpusRecipe(),
    "smoke": CorpusRecipe(train_tokens=4_000, heldout_tokens=1_000, schedule=train.TrainSchedule(
        steps=2, batch_size=2, seq_len=32, warmup=1, log_every=1, compile=False)),
}


def _windows(tokenizer, texts: list[str], total: int, length: int) -> list[dict]:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) >= total:
            break
    ids = ids[:total]
    return [{"prompt_ids": [], "answer_ids": ids[i:i + length]}
            for i in range(0, len(ids) - length + 1, length)]


def forge_on_corpus(out: Path, recipe: CorpusRecipe) -> dict:
    """A full-vocabulary head for `recipe.target`, in the published layout, with a report."""
    from ..models.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model(recipe.target, dtype="float32")
    sched = recipe.schedule
    train_recs = _windows(loaded.tokenizer, corpus.read_texts(heldout=False), recipe.train_tokens, sched.seq_len)
    held_recs = _windows(loaded.tokenizer, corpus.read_texts(heldout=True), recipe.heldout_tokens, sched.seq_len)
    from ..models.view import tap_layers

    tap_layers(loaded.model, recipe.layers)
    view = ModelView(loaded.model)
    train_states = target_states(view, train_recs, None, batch=32)
    held_states = target_states(view, held_recs, None, batch=32)
    vocab = int(view.inner.embed_tokens.weight.shape[0])
    head = init_head(loaded.model, np.arange(vocab), recipe.layers, recipe.seed)
    batches = make_batches(train_recs, train_states, sched.seq_len, sched.batch_size, recipe.seed)
    loss = train_head(head, view, batches, sched, recipe.seed, recipe.unroll)
    held = make_batches(held_recs, held_states, sched.seq_len, 16, 0, endless=False)
    report = {"target": recipe.target, "recipe": {k: v for k, v in asdict(recipe).items() if k != "schedule"},
              "schedule": asdict(sched), "train_tokens": sum(len(r["answer_ids"]) for r in train_recs),
              "final_loss": round(loss, 4),
              "heldout_top1_agreement_by_step": agreement(head, view, held, recipe.unroll),
              "seconds": round(time.perf_counter() - t0, 1)}
    from ..models.eagle3 import save_head

    save_head(head, out)
    (out / "head.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("EAGLE-3 head for %s: %s", recipe.target, report)
    return report
