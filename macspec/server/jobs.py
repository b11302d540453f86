"""One generation seen from the event loop: submit, then async text deltas, then the result.

The engine thread hands events over with call_soon_threadsafe; the job turns token ids into
text (holding back incomplete UTF-8 and anything that may be the start of a stop string) and
cancels the engine request when a stop string matches or the client goes away.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.service import EngineService
from ..engine.request import Failed, Finished, GenerationRequest, Tokens
from ..sampling import SamplingParams
from ..errors import EngineUnavailableError, MacspecError
from ..models.detokenizer import IncrementalDecoder

POLL_S = 0.5  # how often a waiting job checks that its client is still connected


@dataclass
class JobSpec:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    method: str | None = None
    num_draft: int | None = None
    adaptive: bool | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # report log-probabilities with this many alternatives
    constraint: Any = None  # a grammar.Constraint (one per generation: it holds its state)


@dataclass
class JobResult:
    finish_reason: str = "length"  # "stop" | "length" | "cancelled"
    stop_sequence: str | None = None
    completion_tokens: int = 0
    stats: dict = field(default_factory=dict)


class TextAssembler:
    """Token ids -> text deltas, holding back a possible stop string's start; O(n) overall."""

    def __init__(self, tokenizer, stop: list[str]):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.emitted = 0  # characters of the decoded text already handed out
        self.stopped_at: str | None = None
        self._stop_index = 0

    @property
    def ids(self) -> list[int]:
        return self.decoder.ids

    def add(self, ids: list[int]) -> str:
        """New text safe to send; sets stopped_at when a stop string matched."""
        self.decoder.add(ids)
        return self._release(self.decoder.text)

    def flush(self) -> str:
        """At the end: whatever was held back for a stop string that never came."""
        if self.stopped_at is not None:
            return ""
        self.decoder.flush()
        text = self.decoder.text
        out = self._release(text)
        if self.stopped_at is None:
            out += text[self.emitted:]
            self.emitted = len(text)
        return out

    def _release(self, decoded: str) -> str:
        if self.stopped_at is not None:
            return ""
        pending = decoded[self.emitted:]
        for stop in self.stop:
            # search from just before the unsent text so a match spanning the boundary counts
            start = max(0, self.emitted - len(stop) + 1)
            hit = decoded.find(stop, start)
            if hit != -1 and (self.stopped_at is None or hit < self._stop_index):
                self.stopped_at, self._stop_index = stop, hit
        if self.stopped_at is not None:
            out = decoded[self.emitted:max(self.emitted, self._stop_index)]
            self.emitted = len(decoded)
            return out
        keep = self._held_back(pending)
        out = pending[:len(pending) - keep]
        self.emitted += len(out)
        return out

    def _held_back(self, pending: str) -> int:
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(pending)), 0, -1):
                if pending.endswith(stop[:n]):
                    longest = max(longest, n)
                    break
        return longest


class Job:
    def __init__(self, engine: EngineService, tokenizer, spec: JobSpec, is_disconnected,
                 remember=None):
        self.engine = engine
        self.remember = remember  # (answer text, its ids) when it ends whole: see server/turns.py
        self.spec = spec
        self.text = TextAssembler(tokenizer, spec.stop)
        self.result = JobResult()
        # What the access log reports; filled in as the generation goes (see app.access_log).
        self.usage = {"prompt_tokens": len(spec.prompt), "completion_tokens": 0, "method": None,
                      "acceptance": None}
        self.is_disconnected = is_disconnected
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self._last_check = time.monotonic()
        loop = asyncio.get_running_loop()

        def sink(event) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, event)

        self.request = GenerationRequest(spec.prompt, spec.params, spec.max_tokens, sink,
                                         method=spec.method, num_draft=spec.num_draft,
                                         adaptive=spec.adaptive, ignore_eos=spec.ignore_eos,
                                         constraint=spec.constraint, logprobs=spec.logprobs)
        self.logprobs: list = []  # entries received and not yet taken (see take_logprobs)

    async def start(self) -> None:
        """Submit and wait for Accepted, so errors raise before any response is sent."""
        self.engine.submit(self.request)
        await self.accepted()

    async def accepted(self) -> None:
        """Wait for the engine's Accepted (after a submit); its refusal raises here."""
        event = await self._next()
        if isinstance(event, Failed):
            self.done = True
            raise event.error

    async def deltas(self):
        """Yield text pieces until the generation ends; then self.result is complete."""
        try:
            while not self.done:
                event = await self._next()
                if isinstance(event, Tokens):
                    if event.logprobs is not None:
                        self.logprobs.extend(zip(event.ids, event.logprobs))
                    self.result.completion_tokens += len(event.ids)
                    self.usage["completion_tokens"] = self.result.completion_tokens
                    piece = self.text.add(event.ids)
                    if piece:
                        yield piece
                    if self.text.stopped_at is not None:
                        self._stop_on_string()
                elif isinstance(event, Finished):
                    self.done = True
                    self.result.stats = event.stats
                    self.usage.update(method=event.stats.get("method"),
                                      acceptance=event.stats.get("acceptance_rate"))
                    self.result.finish_reason = event.reason
                    piece = self.text.flush()
                    if self.remember is not None:
                        self.remember(self.text.decoder.text, self.text.ids)
                    if piece:
                        yield piece
                elif isinstance(event, Failed):
                    self.done = True
                    raise event.error
        finally:
            self.close()

    def take_logprobs(self) -> list[tuple[int, tuple[float, list]]]:
        """(id, (log-probability, top alternatives)) for the tokens received since the last call."""
        out, self.logprobs = self.logprobs, []
        return out

    def _stop_on_string(self) -> None:
        self.done = True
        self.result.finish_reason = "stop"
        self.result.stop_sequence = self.text.stopped_at
        self.engine.cancel(self.request.id, "stop")

    def close(self) -> None:
        """Cancel in the engine unless the generation already ended (idempotent)."""
        if not self.done:
            self.done = True
            self.result.finish_reason = "cancelled"
            self.engine.cancel(self.request.id)

    async def _next(self):
        while True:
            now = time.monotonic()
            if now - self._last_check >= POLL_S:  # also while tokens flow without pause
                self._last_check = now
                self._check_alive()
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue

    def _check_alive(self) -> None:
        if not self.engine.alive:
            self.done = True
            raise EngineUnavailableError("the engine stopped; the request was not completed")
        if self.is_disconnected():
            self.close()
            raise ClientGone()


class ClientGone(MacspecError):
    """The client disconnected; the request was cancelled."""

    http_status = 499
    error_type = "client_closed_request"

