"""The target's own MTP head proposes from the target's last hidden state, for every row of
its method in one head forward per chain step.

Position t's MTP input is (h_t, token t+1) and it predicts token t+2. Rows with the target's
true h_t are kept in the head's cache; for k > 1 the head chains on its own output state, and
those chained positions are rolled back once the step is verified (the true states replace them).
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
from mlx.utils import tree_flatten

from ..kv.batched import BatchKV, layout_of
from ..kv.cache import cache_arrays, eval_cache, make_trimmable_cache
from ..models.checkpoint import load_mtp_head
from ..models.mtp import MTPHead
from ..models.view import ModelView
from ..monitor.memory import compute_dtype_bytes, kv_bytes_per_token as model_kv_bytes
from ..progress import phase
from .base import ChainGroup, ChainRow, kept_bytes, pad_rows

logger = logging.getLogger(__name__)

# Hidden rows buffered per row while its group does not draft. A probe makes every row of the
# group catch up at once, padded to the longest backlog, and on an MoE head each fed state reads
# experts: a row idle longer feeds only its last 16 (RoPE is relative; the head's KV has a gap).
MAX_PENDING_ROWS = 16


def load(runtime, method: str, fallback: bool = True) -> None:
    """The head from the target's checkpoint (its MTP layer)."""
    if runtime.mtp_head is None:
        with phase("loading the MTP head"):
            runtime.mtp_head = load_mtp_head(
                runtime.target, dequantize=runtime.profile.speculative.mtp_dequantize)


def make_group(runtime, method: str, vocab_size: int) -> "MTPGroup":
    return MTPGroup(runtime.mtp_head, runtime.view, vocab_size, runtime.profile.speculative.head_context,
                    kept_bytes(runtime, kv_bytes_per_token(runtime, method)))


def kv_bytes_per_token(runtime, method: str) -> int:
    """One decoder layer of the target's shape (the head's block)."""
    target = runtime.target
    return model_kv_bytes(target.config, compute_dtype_bytes(target.model), layers=1)


class MTPRow:
    """True hidden states not yet fed to the head, and where they start: a drafting row's backlog,
    or a joining row's context (capped at the group's `context`)."""

    def __init__(self, next_position: int, cap: float = MAX_PENDING_ROWS):
        self.cap = cap
        self.pending: list[mx.array] = []  # [n, H] blocks, oldest first
        self.num_pending = 0
        self.next_position = next_position  # absolute position of the first pending row

    def add(self, rows: mx.array) -> None:
        """Keep the most recent `cap` rows (RoPE is relative, so a gap is tolerable): older blocks
        are dropped whole, the oldest kept one sliced; never joined here (a join per step chained
        every idle step's states into the next probe's catch-up: 16 rows after 64 idle steps
        read in 20 ms, now 2 ms)."""
        self.pending.append(rows)
        self.num_pending += rows.shape[0]
        while self.num_pending - self.pending[0].shape[0] >= self.cap:
            self._drop(self.pending.pop(0).shape[0])
        excess = self.num_pending - self.cap
        if excess > 0:
            self.pending[0] = self.pending[0][excess:]
            self._drop(excess)

    def _drop(self, count: int) -> None:
        self.num_pending -= count
        self.next_position += count

    def take(self, count: int | None = None) -> mx.array:
        """The oldest `count` pending rows [n, H] (all by default); they count as fed from now on."""
        rows = mx.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        count = self.num_pending if count is None else count
        self.next_position += count
        rest = rows[count:]
        self.pending, self.num_pending = ([rest] if rest.shape[0] else []), rest.shape[0]
        return rows[:count]


