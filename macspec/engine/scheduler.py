"""Which requests run: the waiting queue, admission (batch size, KV budget, prefix cache),
prompt chunks for prefill, and the rows of the batched decode.

Sequences move waiting -> prefilling -> running; `running[i]` is row i of the runner's batched
KV. The scheduler talks to the runner only to open, promote and close slots and rows, so under
tensor parallelism every such decision is one op in rank 0's plan. Prefix entries go to disk
between steps (at admission) and come back from it before a lookup (after a restart).
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from .. import faults
from ..errors import RequestError
from ..kv.prefix import PrefixCache
from ..models.view import join_states
from ..monitor.memory import MB, KVBudget
from .runner import NO_ENTRY
from .sequence import Sequence


class Scheduler:
    def __init__(self, runner, memory: KVBudget, prefix_cache: PrefixCache, max_batch: int,
                 prefill_chunk: int):
        self.runner = runner
        self.memory = memory
        self.prefix_cache = prefix_cache
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefix_states = runner.prefix_states  # entry -> the target's states it starts with
        self.to_persist: list[tuple[int, list[int]]] = []  # entries to write to disk (persist)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; refused (RequestError) when its KV at full length exceeds the budget."""
        if seq.kv_need > self.memory.budget:
            req = seq.request
            raise RequestError(
                f"this request needs {seq.kv_need / MB:.1f} MB of KV at full length (prompt {len(req.prompt)} "
                f"+ max_tokens {req.max_tokens} tokens) but the server's KV budget is "
                f"{self.memory.budget / MB:.1f} MB ({self.memory.source}); lower max_tokens", "max_tokens")
        self.waiting.append(seq)

    def admit(self) -> None:
        """Waiting requests start prefill, in order, while the batch and the KV budget allow."""
        self.persist()
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch:
            if not self._memory_for(self.waiting[0]):
                return
            seq = self.waiting.popleft()
            self.memory.reserved += seq.kv_need  # held until the sequence leaves (_release)
            seq.kv_held = seq.kv_need
            self.prefilling.append(seq)  # first: a failed lookup fails it with the step, not lost
            faults.check("admit")
            self._seat(seq, *self._lookup(seq))

    def _seat(self, seq: Sequence, reused: int, entry: int | None) -> None:
        """Open `seq`'s slot on the first `reused` positions of `entry` (None: from scratch)."""
        self.runner.open_slot(seq.request.id, NO_ENTRY if entry is None else entry, reused)
        seq.prefill_done = seq.reused_prefix = reused
        # a row keeping the target's states starts from the entry's (a head's row finds them
        # there: _lookup); a plain row whose entry kept fewer keeps none (they would not start at 0)
        kept = self._kept_states(entry) if entry is not None and seq.keeps_states else None
        seq.states = [kept[:reused]] if kept is not None and kept.shape[0] >= reused else []
        seq.keeps_states = seq.keeps_states and (bool(seq.states) or not reused)

    def _lookup(self, seq: Sequence) -> tuple[int, int | None]:
        """The longest cached prefix `seq` can use: a row whose head reads the target's states
        (MTP) only as far as its entry kept them."""
        self._load_from_disk(seq.prompt)
        if not _needs_states(seq):
            return self.prefix_cache.lookup(seq.prompt)
        kept = lambda entry: 0 if (states := self._kept_states(entry)) is None else states.shape[0]  # noqa: E731
        return self.prefix_cache.lookup(seq.prompt, usable=kept)

    def _kept_states(self, entry: int) -> mx.array | None:
        """The target's states `entry` kept, if any at today's width (entries kept before a head
        tapped more of the target's layers are narrower)."""
        states = self.prefix_states.get(entry)
        return states if states is not None and states.shape[-1] == self.runner.states_width else None

    def _memory_for(self, seq: Sequence) -> bool:
        """Room for `seq`'s KV? Under pressure, finished requests' prefixes go first, then MLX's
        buffer cache; otherwise it waits (in order) for running requests to finish."""
        while not self.memory.fits(seq.kv_need, self.prefix_cache.nbytes):
            entry = self.prefix_cache.evict_oldest()
            if entry is None:
                self.memory.relieve_pressure()
                if not seq.waited_for_memory:
                    seq.waited_for_memory = True
                    self.memory.waits += 1
                return False
            self._drop_prefixes([entry])
        return True

    def next_prefill(self, budget: int) -> tuple[Sequence, list[int]] | None:
        """The prompt chunk to prefill next, if it fits the `budget` of tokens this step has left:
        a step prefills at most one chunk's worth, so decoding never stalls behind a long prompt
        for more than one chunk, while short (or cached) prompts queued behind each other all go
        in one step (one a step held 16 arrivals' first tokens for up to 16 steps)."""
        if not self.prefilling:
            return None
        seq = self.prefilling[0]
        chunk = seq.prompt[seq.prefill_done:seq.prefill_done + self.prefill_chunk]
        return (seq, chunk) if len(chunk) <= budget else None

    def prefilled(self, seq: Sequence) -> None:
        """Its prompt is in: a row of the batch, or (finished on its first token) closed with
        its KV offered to the prefix cache."""
        self.prefilling.remove(seq)
        slot, length = seq.request.id, len(seq.prompt)
        self._share_with_siblings(seq)
        if seq.finished:
            entry = self._store_prefix(seq.prompt, self.runner.slot_nbytes(slot, length), _states(seq, length))
            self.runner.close_slot(slot, entry, length)
            self._release(seq)
            return
        self.runner.slot_to_row(slot, length)
        self.running.append(seq)

    def _share_with_siblings(self, seq: Sequence) -> None:
        """Requests waiting to prefill the same prompt (the n choices of one request, or clients
        sending the same prompt at once) start from this one's KV instead of computing it again."""
        siblings = [s for s in self._unstarted() if s.prompt == seq.prompt]
        if not siblings:  # the usual case: no states joined for nothing on every prefill
            return
        states = _states(seq, len(seq.prompt))  # without them, a head's row could not start from it
        whole = states is not None and states.shape[0] == len(seq.prompt)
        siblings = [s for s in siblings if whole or not _needs_states(s)]
        if not siblings:
            return
        slot = seq.request.id
        entry = self._store_prefix(seq.prompt, self.runner.slot_nbytes(slot, len(seq.prompt)), states)
        if entry != NO_ENTRY:  # else already stored, or too large for the cache
            self.runner.share_slot_prefix(slot, entry, len(seq.prompt))
        self._reseat(siblings)

    def _unstarted(self) -> list[Sequence]:
        """Prefilling requests that computed nothing yet (a newer entry may serve them)."""
        return [s for s in self.prefilling if s.prefill_done == s.reused_prefix < len(s.prompt) - 1]

    def _reseat(self, seqs: list[Sequence]) -> None:
        """Restart these unstarted prefills from the longest cached prefix, when it is longer."""
        for seq in seqs:
            reused, entry = self._lookup(seq)
            if entry is not None and reused > seq.prefill_done:
                self._seat(seq, reused, entry)

    def remove_row(self, index: int) -> Sequence:
        """Finished or cancelled: its KV (prompt and answer) may serve a later prompt's prefix."""
        seq = self.running.pop(index)
        length = self.runner.kv.lengths[index]  # the last committed token has no KV yet
        entry = self._store_prefix(seq.committed[:length], self.runner.row_nbytes(length),
                                   _states(seq, length))
        self.runner.remove_row(index, entry, length)
        self._release(seq)
        return seq

    def remove(self, request_id: int) -> list[Sequence]:
        """Take a request out wherever it is (cancel); -> the sequences removed. What it
        prefilled or generated stays in the prefix cache, so a retry resumes from there."""
        removed = [s for s in self.waiting if s.request.id == request_id]
        for seq in removed:
            self.waiting.remove(seq)
        for seq in [s for s in self.prefilling if s.request.id == request_id]:
            self.prefilling.remove(seq)
            self._close_cancelled_slot(seq)
            removed.append(seq)
        for index in reversed([i for i, s in enumerate(self.running) if s.request.id == request_id]):
            removed.append(self.remove_row(index))
        return removed

    def _close_cancelled_slot(self, seq: Sequence) -> None:
        """Keep the prompt chunks whose forward completed (prefill runs whole chunks within a
        step, cancel comes between steps); requests queued behind it with that prefix start there."""
        slot, tokens = seq.request.id, seq.prompt[:seq.prefill_done]
        entry, states = NO_ENTRY, _states(seq, len(tokens), seq.hidden_chunks)
        if len(tokens) > seq.reused_prefix and (states is not None or not self._is_cached(tokens)):
            entry = self._store_prefix(tokens, self.runner.slot_nbytes(slot, len(tokens)), states)
        self.runner.close_slot(slot, entry, len(tokens))
        self._release(seq)
        if entry != NO_ENTRY:
            self._reseat([s for s in self._unstarted() if s.prompt[:len(tokens)] == tokens])

    def _is_cached(self, tokens: list[int]) -> bool:
        """Covered by a stored entry already: a copy would only take memory."""
        return self.prefix_cache.tree.longest_match(tokens)[0] >= len(tokens)

    def drop_prefilling(self, seq: Sequence) -> None:
        """A prefill failed: forget its slot; the batch rows are untouched."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        self._release(seq)
        self.runner.close_slot(seq.request.id, NO_ENTRY, 0)

    def clear_running(self) -> list[Sequence]:
        """Everything admitted, removed at once (a failed decode step); the runner starts over."""
        seqs = [*self.prefilling, *self.running]
        self.prefilling.clear()
        self.running.clear()
        for seq in seqs:
            self._release(seq)
        self.runner.reset()
        return seqs

    def _release(self, seq: Sequence) -> None:
        self.memory.reserved -= seq.kv_held
        seq.kv_held = 0

    def _store_prefix(self, tokens: list[int], nbytes: int, states: mx.array | None = None,
                      persist: bool = True) -> int:
        """Admit `tokens` (and the target's states for them, if kept) to the prefix index -> the
        entry id to store under (or NO_ENTRY); it goes to disk at the next admission."""
        if not self.prefix_cache.max_bytes:
            return NO_ENTRY
        if states is None:  # keep what an entry this one replaces kept for MTP rows
            states = self._covered_states(tokens)
        elif self._attach_states(tokens, states):
            return NO_ENTRY
        entry, dropped = self.prefix_cache.store(tokens, nbytes + (states.nbytes if states is not None else 0))
        if dropped:
            self._drop_prefixes(dropped)
        if entry is not None and states is not None:
            self.prefix_states[entry] = states
        if entry is not None and persist and self.runner.disk is not None:
            self.to_persist.append((entry, list(tokens)))
        return NO_ENTRY if entry is None else entry

    def _attach_states(self, tokens: list[int], states: mx.array) -> bool:
        """`tokens` are stored already, by a row without a head: give that entry these states
        (an MTP row's), so the next MTP row reuses it too -> whether it was stored."""
        entry = self.prefix_cache.add_bytes(tokens, 0)
        if entry is None:
            return False
        kept = self.prefix_states.get(entry)
        # narrower states were kept before a head tapped more of the target's layers: replaced
        if kept is None or kept.shape[0] < states.shape[0] or kept.shape[-1] != states.shape[-1]:
            self.prefix_cache.add_bytes(tokens, states.nbytes - (kept.nbytes if kept is not None else 0))
            self.prefix_states[entry] = states
        return True

    def _covered_states(self, tokens: list[int]) -> mx.array | None:
        """The longest target states kept by a stored prefix of `tokens` (an MTP row's entry,
        which storing `tokens` replaces): states are a property of the prefix, so a row without
        a head (draft, plain) extending a conversation keeps them for the next MTP turn."""
        best = None
        for key in self.prefix_cache.tree.keys_on_path(tuple(tokens)):
            states = self.prefix_states.get(self.prefix_cache.entries[key][0])
            if (states is not None and states.shape[-1] == self.runner.states_width
                    and (best is None or states.shape[0] > best.shape[0])):
                best = states
        return best

    def persist(self) -> None:
        """Entries stored since the last admission go to disk between steps (at admission, or
        when the engine goes idle), never inside one."""
        for entry, tokens in self.to_persist:
            if entry in self.runner.prefixes:  # not evicted meanwhile
                self.runner.persist_prefix(entry, tokens)
        self.to_persist.clear()

    def _load_from_disk(self, prompt: list[int]) -> None:
        """A longer prefix on disk than in RAM (after a restart, or evicted from RAM) becomes a
        RAM entry, agreed by every rank; a lookup then finds it like any other."""
        if self.runner.disk is None or not self.prefix_cache.max_bytes:
            return
        length = min(self.runner.disk_match(prompt), len(prompt) - 1)
        if length <= self.prefix_cache.tree.longest_match(prompt)[0]:
            return
        tokens = prompt[:length]
        source = self.runner.disk.longest(tokens)[1]
        nbytes = source.nbytes * length // len(source.tokens)  # the file's share for `length` tokens
        entry = self._store_prefix(tokens, nbytes, persist=False)
        if entry != NO_ENTRY and not self.runner.load_prefix(entry, tokens):
            self._drop_prefixes([self.prefix_cache.forget(tokens)])

    def _drop_prefixes(self, entries: list[int]) -> None:
        self.runner.drop_prefixes(entries)


def _needs_states(seq: Sequence) -> bool:
    """An MTP head needs the target's states for its whole context, beside the target's KV."""
    return seq.spec.group is not None and seq.spec.group.needs_hidden


def _states(seq: Sequence, length: int, computing: list[mx.array] = ()) -> mx.array | None:
    """The target's states `seq` kept for its first `length` positions, from the first on (a row
    without a head keeps its prompt's only: a head's row reuses the entry that far); `computing`:
    the chunks a prefill computed after its reused prefix."""
    blocks = seq.states + list(computing)
    if not seq.keeps_states or not blocks:
        return None
    return join_states(blocks)[:length]
