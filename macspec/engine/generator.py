"""Single-stream speculative generation: prefill, then propose -> verify -> accept -> rollback.

Plain decoding is the same loop with k = 0, so "speculative equals plain" compares two runs of
one code path that differ only in the proposals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from ..errors import RequestError
from ..spec.base import Proposal, Proposer
from ..spec.controller import ControllerConfig, KController
from ..spec.stats import SpecStats
from ..spec.verify import verify_greedy, verify_sampling
from .cache import eval_cache, make_trimmable_cache, quantize_cache, trim
from .runtime import Runtime
from .sampling import Rng, SamplingParams

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 30.0  # periodic aggregate, never one line per step


@dataclass
class GenerationStats:
    method: str
    k_max: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    controller: KController | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        ctl = self.controller
        return {
            "method": self.method,
            "k_max": self.k_max,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finish_reason": self.finish_reason,
            "ttft_s": round(self.ttft_s, 5),
            "decode_s": round(self.decode_s, 5),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "acceptance_rate": round(self.spec.acceptance_rate, 4),
            "tokens_per_forward": round(self.spec.tokens_per_forward, 4),
            "spec": self.spec.as_dict(),
            "controller": None if ctl is None else {
                "state": ctl.state, "turned_off": ctl.num_turned_off, "probes": ctl.num_probes,
                "alphas": [round(a, 3) for a in ctl.alphas],
                "step_cost_ms": {str(k): round(v * 1e3, 3) for k, v in sorted(ctl.costs.items())},
            },
        }


class Generator:
    def __init__(self, runtime: Runtime, params: SamplingParams, max_tokens: int,
                 num_draft: int | None = None, adaptive: bool | None = None,
                 stop_token_ids: tuple[int, ...] = ()):
        spec = runtime.profile.speculative
        self.runtime = runtime
        self.view = runtime.view
        self.params = params
        self.max_tokens = max_tokens
        self.proposer: Proposer | None = runtime.make_proposer()
        k_max = num_draft if num_draft is not None else spec.num_draft_tokens
        self.controller = None if self.proposer is None else KController(ControllerConfig(
            k_max=k_max, adaptive=spec.adaptive if adaptive is None else adaptive,
            probe_min_steps=spec.probe_min_steps, probe_max_steps=spec.probe_max_steps))
        self.stats = GenerationStats(runtime.method if self.proposer else "none",
                                     k_max if self.proposer else 0, controller=self.controller)
        self.eos = set(runtime.tokenizer.eos_token_ids) | set(stop_token_ids)
        self.rng = Rng(params.seed)

    def _check_length(self, prompt: list[int]) -> None:
        limit = self.runtime.profile.kv.max_context
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) + self.max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({self.max_tokens}) "
                               f"exceeds the context length {limit}")

    def _prefill(self, prompt: list[int], cache: list) -> tuple[mx.array, mx.array | None]:
        """-> logits [V] after the prompt, and hidden [L, H] when the proposer wants them."""
        chunk = self.runtime.profile.kv.prefill_chunk
        keep_hidden = self.proposer is not None and self.proposer.needs_hidden
        hiddens = []
        for start in range(0, len(prompt), chunk):
            hidden = self.view.hidden(mx.array(prompt[start:start + chunk])[None], cache)
            eval_cache(cache)
            if keep_hidden:
                mx.eval(hidden)
                hiddens.append(hidden[0])
        logits = self.view.logits(hidden[0, -1:])[0]
        return logits, (mx.concatenate(hiddens) if keep_hidden else None)

    def _accept(self, logits: mx.array, proposal: Proposal, committed: list[int]) -> tuple[int, int]:
        if self.params.is_greedy:
            return verify_greedy(logits, proposal.tokens, committed, self.params)
        return verify_sampling(logits, proposal.tokens, proposal.q, committed, self.params, self.rng)

    def _choose_k(self, committed_len: int, generated: int) -> int:
        if self.controller is None:
            return 0
        room = min(self.max_tokens - generated - 1,
                   self.runtime.profile.kv.max_context - committed_len)
        return max(0, min(self.controller.choose_k(), room))

    def generate(self, prompt: list[int]) -> Iterator[list[int]]:
        """Yield the tokens committed by each step (EOS is not yielded)."""
        self._check_length(prompt)
        stats = self.stats
        stats.prompt_tokens = len(prompt)
        start = time.perf_counter()
        cache = make_trimmable_cache(self.view.model)
        logits, prompt_hidden = self._prefill(prompt, cache)
        kv = self.runtime.profile.kv
        if kv.kv_bits:
            cache = quantize_cache(cache, kv.kv_bits, kv.kv_group_size)
        _, first = self._accept(logits[None], Proposal([]), prompt)
        committed = prompt + [first]
        stats.ttft_s = time.perf_counter() - start
        decode_start = time.perf_counter()
        emitted = self._finish([first])
        if emitted:
            yield emitted
        if stats.finish_reason is not None:
            return
        if self.proposer is not None:
            self.proposer.start(prompt, prompt_hidden)
        last_log = decode_start
        while stats.finish_reason is None:
            new = self._step(committed, cache)
            committed.extend(new)
            emitted = self._finish(new)
            now = time.perf_counter()
            stats.decode_s = now - decode_start
            if now - last_log > STATS_LOG_INTERVAL_S:
                last_log = now
                self._log_aggregate()
            if emitted:
                yield emitted

    def _log_aggregate(self) -> None:
        s = self.stats
        logger.info("%d tokens, %.1f tok/s, %s: acceptance %.2f, %.2f tokens/forward, mean k %.2f",
                    s.generated_tokens, s.decode_tokens_per_s, s.method, s.spec.acceptance_rate,
                    s.spec.tokens_per_forward, s.spec.mean_k)

    def _step(self, committed: list[int], cache: list) -> list[int]:
        t0 = time.perf_counter()
        k = self._choose_k(len(committed), self.stats.generated_tokens)
        proposal = self.proposer.propose(committed, k, self.params, self.rng) if k else Proposal([])
        if len(proposal.tokens) > k:
            proposal = Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k])
        window = mx.array([committed[-1], *proposal.tokens])[None]
        logits, hidden = self.view.forward(window, cache)
        n, token = self._accept(logits[0], proposal, committed)
        num_drafted = len(proposal.tokens)
        trim(cache, num_drafted - n)
        new = proposal.tokens[:n] + [token]
        if self.controller is not None:
            self.controller.observe(num_drafted, n, time.perf_counter() - t0)
        if self.proposer is not None and self.proposer.needs_hidden:
            self.proposer.observe(hidden[0, : n + 1])
        self.stats.spec.observe_step(num_drafted, n, len(new))
        return new

    def _finish(self, new: list[int]) -> list[int]:
        return take_until_finish(self.stats, new, self.eos, self.max_tokens)


def take_until_finish(stats: GenerationStats, new: list[int], eos: set[int], max_tokens: int) -> list[int]:
    """Tokens to emit from `new`, setting stats.finish_reason on EOS or max_tokens."""
    out = []
    for token in new:
        if token in eos:
            stats.finish_reason = "stop"
            break
        out.append(token)
        stats.generated_tokens += 1
        if stats.generated_tokens >= max_tokens:
            stats.finish_reason = "length"
            break
    return out
