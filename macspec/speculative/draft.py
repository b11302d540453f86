"""A smaller model with the target's tokenizer proposes by decoding k tokens ahead, for every
row of its method in one forward per chain step. The draft's KV of rows that left is kept by
their tokens, as the target's prefix cache keeps the target's: a request whose prompt starts
with an earlier one's tokens (the next turn of a conversation, a shared system prompt) prefills
only the rest in the draft too."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import logging

from ..errors import IncompatibleDraftError, MacspecError
from ..kv.batched import BatchKV, layout_of
from ..kv.cache import eval_cache, make_trimmable_cache
from ..models.compat import check_draft_compatible
from ..models.loader import load_model
from ..models.view import ModelView
from ..monitor.memory import compute_dtype_bytes, kv_bytes_per_token as model_kv_bytes
from ..progress import phase
from .base import ChainGroup, ChainRow, kept_bytes, pad_rows

logger = logging.getLogger(__name__)


def load(runtime, method: str, fallback: bool = True) -> None:
    """The draft model, checked against the target's tokenizer. An incompatible one at start,
    with speculative.allow_fallback, turns the profile's method to n-gram proposals instead."""
    if runtime.draft is not None:
        return
    spec, m = runtime.profile.speculative, runtime.profile.model
    if not spec.draft_model:
        raise MacspecError("method 'draft' needs speculative.draft_model in the profile")
    with phase(f"loading the draft {spec.draft_model}"):
        draft = load_model(spec.draft_model, m.dtype, None, m.trust_remote_code)
    try:
        check_draft_compatible(runtime.target.tokenizer, draft.tokenizer, m.path, spec.draft_model)
    except IncompatibleDraftError as err:
        if not (spec.allow_fallback and fallback):
            raise
        logger.warning("%s; falling back to n-gram proposals (allow_fallback = true)", err)
        runtime.method = "ngram"
        runtime.unavailable["draft"] = f"the draft was refused: {err}"
        return
    runtime.draft = draft


def make_group(runtime, method: str, vocab_size: int) -> "DraftGroup":
    return DraftGroup(runtime.draft.model, vocab_size, runtime.profile.kv.prefill_chunk,
                      kept_bytes(runtime, kv_bytes_per_token(runtime, method)))


def kv_bytes_per_token(runtime, method: str) -> int:
    draft = runtime.draft
    return model_kv_bytes(draft.config, compute_dtype_bytes(draft.model)) if draft is not None else 0


class DraftGroup(ChainGroup):
    method = "draft"

    def __init__(self, model: nn.Module, vocab_size: int, prefill_chunk: int = 512, kept_bytes: int = 0):
        super().__init__(BatchKV(layout_of(make_trimmable_cache(model))), vocab_size, kept_bytes)
        self.model = model
        self.view = ModelView(model)
        self.final_states: bool | None = None  # see _logits_from_hidden
        self.prefill_chunk = prefill_chunk
        self.fed: dict[int, int] = {}  # row -> committed tokens its KV holds

    def join(self, key, committed, prompt_hidden, hidden_start=0) -> None:
        # The draft's own prefill waits for the row's first proposal: a row whose speculation
        # stays off (or that finishes first) never pays it.
        self.waiting[key] = None

    def _take_on(self, row: ChainRow, kept) -> None:
        key, prompt = row.key, row.committed[:-1]  # the last committed token is fed by the proposal
        cache = make_trimmable_cache(self.model)
        reused, entry = self.kept.lookup(row.committed)  # at most len(prompt) tokens
        if entry is not None:
            self._copy_kept(cache, entry, reused)
        for start in range(reused, len(prompt), self.prefill_chunk):
            self.model(mx.array(prompt[start:start + self.prefill_chunk])[None], cache=cache)
            eval_cache(cache)
        self._add(key, cache, len(prompt))
        self.fed[key] = len(prompt)

    def leave(self, key: int) -> None:
        if key in self.row_keys and self.kept.max_bytes:
            fed = self.fed[key]
            self._keep_row(key, self.tokens[key][:fed], fed)
        super().leave(key)

    def _forget(self, key: int) -> None:
        self.fed.pop(key, None)

    def status(self) -> dict:
        return {"kept_prefixes": self.kept.as_dict()}

    def _catch_up(self, rows: list[ChainRow]) -> None:
        """Each row's unseen tokens but its last, through the model's body alone (no logits)."""
        backlog = [row.committed[self.fed[row.key]:-1] for row in rows]
        width = max(len(b) for b in backlog)
        if not width:
            return
        self.kv.begin(width)
        self.view.hidden(pad_rows(backlog, width), cache=self.kv.layers)
        self._advance(rows, backlog)

    def _first_logits(self, rows: list[ChainRow]) -> mx.array:
        pending = [row.committed[self.fed[row.key]:] for row in rows]
        width = max(len(p) for p in pending)
        self.kv.begin(width)
        tokens = pad_rows(pending, width)
        last = (mx.arange(len(rows)), mx.array([len(p) - 1 for p in pending]))  # each row's last fed
        if width > 1 and self._logits_from_hidden():  # the vocabulary's projection at the last alone
            logits = self.view.logits(self.view.hidden(tokens, cache=self.kv.layers)[last])
        else:
            logits = self.model(tokens, cache=self.kv.layers)[last]
        self._advance(rows, pending)
        return logits

    def _advance(self, rows: list[ChainRow], fed: list[list[int]]) -> None:
        """Each row's KV and count of fed tokens past the tokens just fed to it."""
        for index, (row, tokens) in enumerate(zip(rows, fed)):
            self.kv.advance(index, len(tokens))
            self.fed[row.key] += len(tokens)

    def _logits_from_hidden(self) -> bool:
        """Whether the draft's logits are its final states' projection (no soft-capping after
        it): then a row fed several tokens is projected at its last alone. Checked once."""
        if self.final_states is None:
            self.final_states = self.view.hidden_is_final()
        return self.final_states

    def _next_logits(self, tokens: mx.array) -> mx.array:
        self.kv.begin(1)
        logits = self.model(tokens[:, None], cache=self.kv.layers)[:, 0]
        for index in range(self.kv.num_rows):
            self.kv.advance(index, 1)
        return logits

    def settle(self, accepted: dict[int, int]) -> None:
        """Keep the chain positions that fed accepted drafts; roll back the rest."""
        for index, key in enumerate(self.row_keys):
            keep = min(accepted.get(key, 0), self.depth)
            self.kv.lengths[index] -= self.depth - keep
            self.fed[key] += keep
        self.depth = 0
