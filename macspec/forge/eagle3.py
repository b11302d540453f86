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

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.eagle3 import Eagle3Config, Eagle3Head
from ..models.mtp import output_rows
from ..models.view import ModelView
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
    probs = mx.softmax(mx.concatenate(scores, axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
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


def ttt_loss(head, view, tokens, fused, teacher, mask, unroll: int, decay: float) -> mx.array:
    """teacher [B, L, N]: the target's logits at each position over the draft vocabulary;
    mask [B, L]: 1 where the token at that index is an answer token (a prediction target)."""
    T = tokens.shape[1] - 1 - unroll
    total, weight = 0.0, 0.0
    for j, logits in enumerate(unrolled(head, view, tokens, fused, unroll)):
        w = decay ** j
        total = total + w * train._kl(teacher[:, 1 + j:1 + j + T], logits, mask[:, 2 + j:2 + j + T])
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
