"""A DFlash drafter proposes a whole block for every row of its method in one drafter forward.

The drafter (models/dflash.py) reads the target's tapped layers (the EAGLE-3 tap: the verifying
forward keeps them, no second pass) as context: each committed position's states are fed once
into the drafter's cache, then one forward over [last token, mask, ..., mask] yields the drafts
of every position at once, so its cost does not grow with k. The plan still decides, per row,
how many of them to verify. At T > 0 each position's draft is sampled from that position's
processed distribution q, which rejection sampling checks as any proposer's (the block's
positions do not see each other's draws, so q is exactly what the draft was drawn from).
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..errors import ModelLoadError
from ..kv.batched import BatchKV
from ..models.dflash import DFlashDrafter, OutputHead, build_drafter, read_drafter
from ..models.view import ModelView, tap_layers, tapped_columns
from ..monitor.memory import compute_dtype_bytes
from ..progress import phase
from .base import ChainGroup, ChainRow, Offer, kept_bytes
from .mtp import MTPGroup, MTPRow

logger = logging.getLogger(__name__)

SHIPPED_DIR = "dflash"  # a drafter beside the target's weights (the embedded tiny target has one)
# Context rows buffered per row while its group does not draft; a row idle longer keeps the
# newest (RoPE is relative; the drafter's context has a gap, as an MTP head's does).
MAX_PENDING_ROWS = 64


def drafter_dir(runtime) -> Path:
    """speculative.dflash_drafter (a dir or a Hugging Face id), else the one shipped with the target."""
    from ..models.loader import beside_target

    return beside_target(runtime.profile.speculative.dflash_drafter, runtime.target.path, SHIPPED_DIR,
                         "DFlash drafter", "dflash_drafter")


def load(runtime, method: str, fallback: bool = True) -> None:
    """The drafter, checked against the target; the target's layers it reads are tapped."""
    if runtime.dflash_drafter is not None:
        return
    path = drafter_dir(runtime)
    with phase(f"loading the DFlash drafter {path}"):
        view = runtime.view
        config, weights = read_drafter(path)
        target_config = runtime.target.config
        vocab = (target_config.get("text_config") or target_config).get("vocab_size") or runtime.vocab_size
        drafter = build_drafter(config, weights, int(view.inner.norm.weight.shape[0]), len(view.inner.layers),
                                int(vocab), view.inner.norm.weight.dtype, str(path))
        try:
            tap_layers(runtime.target.model, config.target_layer_ids)
        except ValueError as err:  # an EAGLE-3 head tapped others first
            raise ModelLoadError(f"{path}: {err} (one proposer that reads the target's layers per server)") from None
    logger.info("DFlash drafter %s: block %d, target layers %s, mask token %d, draft vocabulary %s", path,
                config.block_size, list(config.target_layer_ids), config.mask_token_id,
                config.draft_vocab_size or "the target's")
    runtime.dflash_drafter = drafter


def make_group(runtime, method: str, vocab_size: int) -> "DFlashGroup":
    return DFlashGroup(runtime.dflash_drafter, runtime.view, vocab_size, runtime.profile.speculative.head_context,
                       kept_bytes(runtime, kv_bytes_per_token(runtime, method)))


def kv_bytes_per_token(runtime, method: str) -> int:
    """Every drafter layer keeps keys and values of the context."""
    config = runtime.dflash_drafter.config
    per_layer = 2 * config.num_key_value_heads * config.head_dim
    return per_layer * config.num_hidden_layers * compute_dtype_bytes(runtime.target.model)


