"""Token ids to text as they arrive, in O(n) overall, equal to `tokenizer.decode(all ids)`.

Each step decodes only a short window: the tokens since the last emitted boundary plus a few
before it as context (so a decoder's treatment of a leading space or a byte sequence split over
tokens is the same as in the full decode), and emits what the window adds beyond its context.
Text that ends in an incomplete UTF-8 sequence (U+FFFD) is held until the next token completes it.
mlx-lm's streaming detokenizers drop the first token's leading space; this one does not.
"""

from __future__ import annotations

CONTEXT_TOKENS = 6  # tokens of already-emitted text each window starts from


class IncrementalDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start (context tokens begin here)
        self._read = 0  # tokens up to here are emitted

    def add(self, ids: list[int]) -> str:
        """Append ids; return the newly final text (may be "")."""
        self.ids.extend(ids)
        context = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.ids))
        if window.endswith("\ufffd") or not window.startswith(context):
            return ""  # wait for the rest of a multi-byte character
        piece = window[len(context):]
        self.text += piece
        self._read = len(self.ids)
        self._prefix = max(0, self._read - CONTEXT_TOKENS)
        return piece

    def flush(self) -> str:
        """At the end: whatever was held back (an incomplete character decodes as U+FFFD)."""
        context = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.ids))
        piece = window[len(context):] if window.startswith(context) else ""
        self.text += piece
        self._read = len(self.ids)
        return piece

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.ids[start:end])
