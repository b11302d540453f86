"""One request inside the engine: its tokens, its speculation record, RNG and counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from .. import proposers
from ..errors import RequestError
from ..sampling import Rng, RowContext
from ..speculative.speculator import Record, Speculator
from ..speculative.stats import SpecStats
from .request import Event, Failed, Finished, GenerationRequest, Tokens, emit_safely


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

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
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
        }


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


@dataclass
class Sequence:
    request: GenerationRequest
    method: str
    spec: Record  # its speculation: proposer, k_max, acceptance (the speculator writes it)
    stats: GenerationStats
    rng: Rng
    eos: set[int]
    committed: list[int] = field(default_factory=list)
    prefill_done: int = 0  # prompt tokens already in prefill_cache (prefix reuse included)
    reused_prefix: int = 0
    hidden_chunks: list[mx.array] = field(default_factory=list)
    # The target's states for the cached positions of rows whose proposer reads them (MTP): a
    # stored prefix carries them, so a later request's head starts from them, not from scratch.
    states: list[mx.array] = field(default_factory=list)
    # Its prompt's states are kept (a loaded head reads them): a row without a head keeps them
    # for the prefix it stores (else a head's rows computed a plain row's cached prefix again).
    keeps_states: bool = False
    started: float = field(default_factory=time.perf_counter)
    decode_started: float = 0.0
    kv_need: int = 0  # bytes of KV at full length (prompt + max_tokens + drafts)
    kv_held: int = 0  # of the scheduler's KV budget, from admission to close
    waited_for_memory: bool = False
    closed: bool = False  # Finished or Failed was emitted; later events are dropped

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt

    @property
    def params(self):
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.stats.finish_reason is not None

    @property
    def left(self) -> int:
        """Tokens it may still make (max_tokens less what it made)."""
        return self.request.max_tokens - self.stats.generated_tokens

    def room(self, max_context: int) -> int:
        """Most drafts this step may carry without passing max_tokens or the context."""
        return max(0, min(self.left - 1, max_context - len(self.committed)))

    def keep_states(self, hidden: mx.array) -> None:
        """The target's states for the positions just committed (a proposer reads them)."""
        self.states.append(hidden)

    def emit(self, event: Event) -> None:
        if self.closed:
            return
        self.closed = isinstance(event, (Finished, Failed))
        emit_safely(self.request, event)

    @property
    def constraint(self):
        return self.request.constraint

    def context(self, masks: mx.array | None = None) -> RowContext:
        return RowContext(self.params, self.committed, len(self.prompt), masks)

    def commit(self, new: list[int], logprobs: list | None = None) -> None:
        """Append the step's tokens, emit what the client sees, set finish_reason if done (EOS,
        max_tokens, or a grammar that allows nothing more)."""
        self.committed.extend(new)
        if self.constraint is not None:
            new = new[:self.constraint.commit(new)]
        out = take_until_finish(self.stats, new, self.eos, self.request.max_tokens)
        if self.constraint is not None and self.constraint.done and not self.finished:
            self.stats.finish_reason = "stop"
        if self.decode_started:
            self.stats.decode_s = time.perf_counter() - self.decode_started
        if out:
            self.emit(Tokens(out, logprobs[:len(out)] if logprobs is not None else None))

    def finish(self, reason: str | None = None) -> None:
        if reason is not None:
            self.stats.finish_reason = reason
        self.emit(Finished(self.stats.finish_reason, self.summary()))

    def summary(self) -> dict:
        out = self.stats.as_dict()
        out["cached_prompt_tokens"] = self.reused_prefix
        out["spec"]["acceptance_estimate"] = self.spec.as_dict()["acceptance"]
        speedup = self.spec.pace.speedup  # its decoding against plain decoding's, estimated
        out["spec"]["speedup_vs_plain"] = round(speedup, 3) if speedup else None
        return out


def _context_fix(runtime, max_context: int) -> str:
    trained = runtime.target.config.get("max_position_embeddings") or 0
    if trained > max_context:
        return (f"shorten the prompt or max_tokens, or raise kv.max_context in the profile "
                f"(this model takes up to {trained})")
    return "shorten the prompt or max_tokens" + (f" (this model takes at most {trained})" if trained else "")


def new_sequence(req: GenerationRequest, runtime, speculator: Speculator, max_context: int,
                 tp_size: int = 1) -> Sequence:
    """A request made ready to schedule: validated, its speculation record made, its KV
    at full length sized. Raises RequestError (or a loading error) when it cannot run."""
    if not req.prompt:
        raise RequestError("the prompt is empty")
    if len(req.prompt) + req.max_tokens > max_context:
        raise RequestError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) "
                           f"exceeds the context length {max_context}; {_context_fix(runtime, max_context)}")
    spec = runtime.profile.speculative
    method = req.method or runtime.method
    runtime.ensure_method(method)
    k_max = 0 if method == proposers.PLAIN else proposers.max_draft(method, spec) if req.num_draft is None \
        else req.num_draft
    adaptive = spec.adaptive if req.adaptive is None else req.adaptive
    seeded = req.params.seed is not None and not req.params.is_greedy
    # The random stream is consumed per draft, so a replay needs the same k every step.
    record = speculator.admit(method, k_max, adaptive and not seeded, isolated=seeded)
    eos = set(req.stop_token_ids)
    if not req.ignore_eos:
        eos |= set(runtime.tokenizer.eos_token_ids)
    need = (len(req.prompt) + req.max_tokens + k_max + 1) * runtime.kv_bytes_per_token(method, tp_size)
    return Sequence(req, method, record, GenerationStats(method, record.k_max, spec=record.stats),
                    Rng(req.params.seed), eos, list(req.prompt), kv_need=need, keeps_states=runtime.reads_states)