class DFlashGroup(MTPGroup):
    """MTP's row bookkeeping (pending states, observe, forget) with a block drafter."""

    method = "dflash"
    block_drafts = True

    def __init__(self, drafter: DFlashDrafter, view: ModelView, vocab_size: int, context: int = 0,
                 kept_bytes: int = 0):
        ChainGroup.__init__(self, BatchKV([0] * len(drafter.layers)), vocab_size, kept_bytes)
        self.drafter = drafter
        self.view = view
        self._keep_context(context)
        self.config = drafter.config
        self.chain_k_max = self.config.block_size - 1
        self.rows: dict[int, MTPRow] = {}
        self.target_width = int(view.inner.norm.weight.shape[0])
        self.head = OutputHead.of(drafter, view, vocab_size, self._dtype)
        self.block_logits: mx.array | None = None  # [n, deepest k, V] of the last proposal

    @property
    def _dtype(self):
        return self.drafter.fc.weight.dtype

    def _own_states(self, states: mx.array | None) -> mx.array | None:
        return tapped_columns(states, self.target_width, self.drafter.fused_width)

    def offer(self, row: ChainRow, alphas) -> Offer:
        return Offer(min(row.k, self.chain_k_max), chained=True)

    def _fresh_cache(self) -> list:
        return [KVCache() for _ in self.drafter.layers]

    def _join_now(self, key, committed, states, hidden_start=0, cache=None, reused=0) -> None:
        """The context so far (the columns the drafter reads) written into a fresh row (or one
        holding `reused` kept positions); its last committed token is the first block's head."""
        caches = cache if cache is not None else self._fresh_cache()
        count = 0 if states is None else states.shape[0]
        if count:
            ctx = self.drafter.hidden_norm(self.drafter.fc(states[None].astype(self._dtype)))
            start = mx.array([hidden_start])
        else:  # nothing to feed: one scratch position gives the caches their shapes
            ctx = mx.zeros((1, 1, self.config.hidden_size), dtype=self._dtype)
            start = mx.array([0])
        if count or not reused:
            for layer, layer_cache in zip(self.drafter.layers, caches):
                layer_cache.update_and_fetch(*layer.self_attn.keys_values(ctx, start))
        mx.eval([c.state for c in caches])
        self._add(key, caches, reused + count)
        self.rows[key] = MTPRow(hidden_start + count if count else len(committed) - 1, MAX_PENDING_ROWS)

    def _can_draft(self, row: ChainRow) -> bool:
        return True  # the block's head is the last committed token: there is always one

    def _feed(self, rows: list[ChainRow]) -> None:
        """Every row's pending context into the drafter's cache, in one batched write."""
        counts = [self.rows[row.key].num_pending for row in rows]
        width = max(counts)
        if width == 0:
            return
        positions = mx.array([self.rows[row.key].next_position for row in rows])
        blocks = []
        for row, count in zip(rows, counts):
            block = self.rows[row.key].take() if count else mx.zeros((0, self.drafter.fused_width), self._dtype)
            blocks.append(mx.pad(block.astype(self._dtype), [(0, width - count), (0, 0)]))
        self.kv.begin(width)
        self.drafter.context(mx.stack(blocks), positions, self.kv.layers)
        for index, count in enumerate(counts):
            self.kv.advance(index, count)

    def _catch_up(self, rows: list[ChainRow]) -> None:
        self._feed(rows)  # the block's head is the last committed token: the context is all fed

    def _first_logits(self, rows: list[ChainRow]) -> mx.array:
        """Feed the context, then one forward over every row's block: the logits of the positions
        this step drafts (the deepest row's k; the output head over all B - 1 cost SmolLM2's
        49k-token head 15 rows a step) kept for the chain's later steps."""
        self._feed(rows)
        size = self.config.block_size
        heads = [[row.committed[-1]] + [self.config.mask_token_id] * (size - 1) for row in rows]
        positions = mx.array([len(row.committed) - 1 for row in rows])
        self.kv.begin(size)  # the block is written past each row's context and never kept
        visible = mx.arange(self.kv.span)[None] < (self.kv.offsets + size)[:, None]
        embeds = self.view.embed(mx.array(heads)).astype(self._dtype)
        states = self.drafter(embeds, positions, self.kv.layers, visible[:, None, None, :])
        self.block_logits = self.head.target(states[:, 1:1 + max(row.k for row in rows)])
        return self.block_logits[:, 0]

    def _next_logits(self, tokens: mx.array) -> mx.array:
        """The next draft's logits were made with the block: the chain only reads them (at
        chain step `depth`, draft depth + 1)."""
        return self.block_logits[:, self.depth + 1]

    def settle(self, accepted: dict[int, int]) -> None:
        self.depth, self.block_logits = 0, None
