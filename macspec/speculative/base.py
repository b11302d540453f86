"""Proposers: something that guesses the target's next k tokens, for every row of a batch.

A proposer serves all running rows of its method at once (a `ProposerGroup`): the engine asks
it for drafts for the whole batch, verifies them, then tells it how many each row kept. Model
proposers (a draft model, an MTP head) run one forward per chain step over all their rows and
build the chain lazily, so the drafts, the target's verification and the acceptance are
evaluated together in the step's single host sync.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..kv.batched import BatchKV
from ..kv.cache import leaves
from ..kv.prefix import PrefixCache
from ..sampling import (Rng, RowContext, SamplingParams, fast_exp, processed_logits, processed_logprobs,
                        sample_from_probs)


@dataclass
class ChainRow:
    """One row's part in this step's proposal."""

    key: int  # the request id
    context: RowContext  # its tokens so far and what shapes its distribution
    k: int  # drafts it will verify (0: the row only keeps its proposer state current)
    rng: Rng
    offer: "Offer | None" = None  # what its proposer offered for this step's plan

    @property
    def committed(self) -> list[int]:
        """Every token so far, prompt included."""
        return self.context.committed

    @property
    def params(self) -> SamplingParams:
        return self.context.params


@dataclass
class Offer:
    """What a proposer can draft for one row this step, told to the plan before it."""

    k_max: int  # the most it can draft (a lookup: the length of its match's draft)
    kind: str = "drafts"  # whose acceptance applies: "drafts" (the method's), or a suffix
    # match's source, "own" (the request's tokens) or "recent" (only other requests' answers)
    chained: bool = False  # drafting runs the group's model chain (a lookup's does not)
    tokens: list[int] | None = None  # a lookup's draft, found for the plan
    probs: list[float] | None = None  # a lookup's path probability per position

    def alphas(self, measured: list[float]) -> list[float]:
        """Expected acceptance per position: what this kind achieved on the request, capped for
        a lookup by the share of matching occurrences that agree on each token given the ones
        before it (a match seen once promises nothing more than the kind's record)."""
        if self.probs is None:
            return measured
        out, before = [], 1.0
        for alpha, p in zip(measured, self.probs):
            out.append(min(alpha, p / before if before > 0 else 0.0))
            before = p
        return out


@dataclass
class Drafts:
    tokens: mx.array | list[int]  # [K >= k] lazy ids, or host ids (a lookup proposer)
    # Processed draft probabilities [k, V] for rejection sampling; None = deterministic.
    q: mx.array | None = None


class ProposerGroup(ABC):
    method: str = "base"
    needs_hidden: bool = False  # wants the target's hidden states after every forward
    # Drafts built lazily and evaluated in the step's one sync: timed by calibration (see
    # calibrate.py), since timing propose() would see only the graph being built.
    lazy_chain: bool = False
    chain_k_max: int | None = None  # the deepest its chain drafts whatever k (None: k itself)
    block_drafts: bool = False  # one forward drafts every position: its cost does not grow with k

    @abstractmethod
    def join(self, key: int, committed: list[int], prompt_hidden: mx.array | None,
             hidden_start: int = 0) -> None:
        """A new row whose prompt the target has just prefilled and whose first token is
        committed; `prompt_hidden` holds the target's states from position `hidden_start` on
        (earlier ones came from a prefix cache)."""

    @abstractmethod
    def leave(self, key: int) -> None:
        """Forget a row (finished, cancelled, or its speculation was dropped)."""

    @property
    @abstractmethod
    def keys(self) -> list[int]:
        """The rows it holds."""

    @abstractmethod
    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        """Drafts for the rows with k > 0 (lazy where the proposer is a model). `rows` covers
        every row the group holds."""

    def start_rows(self, rows: list[ChainRow]) -> None:
        """Before propose(): rows drafting (k > 0) for the first time take their context. A
        model proposer defers its prefill to here, so a row that never drafts never pays it;
        the speculator times it apart from the step (a request's cost, as its prefill is)."""

    def offer(self, row: ChainRow, alphas: Callable[[str], list[float]]) -> "Offer":
        """Before the plan: what it can draft for the row this step (at most `row.k`), and from
        which kind of draft. `alphas(kind)`: the request's measured acceptance per position for
        that kind. A lookup finds its draft here and hands it to propose() in the offer."""
        return Offer(row.k, chained=self.lazy_chain)

    def settle(self, accepted: dict[int, int]) -> None:
        """After verification: row key -> how many of its drafts were accepted."""

    def observe(self, key: int, hidden: mx.array) -> None:
        """After a target forward (only when `needs_hidden`): the target's states [n, H] for the
        positions just before each of the n tokens that step committed."""

    def cache_arrays(self) -> list:
        """Arrays to evaluate with the step (the proposer's own caches)."""
        return []

    def status(self) -> dict:
        """What /v1/status shows of it (nothing by default)."""
        return {}


class ChainGroup(ProposerGroup):
    """A model proposer over a batched KV: step 0 feeds each row what it has not seen yet,
    then each chain step feeds every row its own previous draft."""

    lazy_chain = True

    def __init__(self, kv: BatchKV, vocab_size: int, kept_bytes: int = 0):
        self.kv = kv
        self.vocab_size = vocab_size  # the target's: drafts beyond it could never be accepted
        self.kept = PrefixCache(kept_bytes)  # which left rows' KV is kept, by the tokens that made it
        self.kept_kv: dict[int, list[tuple[mx.array, ...]]] = {}  # kept entry -> its KV
        self.row_keys: list[int] = []
        self.tokens: dict[int, list[int]] = {}  # row -> its request's committed tokens (a leaving row's key)
        # rows joined but not yet taken on (start_rows), with what join() kept for them
        self.waiting: dict[int, object] = {}
        self.depth = 0  # chain steps fed in the last proposal (rolled back by settle)
        self.reach: dict[int, int] = {}  # row -> the most tokens it could hold by the next step
        # had it drafted in every step since its last proposal (beyond it: plain steps ran)

    @property
    def keys(self) -> list[int]:
        return [*self.row_keys, *self.waiting]

    def start_rows(self, rows: list[ChainRow]) -> None:
        """Rows drafting for the first time take their context; rows that plain steps left
        behind feed their backlog, both before the step and timed apart from it. Fed in the
        step, a backlog was priced into the window's cost and every probe's verdict (tiny-moe's
        draft, 16 rows, 17 tokens a row: 15 ms of a ~170 ms step); apart, it is paid once per
        idle stretch (0.9 % of that one)."""
        for row in rows:
            if row.k and row.key in self.waiting:
                self._take_on(row, self.waiting.pop(row.key))
                self.tokens[row.key] = row.committed
        by_key = {row.key: row for row in rows}
        ordered = [by_key[key] for key in self.row_keys]
        if any(len(row.committed) > self.reach.get(row.key, len(row.committed)) for row in ordered):
            self._catch_up(ordered)
            mx.eval(self.cache_arrays())
        self.reach.update((row.key, len(row.committed)) for row in ordered)  # caught up

    def _catch_up(self, rows: list[ChainRow]) -> None:
        """Feed each row (in the KV's order) what it has not seen, all but what the step's first
        forward needs to draft from."""

    @abstractmethod
    def _take_on(self, row: ChainRow, kept) -> None:
        """A waiting row's prefill, from what join() kept for it."""

    def _add(self, key: int, cache: list, length: int) -> None:
        self.kv.add_row(cache, length)
        self.row_keys.append(key)

    def leave(self, key: int) -> None:
        self.waiting.pop(key, None)
        if key in self.row_keys:
            index = self.row_keys.index(key)
            self.kv.remove_row(index)
            del self.row_keys[index]
            self.reach.pop(key, None)
            self.tokens.pop(key, None)
            self._forget(key)

    def _forget(self, key: int) -> None:
        """Drop per-row state kept beside the KV."""

    def _keep_row(self, key: int, tokens: list[int], length: int) -> None:
        """A leaving row's first `length` positions of KV kept under `tokens`, for the next turn
        of its conversation (the least recently used go first)."""
        entry, dropped = self.kept.store(tokens, self.kv.row_nbytes(length))
        for old in dropped:
            self.kept_kv.pop(old, None)
        if entry is not None:
            self.kept_kv[entry] = self.kv.export_row(self.row_keys.index(key), length)

    def _copy_kept(self, cache: list, entry: int, length: int) -> None:
        """A kept entry's first `length` positions into a new row's cache."""
        for layer_cache, arrays in zip(leaves(cache), self.kept_kv[entry]):
            layer_cache.update_and_fetch(*(a[:, :, :length] for a in arrays))

    @abstractmethod
    def _first_logits(self, rows: list[ChainRow]) -> mx.array:
        """Feed each row its unseen inputs; -> logits [n, V] for its first draft."""

    @abstractmethod
    def _next_logits(self, tokens: mx.array) -> mx.array:
        """Feed every row its draft `tokens` [n]; -> logits [n, V] for the next draft."""

    def _can_draft(self, row: ChainRow) -> bool:
        return True

    def propose(self, rows: list[ChainRow]) -> dict[int, Drafts]:
        self.start_rows(rows)  # done already when the speculator called it
        by_key = {row.key: row for row in rows}
        rows = [by_key[key] for key in self.row_keys]  # the KV's row order
        able = [self._can_draft(row) for row in rows]
        depth = max((row.k for row, ok in zip(rows, able) if ok), default=0)
        self.depth = 0
        if depth == 0:
            return {}
        logits = self._first_logits(rows)
        self.reach = {row.key: len(row.committed) + row.k + 1 for row in rows}
        chain: list[mx.array] = []
        q_rows: list[list[mx.array]] = [[] for _ in rows]
        for j in range(depth):
            chain.append(self._pick(logits[:, :self.vocab_size], rows, chain, q_rows, j))
            if j + 1 < depth:
                logits = self._next_logits(chain[-1])
                self.depth += 1
        tokens = mx.stack(chain, axis=1)  # [n, depth]
        return {row.key: Drafts(tokens[i], mx.stack(q_rows[i]) if q_rows[i] else None)
                for i, row in enumerate(rows) if row.k and able[i]}

    @staticmethod
    def _pick(logits: mx.array, rows: list[ChainRow], chain: list[mx.array],
              q_rows: list[list[mx.array]], j: int) -> mx.array:
        """Draft j for every row: argmax, or processed like the target (penalties, bias, the
        grammar's mask where it is known, sampling)."""
        argmax = mx.argmax(logits, axis=-1)
        special = [i for i, row in enumerate(rows) if j < row.k and not row.context.is_plain_greedy]
        if not special:
            return argmax
        picks = [argmax[i] for i in range(len(rows))]
        for i in special:
            row = rows[i]
            drafted = mx.stack([c[i] for c in chain]) if chain else []
            if row.params.is_greedy:
                picks[i] = mx.argmax(processed_logits(logits[i:i + 1], row.context, drafted, first=j)[0])
            else:
                q = fast_exp(processed_logprobs(logits[i:i + 1], row.context, drafted, first=j)[0])
                picks[i] = sample_from_probs(q, row.rng.next())
                q_rows[i].append(q)
        return mx.stack(picks).astype(argmax.dtype)

    def cache_arrays(self) -> list:
        return [layer.buffers for layer in self.kv.leaves if layer.buffers is not None]


def kept_bytes(runtime, per_token: int) -> int:
    """What a proposer keeps of left rows' KV (their prefixes, for the next turn): as many
    tokens' worth as the target's prefix cache holds, at the proposer's bytes a token."""
    from ..monitor.memory import compute_dtype_bytes, kv_bytes_per_token

    target = kv_bytes_per_token(runtime.target.config, compute_dtype_bytes(runtime.target.model))
    return runtime.profile.kv.prefix_cache_mb * 2**20 * per_token // max(target, 1)


def pad_rows(rows: list[list[int]], width: int) -> mx.array:
    return mx.array([r + [0] * (width - len(r)) for r in rows], dtype=mx.int32)
