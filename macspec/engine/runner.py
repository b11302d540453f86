"""Everything the target model keeps between forwards, behind a small set of int-only ops.

Under tensor parallelism every rank holds one of these for its shard and applies the same ops
in the same order (rank 0 decides, workers replay its plan), so the ranks cannot diverge.
Ops take ints and one optional trailing list of ints: exactly what a StepPlan can carry.
Prefix entries may be written to disk and read back after a restart (kv/disk.py): each rank
its own shard's file; a load is agreed by every rank or by none.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..kv.batched import BatchKV, layout_of
from ..kv.cache import cache_arrays, leaves, make_trimmable_cache
from ..kv.disk import DiskPrefixStore
from ..models.view import ModelView

NO_ENTRY = -1  # "no prefix-cache entry" in ops


class TargetRunner:
    def __init__(self, view: ModelView, group=None, disk: DiskPrefixStore | None = None):
        self.view = view
        self.group = group  # the tensor-parallel group (None: one process)
        self.disk = disk  # this rank's prefix entries on disk (None: off)
        self.layout = layout_of(make_trimmable_cache(view.model))  # CacheList layers, e.g. GLM-5
        self.kv = BatchKV(self.layout)
        self.slots: dict[int, list] = {}  # request id -> single-row cache while prefilling
        self.prefixes: dict[int, list[tuple[mx.array, ...]]] = {}  # prefix-cache entry -> KV
        self.prefix_states: dict[int, mx.array] = {}  # entry -> the target's states (MTP), rank 0

    # ---- prefill slots ---------------------------------------------------------------
    def open_slot(self, slot: int, entry: int, length: int) -> None:
        """A fresh cache for request `slot`, seeded with `length` positions of a prefix entry."""
        cache = make_trimmable_cache(self.view.model)
        if entry != NO_ENTRY:
            for layer_cache, arrays in zip(leaves(cache), self.prefixes[entry]):
                layer_cache.update_and_fetch(*(a[:, :, :length] for a in arrays))
        self.slots[slot] = cache

    def prefill(self, slot: int, tokens: list[int]) -> tuple[mx.array, mx.array]:
        """-> (states [n, D], logits of the last position [1, V]); every rank evaluates the same
        arrays so the model's collectives run in the same order everywhere."""
        cache = self.slots[slot]
        hidden = self.view.hidden(mx.array(tokens)[None], cache)
        logits = self.view.logits(hidden[0, -1:])
        states = self.view.states(hidden)  # + tapped layers' outputs (EAGLE-3)
        mx.eval(states, logits, cache_arrays(cache))
        return states[0], logits

    def slot_to_row(self, slot: int, length: int) -> None:
        self.kv.add_row(self.slots.pop(slot), length)

    def close_slot(self, slot: int, entry: int, length: int) -> None:
        cache = self.slots.pop(slot)
        if entry != NO_ENTRY:
            self._keep_prefix(cache, entry, length)

    def share_slot_prefix(self, slot: int, entry: int, length: int) -> None:
        """Store a prefilled slot's first `length` positions as a prefix entry; it stays open."""
        self._keep_prefix(self.slots[slot], entry, length)

    def _keep_prefix(self, cache, entry: int, length: int) -> None:
        self.prefixes[entry] = [tuple(mx.contiguous(a[:, :, :length]) for a in c.state[:2])
                                for c in leaves(cache)]
        mx.eval(self.prefixes[entry])

    def slot_nbytes(self, slot: int, length: int) -> int:
        return sum(a[:, :, :length].nbytes for c in leaves(self.slots[slot]) for a in c.state[:2])

    @property
    def states_width(self) -> int:
        """The width of the states prefill and forward return (ModelView.states)."""
        return self.view.states_width

    # ---- batched decode --------------------------------------------------------------
    needs_host_tokens = False  # one process: the window stays lazy until the step's sync

    def forward(self, tokens: mx.array, host_tokens: list[list[int]] | None) -> tuple[mx.array, mx.array]:
        """The step's window [B, W] -> (logits, hidden), lazy (MirroredRunner: evaluated, its
        peers given `host_tokens`)."""
        return self.forward_lazy(tokens)

    def decode(self, rows: int, window: int, tokens: list[int]) -> tuple[mx.array, mx.array]:
        """One forward of `window` positions for every row -> (logits, hidden), both evaluated."""
        self.kv.begin(window)
        batch = mx.array(tokens, dtype=mx.int32).reshape(rows, window)
        logits, hidden = self.view.forward(batch, self.kv.layers)
        mx.eval(logits, hidden)
        return logits, hidden

    def forward_lazy(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """decode() without evaluating: the engine reads the result back with the drafts and the
        acceptance in one sync (one process only: peers need the tokens as ints)."""
        self.kv.begin(tokens.shape[1])
        return self.view.forward(tokens, self.kv.layers)

    def advance(self, counts: list[int]) -> None:
        """Row i keeps counts[i] of the positions the last decode wrote (the rest roll back)."""
        for index, count in enumerate(counts):
            self.kv.advance(index, count)

    def remove_row(self, index: int, entry: int, length: int) -> None:
        if entry != NO_ENTRY:
            self.prefixes[entry] = self.kv.export_row(index, length)
        self.kv.remove_row(index)

    def row_nbytes(self, length: int) -> int:
        return self.kv.row_nbytes(length)

    def drop_prefixes(self, entries: list[int]) -> None:
        for entry in entries:
            self.prefixes.pop(entry, None)
            self.prefix_states.pop(entry, None)

    # ---- prefix entries on disk --------------------------------------------------------
    def persist_prefix(self, entry: int, tokens: list[int]) -> None:
        """Write a kept entry (and its states, on rank 0) to disk: a copy, no compute."""
        if self.disk is not None and entry in self.prefixes:
            self.disk.save(tokens, self.prefixes[entry], self.prefix_states.get(entry))

    def disk_match(self, prompt: list[int]) -> int:
        """Tokens `prompt` shares with this rank's best on-disk entry (0: none); rank 0 reads it."""
        return self.disk.longest(prompt)[0] if self.disk is not None else 0

    def load_prefix(self, entry: int, tokens: list[int]) -> bool:
        """The first len(tokens) positions of the on-disk entry sharing `tokens` become entry
        `entry`. Every rank must load its shard, else none keeps it: -> whether all did."""
        loaded = self._read_prefix(tokens)
        if self.group is not None:  # one rank's damaged or evicted file means a cold prefill
            agreed = mx.distributed.all_sum(mx.array(int(loaded is not None)), group=self.group,
                                            stream=mx.cpu)
            if agreed.item() < self.group.size():
                loaded = None
        if loaded is None:
            return False
        self.prefixes[entry], states = loaded
        if states is not None and states.shape[0] >= len(tokens):
            self.prefix_states[entry] = states[:len(tokens)]
        return True

    def _read_prefix(self, tokens: list[int]):
        shared, found = self.disk.longest(tokens) if self.disk is not None else (0, None)
        if found is None or shared < len(tokens):
            return None
        loaded = self.disk.load(found, sum(max(1, n) for n in self.layout))  # leaf caches
        if loaded is None:
            return None
        layers = [tuple(mx.contiguous(a[:, :, :len(tokens)]) for a in leaf) for leaf in loaded[0]]
        mx.eval(layers)
        return layers, loaded[1]

    def reset(self) -> None:
        """Forget running rows and slots after a failed step (prefix entries stay valid)."""
        self.kv = BatchKV(self.layout)
        self.slots.clear()

    # ---- housekeeping ----------------------------------------------------------------
    def time_forward(self, rows: int, window: int, repeats: int,
                     text: mx.array | None = None) -> list[float]:
        """Seconds per forward at (rows, window) on scratch rows of a 16-token prompt; `text`
        [rows, 16 + window] gives each row's prompt and window (else fixed random tokens)."""
        kv = BatchKV(self.layout)
        for row in range(rows):
            prompt = mx.array(list(range(1, 17)))[None] if text is None else text[row:row + 1, :16]
            cache = make_trimmable_cache(self.view.model)
            mx.eval(self.view.hidden(prompt, cache), cache_arrays(cache))
            kv.add_row(cache, prompt.shape[1])
        # Distinct tokens per row and position, the same on every rank (a fixed key): one token
        # repeated routes every position of an MoE target to the same experts, so the window
        # looked nearly free and the policy drafted where a real window loses.
        vocab = int(self.view.inner.embed_tokens.weight.shape[0])
        tokens = mx.random.randint(1, max(2, min(vocab, 4096)), (rows, window),
                                   key=mx.random.key(rows * 64 + window)) if text is None else text[:, 16:]
        times = []
        for _ in range(repeats):
            kv.begin(window)
            t0 = time.perf_counter()
            logits, hidden = self.view.forward(tokens, kv.layers)
            mx.eval(logits, hidden)
            times.append(time.perf_counter() - t0)
        return times

    def idle(self, heartbeat_s: float) -> None:
        """One process has no peers to keep alive (MirroredRunner sends heartbeats)."""

    def heartbeat(self) -> None:
        """Nothing to do: the plan that carried it proved both sides alive."""

    def shutdown(self) -> None:
        """Workers leave their loop after this op; rank 0 stops sending."""

    def check_hidden(self) -> bool:
        """ModelView.hidden_is_final, as an op: under TP every rank runs the forward."""
        return self.view.hidden_is_final()
