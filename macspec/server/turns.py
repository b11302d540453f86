"""The token ids of recent answers, so the next turn's prompt re-sends them as generated.

A chat template re-renders the previous answer as text, and its canonical tokenization often
differs from the ids the model produced ("\\n" "\\n" generated, "\\n\\n" re-encoded): the prefix
cache then stops matching inside that answer. Encoding a remembered answer's text as its own
generated ids keeps the next prompt a continuation of the cached tokens; the ids decode to the
same text, so the prompt says the same thing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_MAX_TURNS = 256
MIN_CHARS = 4  # shorter answers gain little and match too easily elsewhere


class TurnMemory:
    def __init__(self, tokenizer, max_turns: int = DEFAULT_MAX_TURNS):
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.answers: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # text -> generated ids
        self._lock = threading.Lock()  # remembered on the loop, read on tokenizer threads

    def remember(self, text: str, ids: list[int]) -> None:
        if len(text) < MIN_CHARS or not ids or self.max_turns == 0:
            return
        with self._lock:
            self.answers[text] = tuple(ids)
            self.answers.move_to_end(text)
            while len(self.answers) > self.max_turns:
                self.answers.popitem(last=False)

    def encode(self, text: str) -> list[int]:
        """`text` tokenized, with each remembered answer in it spliced in as its own ids."""
        spans = self._spans(text)
        out, start = [], 0
        for begin, end, ids in spans:
            out += self._encode(text[start:begin])
            out += ids
            start = end
        return out + self._encode(text[start:])

    def _spans(self, text: str) -> list[tuple[int, int, tuple[int, ...]]]:
        with self._lock:
            answers = sorted(self.answers.items(), key=lambda kv: -len(kv[0]))
        taken: list[tuple[int, int, tuple[int, ...]]] = []
        for answer, ids in answers:  # longest first; spans never overlap
            at = text.find(answer)
            while at != -1:
                end = at + len(answer)
                if all(end <= b or at >= e for b, e, _ in taken):
                    taken.append((at, end, ids))
                at = text.find(answer, end)
        return sorted(taken)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
