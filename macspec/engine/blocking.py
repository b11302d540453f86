"""The engine's synchronous API, for `macspec run`, the tests and the benchmarks: generate()
and stream() add requests and step the engine until they are done (`serve` steps it from a
thread instead, service.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import EngineUnavailableError, MacspecError
from ..sampling import SamplingParams
from .request import Event, Failed, Finished, GenerationRequest, Tokens

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """One request's result from generate()."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    error: MacspecError | None = None


class BlockingAPI:
    """Mixed into Engine: needs add_request(), step(), has_work, fail_running(), fatal_reason."""

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_tokens: int | list[int], **options) -> list[Completion]:
        """Generate for every prompt together (batched as the scheduler allows); `options` are
        GenerationRequest fields (method, num_draft, adaptive, stop_token_ids, ignore_eos), each
        a value or one per prompt. Returns when all are done."""
        def each(value, i):
            return value[i] if isinstance(value, list) else value

        completions = [Completion() for _ in prompts]
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(list(prompt), each(params, i), each(max_tokens, i),
                                        _collector(completions[i]),
                                        **{k: each(v, i) for k, v in options.items()})
            try:
                self.add_request(request)
            except MacspecError as err:
                completions[i].error = err
        self.run_until_done()
        return completions

    def stream(self, prompt: list[int], params: SamplingParams, max_tokens: int,
               stats: dict | None = None, **options) -> Iterator[list[int]]:
        """One request's tokens step by step (for `macspec run`); its stats land in `stats`."""
        events: list[Event] = []
        self.add_request(GenerationRequest(list(prompt), params, max_tokens, events.append, **options))
        while events or self.has_work:
            if not events:
                self._step_or_fail()
            while events:
                event = events.pop(0)
                if isinstance(event, Tokens):
                    yield event.ids
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Finished):
                    if stats is not None:
                        stats.update(event.stats)
                    return

    def run_until_done(self) -> None:
        while self.has_work:
            self._step_or_fail()

    def _step_or_fail(self) -> None:
        try:
            self.step()
        except Exception as exc:
            if self.fatal_reason:
                raise EngineUnavailableError(f"tensor parallelism failed: {self.fatal_reason}") from exc
            logger.exception("engine step failed")
            self.fail_running(exc)


def _collector(completion: Completion):
    def sink(event: Event) -> None:
        if isinstance(event, Tokens):
            completion.tokens.extend(event.ids)
        elif isinstance(event, Finished):
            completion.finish_reason, completion.stats = event.reason, event.stats
        elif isinstance(event, Failed):
            completion.error = event.error

    return sink