class MTPGroup(ChainGroup):
    method = "mtp"
    needs_hidden = True
    attention_alone: bool | None = None  # whether a join may skip the block's MLP (checked once)

    def __init__(self, head: MTPHead, view: ModelView, vocab_size: int, context: int = 0, kept_bytes: int = 0):
        self.layout_cache = lambda: make_trimmable_cache(view.model)[-1:]
        super().__init__(BatchKV(layout_of(self.layout_cache())), vocab_size, kept_bytes)
        self.head = head
        self.view = view
        self.rows: dict[int, MTPRow] = {}
        self.state: mx.array | None = None  # the head's output state chained to the next step
        self._keep_context(context)

    def _keep_context(self, context: int) -> None:
        self.context = context or math.inf  # a joining row's newest states kept (0: all)
        self.joins = self.joined_positions = 0  # for status(): rows joined, positions that fed

    def _fresh_cache(self) -> list:
        return self.layout_cache()

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        # The head's prefill waits for the row's first proposal, as a draft model's does
        # (base.start_rows): a row whose speculation stays off, or that finishes first, never pays it.
        # It keeps the columns this head reads, as observe() does for the states that follow, and
        # only the newest `context` of them where the profile bounds it (not by default: the GLM-5
        # replica's MTP head accepted 0.08 at 256 of 730 positions against 0.62 with them all).
        states = self._own_states(prompt_hidden)
        if states is None:  # none kept (or kept before this head's layers were tapped)
            self.waiting[key] = MTPRow(len(committed) - 1, self.context)
        else:
            self.waiting[key] = MTPRow(hidden_start, self.context)
            self.waiting[key].add(states)

    def _take_on(self, row: ChainRow, kept: MTPRow) -> None:
        cache, reused = self._kept_prefix(row.committed, kept)
        start, count = kept.next_position, kept.num_pending
        self._join_now(row.key, row.committed, kept.take() if count else None, start, cache, reused)
        self.joins, self.joined_positions = self.joins + 1, self.joined_positions + count

    def _kept_prefix(self, committed: list[int], kept: MTPRow) -> tuple[list, int]:
        """A fresh cache with the head's KV of the longest kept prefix of `committed` that the
        row's states follow on from, and its positions; the states it covers leave `kept`. The
        next turn of a conversation then feeds the head its new positions only, as the target
        prefills only its new tokens (SmolLM2's EAGLE-3 head re-joined 892 positions in 118 ms)."""
        cache = self._fresh_cache()
        matched, entry = self.kept.lookup(committed)
        # position j of a head's KV read the target's state at j and token j + 1
        reused = min(matched - 1, kept.next_position + kept.num_pending - 1)
        if entry is None or reused <= 0 or kept.next_position > reused:
            return cache, 0
        self._copy_kept(cache, entry, reused)
        if reused > kept.next_position:
            kept.take(reused - kept.next_position)
        return cache, reused

    def leave(self, key: int) -> None:
        """A row whose head KV follows its tokens from position 0 without a gap keeps it, by them."""
        if key in self.row_keys and key in self.tokens and self.kept.max_bytes:
            fed = self.kv.lengths[self.row_keys.index(key)]
            if fed == self.rows[key].next_position:  # no gap: position j is state j's
                self._keep_row(key, self.tokens[key][:fed + 1], fed)
        super().leave(key)

    def status(self) -> dict:
        """Its joins (rows that took their context, the positions that fed) and kept prefixes."""
        context = 0 if self.context == math.inf else self.context
        return {"head_context": context, "joins": self.joins, "joined_positions": self.joined_positions,
                "kept_prefixes": self.kept.as_dict()}

    def _join_now(self, key, committed, states, hidden_start=0, cache=None, reused=0) -> None:
        """Feed the states so far (the columns this head reads) into a fresh row (or one holding
        `reused` kept positions), all but the last: its logits make the first proposal, together
        with whatever the next step adds."""
        cache = cache if cache is not None else self._fresh_cache()
        row = MTPRow(hidden_start)
        count = 0 if states is None else states.shape[0]
        if count > 1:
            hidden = states[:-1].astype(self._dtype)
            followers = mx.array(committed[hidden_start + 1:hidden_start + count])
            self._head_pass(followers[None], hidden[None], cache[0], outputs=False)
        elif not reused:  # nothing to feed yet: one scratch position gives the cache its shapes
            hidden = mx.zeros((1, self._width), dtype=self._dtype)
            self._head_pass(mx.array([[0]]), hidden[None], cache[0], outputs=False)
        eval_cache(cache)
        row.next_position += max(0, count - 1)
        if count:
            row.add(states[-1:])
        self._add(key, cache, reused + max(0, count - 1))
        self.rows[key] = row

    def _forget(self, key: int) -> None:
        self.rows.pop(key, None)

    def _head_pass(self, tokens: mx.array, hidden: mx.array, cache, outputs: bool = True):
        """The head over these positions, kept in `cache`. Where no output is read (a join, the
        states before a row's last), the block's attention alone writes the keys and values, if
        it writes what the whole block writes (checked once): an MoE block's experts were most of
        a join (tiny-moe's 16 rows: 520 -> 138 ms)."""
        if not outputs and self._attention_alone():
            return self.head.feed(tokens, hidden, self.view, cache)
        return self.head.hidden(tokens, hidden, self.view, cache)

    def _attention_alone(self) -> bool:
        if self.attention_alone is None:
            self.attention_alone = self._attention_alone_writes_the_same()
        return self.attention_alone

    def _attention_alone_writes_the_same(self) -> bool:
        tokens = mx.array([[1, 2, 3]])
        hidden = mx.random.normal((1, 3, self._width), key=mx.random.key(0)).astype(self._dtype)
        whole, alone = self.layout_cache(), self.layout_cache()
        try:
            self.head(tokens, hidden, self.view, whole[0])
            self.head.feed(tokens, hidden, self.view, alone[0])
        except (AttributeError, TypeError, ValueError):  # a block of another shape
            return False
        arrays = [[a for _, a in tree_flatten(cache_arrays(c)) if isinstance(a, mx.array)] for c in (whole, alone)]
        same = len(arrays[0]) == len(arrays[1]) and all(mx.array_equal(a, b).item() for a, b in zip(*arrays))
        if not same:
            logger.info("%s head: its attention alone writes other keys than its block; joins run the block", self.method)
        return same

    @property
    def _dtype(self):
        return self.head.hnorm.weight.dtype

    @property
    def _width(self) -> int:  # the hidden size the head reads
        return self.head.hnorm.weight.shape[0]

    def _own_states(self, states: mx.array | None) -> mx.array | None:
        """The columns of the target's states this head reads (the final hidden state; layers
        tapped for an EAGLE-3 head follow it)."""
        return None if states is None else states[..., :self._width]

    def observe(self, key: int, hidden: mx.array) -> None:
        hidden = self._own_states(hidden)
        if hidden is None:
            return
        if key in self.waiting:
            self.waiting[key].add(hidden)
        elif key in self.rows:
            self.rows[key].add(hidden)

    def _can_draft(self, row: ChainRow) -> bool:
        return self.rows[row.key].num_pending > 0

    def _catch_up(self, rows: list[ChainRow]) -> None:
        """Each row's pending states but its last, written as keys and values alone."""
        counts = [max(self.rows[row.key].num_pending - 1, 0) for row in rows]
        if any(counts):
            self._write(*self._take(rows, counts), outputs=False)

    def _first_logits(self, rows: list[ChainRow]) -> mx.array:
        """Feed every row its pending states; -> the logits after its last. An MoE head runs its
        experts on that last position only: the rest just write keys and values (a probe after
        idleness feeds up to 16 states a row, and each would read its own experts)."""
        counts = [self.rows[row.key].num_pending for row in rows]
        width = max(counts)
        followers, hidden_rows = self._take(rows, counts)
        if width > 1 and self._moe_block and self._attention_alone():
            self._write([f[:max(c - 1, 0)] for f, c in zip(followers, counts)], [h[:-1] for h in hidden_rows],
                        outputs=False)
            followers = [f[c - 1:c] if c else [] for f, c in zip(followers, counts)]
            hidden_rows = [h[-1:] for h in hidden_rows]
        out = self._write(followers, hidden_rows)
        last = mx.array([max(h.shape[0] - 1, 0) for h in hidden_rows])
        self.state = out[mx.arange(len(rows)), last][:, None]
        # Logits at each row's last state alone: a vocabulary's projection per fed state made a
        # probe after idleness 1.82x a plain step, now 1.64x (SmolLM2, 16 rows, 17 states a row).
        return self.head.logits(self.state, self.view)[:, 0]

    def _take(self, rows: list[ChainRow], counts: list[int]) -> tuple[list[list[int]], list[mx.array]]:
        """Each row's oldest `count` pending states, now fed, and the tokens that follow them."""
        followers, hidden_rows = [], []
        for row, count in zip(rows, counts):
            state = self.rows[row.key]
            start = state.next_position
            followers.append(row.committed[start + 1:start + 1 + count])
            block = state.take(count) if count else mx.zeros((0, self._width), dtype=self._dtype)
            hidden_rows.append(block.astype(self._dtype))
        return followers, hidden_rows

    def _write(self, followers: list[list[int]], hidden_rows: list[mx.array], outputs: bool = True):
        """One batched head pass over each row's states (padded to the longest), kept. -> the
        head's output states (None where `outputs` is off and the attention alone wrote them)."""
        width = max(h.shape[0] for h in hidden_rows)
        hidden = mx.stack([mx.pad(h, [(0, width - h.shape[0]), (0, 0)]) for h in hidden_rows])
        self.kv.begin(width)
        out = self._head_pass(pad_rows(followers, width), hidden, self.kv.layers[0], outputs)
        for index, h in enumerate(hidden_rows):
            self.kv.advance(index, h.shape[0])
        return out

    @property
    def _moe_block(self) -> bool:
        """Whether the head's block is an MoE layer (mlx-lm's `switch_mlp`)."""
        return hasattr(getattr(getattr(self.head, "block", None), "mlp", None), "switch_mlp")

    def _next_logits(self, tokens: mx.array) -> mx.array:
        self.kv.begin(1)
        logits, out = self.head(tokens[:, None], self.state, self.view, self.kv.layers[0])
        self.state = out
        for index in range(self.kv.num_rows):
            self.kv.advance(index, 1)
        return logits[:, 0]

    def settle(self, accepted: dict[int, int]) -> None:
        """Chained positions never stay: the next step feeds the true states instead."""
        for index in range(self.kv.num_rows):
            self.kv.lengths[index] -= self.depth
        self.depth, self.state = 0, None
