"""The engine: synchronous, one code path for `run`, `serve`, the proofs and the benchmarks.

add_request() queues a request; each step() is schedule -> propose -> verify -> commit: admit
waiting requests, prefill one prompt chunk, then one batched speculative decode step over every
running row (each row with its own proposer and k, chosen by the batch planner). Events go to
each request's sink as they happen. generate() runs steps until its requests are done; `serve`
wraps the engine in a thread with queues (service.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx

from ..errors import EngineUnavailableError, MacspecError, RequestError
from ..kv.prefix import PrefixCache
from ..monitor.memory import MB, KVBudget, kv_bytes_per_token, usage
from ..runner import TargetRunner
from ..sampling import Rng, SamplingParams
from ..spec.base import Proposal
from ..spec.controller import RowController
from ..spec.planner import BatchPlanner
from ..spec.stats import SpecStats
from ..spec.verify import accept_greedy_choices, verify_greedy, verify_sampling
from . import faults
from .faults import SpecFaults
from .request import Event, Failed, Finished, GenerationRequest, Tokens
from .runtime import Runtime
from .scheduler import Scheduler
from .sequence import GenerationStats, Sequence

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 30.0


@dataclass
class Completion:
    """One request's result from generate()."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    error: MacspecError | None = None


class Engine:
    def __init__(self, runtime: Runtime, max_batch: int | None = None, tp=None):
        profile = runtime.profile
        self.runtime = runtime
        self.view = runtime.view
        self.max_batch = max_batch or profile.server.max_batch
        self.max_context = profile.kv.max_context
        faults.arm_from_env()
        self.tp = tp  # a TPContext: every runner op is mirrored to the workers
        self.watchdog = None
        self.runner = self._make_runner(TargetRunner(self.view))
        self.vocab_size = int(self.view.inner.embed_tokens.weight.shape[0])
        self.planner = BatchPlanner()
        self.memory = KVBudget.for_engine(self._kv_per_token("none"), profile.kv.kv_budget_mb)
        logger.info("KV budget %d MB (%s), %d bytes per token", self.memory.budget // MB,
                    self.memory.source, self.memory.bytes_per_token)
        self.scheduler = Scheduler(self.runner, self.memory, PrefixCache(profile.kv.prefix_cache_mb * 2**20),
                                   self.max_batch, profile.kv.prefill_chunk)
        self.fatal_reason: str | None = None
        self.on_fatal = None  # called after fatal() (the service wakes its thread)
        self.totals = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                       "prompt_tokens": 0, "generated_tokens": 0, "steps": 0}
        self.spec_totals: dict[str, SpecStats] = {}
        self.spec_faults = SpecFaults()
        self.batch_histogram: dict[int, int] = {}
        self.live_counts = {"running": 0, "prefilling": 0, "waiting": 0}  # replaced, never mutated
        self._last_log = time.perf_counter()

    def _kv_per_token(self, method: str) -> int:
        """KV bytes per token on this rank: the target's shard, plus the proposer's own cache."""
        runtime = self.runtime
        tp = self.tp.size if self.tp else 1
        per_token = kv_bytes_per_token(runtime.target.config, _dtype_bytes(runtime.target.model), tp=tp)
        if method == "draft" and runtime.draft is not None:
            per_token += kv_bytes_per_token(runtime.draft.config, _dtype_bytes(runtime.draft.model))
        elif method == "mtp":
            per_token += kv_bytes_per_token(runtime.target.config, _dtype_bytes(runtime.target.model), layers=1)
        return per_token

    def _make_runner(self, runner: TargetRunner):
        if self.tp is None:
            return runner
        from ..distributed.channel import MirroredRunner
        from ..distributed.watchdog import Watchdog

        self.watchdog = Watchdog(self.tp.step_timeout_s, self.fatal, self.tp.peers).start()
        return MirroredRunner(runner, self.tp.channel, self.watchdog)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> Sequence:
        """Queue a request; raises MacspecError (nothing queued) when it cannot run."""
        try:
            seq = self._make_sequence(request)
        except MacspecError:
            self.totals["failed"] += 1
            raise
        except Exception as exc:  # whatever goes wrong, it is this request's error
            logger.exception("could not start request %d", request.id)
            self.totals["failed"] += 1
            raise MacspecError(f"could not start the request: {exc!r}") from exc
        self.totals["requests"] += 1
        self.scheduler.add(seq)
        return seq

    def _make_sequence(self, req: GenerationRequest) -> Sequence:
        if not req.prompt:
            raise RequestError("the prompt is empty")
        if len(req.prompt) + req.max_tokens > self.max_context:
            raise RequestError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) "
                               f"exceeds the context length {self.max_context}")
        spec = self.runtime.profile.speculative
        method = req.method or self.runtime.method
        self.runtime.ensure_method(method)
        proposer = self.runtime.make_proposer(method) if method != "none" else None
        k_max = spec.num_draft_tokens if req.num_draft is None else req.num_draft
        if proposer is None:
            k_max = 0
        adaptive = spec.adaptive if req.adaptive is None else req.adaptive
        if req.params.seed is not None and not req.params.is_greedy:
            # The random stream is consumed per draft, so a replay needs the same k every step.
            adaptive = False
        need = (len(req.prompt) + req.max_tokens + k_max + 1) * self._kv_per_token(method)
        if need > self.memory.budget:
            raise RequestError(
                f"this request needs {need / MB:.1f} MB of KV at full length (prompt {len(req.prompt)} "
                f"+ max_tokens {req.max_tokens} tokens) but the server's KV budget is "
                f"{self.memory.budget / MB:.1f} MB ({self.memory.source}); lower max_tokens", "max_tokens")
        row = RowController(k_max, adaptive, method, spec.probe_min_steps, spec.probe_max_steps)
        stats = GenerationStats(method if proposer else "none", k_max)
        eos = set(req.stop_token_ids)
        if not req.ignore_eos:
            eos |= set(self.runtime.tokenizer.eos_token_ids)
        return Sequence(req, method, proposer, row, stats, Rng(req.params.seed), eos, list(req.prompt),
                        kv_reserved=need)

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """End a request early: "cancelled" (its client left) or "stop" (a stop string matched,
        which completes it)."""
        for seq in self.scheduler.remove(request_id):
            self._close(seq, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> None:
        """Admit, prefill one chunk, decode one batched step. A failed prefill fails only its
        request; any other failure propagates (the caller fails what is running)."""
        self.scheduler.admit()
        self._publish_counts()
        chunk = self.scheduler.next_prefill()
        if chunk is not None:
            try:
                self._prefill(*chunk)
            except Exception as exc:
                if self.tp is not None:  # the ranks may no longer be in lock-step
                    raise
                logger.error("prefill of request %d failed", chunk[0].request.id, exc_info=exc)
                self._fail_prefill(chunk[0], exc)
        if self.scheduler.running:
            self._decode_step()
        self._publish_counts()
        self._maybe_log()

    def _publish_counts(self) -> None:
        """Queue lengths other threads may read while a (long) step runs."""
        s = self.scheduler
        self.live_counts = {"running": len(s.running), "prefilling": len(s.prefilling),
                            "waiting": len(s.waiting)}

    def _prefill(self, seq: Sequence, chunk: list[int]) -> None:
        faults.check("prefill")
        hidden, logits = self.runner.prefill(seq.request.id, chunk)
        if seq.proposer is not None and seq.proposer.needs_hidden:
            seq.hidden_chunks.append(hidden)
        seq.prefill_done += len(chunk)
        self.totals["prompt_tokens"] += len(chunk)
        if seq.prefill_done < len(seq.prompt):
            return
        first = self._accept(seq, logits, Proposal([]), None)[1]
        seq.stats.prompt_tokens = len(seq.prompt)
        seq.stats.ttft_s = time.perf_counter() - seq.started
        seq.decode_started = time.perf_counter()
        seq.commit([first])
        self.totals["generated_tokens"] += min(1, seq.stats.generated_tokens)
        if not seq.finished and seq.proposer is not None:
            hidden_rows = mx.concatenate(seq.hidden_chunks) if seq.hidden_chunks else None
            self._guard(seq, "proposer_start", seq.proposer.start, seq.prompt, hidden_rows,
                        hidden_start=seq.reused_prefix)
        seq.hidden_chunks = []
        self.scheduler.prefilled(seq)
        if seq.finished:
            self._close(seq)

    def _decode_step(self) -> None:
        rows = self.scheduler.running
        ks = self._plan(rows)
        proposals = [self._propose(seq, k) for seq, k in zip(rows, ks)]
        t_proposed = time.perf_counter()
        window = max(len(p.tokens) for p in proposals) + 1
        tokens = [[seq.committed[-1], *p.tokens] + [0] * (window - 1 - len(p.tokens))
                  for seq, p in zip(rows, proposals)]
        faults.check("decode")
        logits, hidden = self.runner.decode(len(rows), window, [t for row in tokens for t in row])
        greedy_choice = self._greedy_choices(rows, logits)
        kept = []
        t_forward = time.perf_counter()
        for i, (seq, proposal) in enumerate(zip(rows, proposals)):
            choice = greedy_choice[i] if greedy_choice is not None and _plain_greedy(seq) else None
            n, token = self._accept(seq, logits[i, :len(proposal.tokens) + 1], proposal, choice)
            kept.append(n + 1)
            new = proposal.tokens[:n] + [token]
            self._observe_row(seq, len(proposal.tokens), n, len(new), hidden[i, :n + 1])
            before = seq.stats.generated_tokens
            seq.commit(new)
            self.totals["generated_tokens"] += seq.stats.generated_tokens - before
        self.runner.advance(kept)
        t_end = time.perf_counter()
        self._guard(None, "cost_model", self.planner.observe_step, len(rows), window,
                    t_forward - t_proposed, t_end - t_forward)
        self.totals["steps"] += 1
        self.batch_histogram[len(rows)] = self.batch_histogram.get(len(rows), 0) + 1
        for index in reversed(range(len(rows))):
            if rows[index].finished:
                self._close(self.scheduler.remove_row(index, keep_prefix=True))

    @staticmethod
    def _greedy_choices(rows: list[Sequence], logits: mx.array) -> list | None:
        """One argmax over the batch for the greedy rows without penalties (one host sync)."""
        if any(_plain_greedy(s) for s in rows):
            return mx.argmax(logits, axis=-1).tolist()
        return None

    def _accept(self, seq: Sequence, logits: mx.array, proposal: Proposal,
                greedy_choice: list[int] | None) -> tuple[int, int]:
        if greedy_choice is not None:
            return accept_greedy_choices(greedy_choice[:len(proposal.tokens) + 1], proposal.tokens)
        if seq.params.is_greedy:
            return verify_greedy(logits, proposal.tokens, seq.committed, seq.params)
        return verify_sampling(logits, proposal.tokens, proposal.q, seq.committed,
                               seq.params, seq.rng)

    # ---- speculation bookkeeping: a fault here costs speculation, never the request ---------
    def _guard(self, seq: Sequence | None, source: str, fn, *args, **kwargs):
        """Run bookkeeping `fn`; on a fault count it, log it once, and return None. A proposer
        that raised is dropped for the rest of its request (its cache state is unknown)."""
        try:
            faults.check(source)
            return fn(*args, **kwargs)
        except Exception as exc:
            if seq is not None and source.startswith("propos"):
                source = f"proposer:{seq.method}"
                seq.proposer = None
                seq.row.k_max = 0
            self.spec_faults.record(source, exc)
            return None

    def _plan(self, rows: list[Sequence]) -> list[int]:
        ks = self._guard(None, "plan", self.planner.plan, [s.row for s in rows])
        if ks is None or len(ks) != len(rows):
            return [0] * len(rows)
        return [max(0, int(k)) for k in ks]

    def _observe_row(self, seq: Sequence, drafted: int, accepted: int, emitted: int, hidden) -> None:
        seq.stats.spec.observe_step(drafted, accepted, emitted)
        self._spec_totals(seq.method).observe_step(drafted, accepted, emitted)
        if seq.proposer is not None and seq.proposer.needs_hidden:
            self._guard(seq, "proposer_observe", seq.proposer.observe, hidden)
        self._guard(None, "controller", self._observe_controller, seq.row, drafted, accepted)

    def _observe_controller(self, row: RowController, drafted: int, accepted: int) -> None:
        if row.k_max == 0:  # plain decoding: nothing to decide
            return
        row.observe(drafted, accepted, not row.adaptive or self.planner.pays_alone(row))

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        k = min(k, seq.room(self.max_context))
        if not k or seq.proposer is None:
            return Proposal([])
        t0 = time.perf_counter()
        proposal = self._guard(seq, "propose", self._checked_proposal, seq, k)
        if proposal is None:
            return Proposal([])
        self._guard(None, "cost_model", self.planner.observe_proposer, seq.method, k,
                    time.perf_counter() - t0)
        return proposal

    def _checked_proposal(self, seq: Sequence, k: int) -> Proposal:
        proposal = seq.proposer.propose(seq.committed, k, seq.params, seq.rng)
        tokens = [int(t) for t in proposal.tokens[:k]]
        if any(t < 0 or t >= self.vocab_size for t in tokens):
            raise ValueError(f"proposed token id out of range [0, {self.vocab_size})")
        q = proposal.q
        if q is not None:
            q = q[:len(tokens)]
            if q.shape[0] != len(tokens):
                raise ValueError(f"proposal has {len(tokens)} tokens but {q.shape[0]} q rows")
        return Proposal(tokens, q)

    # ---- ends ----------------------------------------------------------------------------
    def _close(self, seq: Sequence, reason: str | None = None) -> None:
        seq.finish(reason)
        self._release_kv(seq)
        key = "cancelled" if seq.stats.finish_reason == "cancelled" else "completed"  # "stop" completes
        self.totals[key] += 1
        seq.proposer = None

    def _fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        try:
            self.scheduler.drop_prefilling(seq)
        except Exception:  # its slot may be half-made; the batch rows are untouched
            logger.debug("closing the failed slot %d", seq.request.id, exc_info=True)
        self._fail(seq, exc)
        self._release_kv(seq)

    def _release_kv(self, seq: Sequence) -> None:
        self.memory.reserved -= seq.kv_reserved
        seq.kv_reserved = 0

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        error = exc if isinstance(exc, MacspecError) else MacspecError(f"generation failed: {exc}")
        seq.emit(Failed(error))
        self.totals["failed"] += 1

    def fail_running(self, exc: Exception) -> None:
        """A decode step failed: every admitted request gets the error; the batch starts over."""
        for seq in self.scheduler.clear_running():
            self._fail(seq, exc)

    def fail_all(self, error: MacspecError) -> None:
        while self.scheduler.waiting:
            self._fail(self.scheduler.waiting.popleft(), error)
        self.fail_running(error)

    def fatal(self, reason: str) -> None:
        """A peer died or a step passed its deadline (watchdog thread): every request fails now
        and the peers are ended, which also breaks a collective the engine may be stuck in."""
        if self.fatal_reason:
            return
        self.fatal_reason = reason
        logger.error("tensor parallelism failed: %s", reason)
        error = EngineUnavailableError(f"tensor parallelism failed: {reason}")
        for _ in range(3):  # the engine thread may move sequences between queues meanwhile
            try:
                s = self.scheduler
                for seq in [*s.waiting, *s.prefilling, *s.running]:
                    seq.emit(Failed(error))
                break
            except RuntimeError:
                continue
        if self.tp is not None:
            self.tp.peers.kill()
        if self.on_fatal is not None:
            self.on_fatal()

    def close(self, clean: bool = True) -> None:
        """Stop the watchdog and (tensor parallelism) end the peers."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.tp is not None:
            self.tp.close(clean=clean and self.fatal_reason is None)

    def idle(self, heartbeat_s: float) -> None:
        self.runner.idle(heartbeat_s)

    # ---- the synchronous API: run, tests, benchmarks ----------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_tokens: int | list[int], **options) -> list[Completion]:
        """Generate for every prompt together (batched as the scheduler allows); `options` are
        GenerationRequest fields (method, num_draft, adaptive, stop_token_ids, ignore_eos), each
        a value or one per prompt. Returns when all are done."""
        count = len(prompts)

        def each(value, i):
            return value[i] if isinstance(value, list) else value

        completions = [Completion() for _ in range(count)]
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
        while True:
            if not events:
                if not self.has_work:
                    return
                self._step_or_fail()
            while events:
                event = events.pop(0)
                if isinstance(event, Tokens):
                    yield event.ids
                elif isinstance(event, Finished):
                    if stats is not None:
                        stats.update(event.stats)
                    return
                elif isinstance(event, Failed):
                    raise event.error

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

    # ---- calibration and reporting -----------------------------------------------------
    def calibrate(self) -> None:
        """Time the target forward at a few (rows, window) shapes to seed the cost model."""
        k_max = max(1, self.runtime.profile.speculative.num_draft_tokens)
        for rows in sorted({1, min(4, self.max_batch)}):
            for window in (1, k_max + 1):
                # The first run of a shape pays one-off costs.
                for seconds in self.runner.time_forward(rows, window, 3)[1:]:
                    self.planner.forward.observe(rows, window, seconds)
        logger.info("calibrated target forward cost (ms): %s", self.planner.as_dict()["forward_ms"])

    def _spec_totals(self, method: str) -> SpecStats:
        if method not in self.spec_totals:
            self.spec_totals[method] = SpecStats()
        return self.spec_totals[method]

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        self._last_log = now
        parts = [f"{m}: acceptance {s.acceptance_rate:.2f}, {s.tokens_per_forward:.2f} tok/fwd"
                 for m, s in self.spec_totals.items()]
        logger.info("%d running, %d waiting, %d tokens generated; %s", len(self.scheduler.running),
                    len(self.scheduler.waiting), self.totals["generated_tokens"], "; ".join(parts) or "-")
        mem = usage()
        logger.info("memory: KV reserved %d/%d MB, prefix cache %d MB, MLX active %d MB, cache %d MB, "
                    "%d admissions waited", self.memory.reserved // MB, self.memory.budget // MB,
                    self.scheduler.prefix_cache.nbytes // MB, mem["mlx_active_bytes"] // MB,
                    mem["mlx_cache_bytes"] // MB, self.memory.waits)

    def status(self) -> dict:
        """A snapshot; call it from the thread that steps the engine (the service does)."""
        s = self.scheduler
        rows = list(s.running)
        states: dict[str, int] = {}
        for seq in rows:
            states[seq.row.state] = states.get(seq.row.state, 0) + 1
        return {
            "running": len(rows),
            "prefilling": len(s.prefilling),
            "waiting": len(s.waiting),
            "max_batch": self.max_batch,
            "totals": dict(self.totals),
            "batch_size_histogram": {str(b): n for b, n in sorted(self.batch_histogram.items())},
            "speculation": {m: st.as_dict() for m, st in self.spec_totals.items()},
            "speculation_faults": self.spec_faults.as_dict(),
            "rows": {"k_in_use": [seq.row.last_k for seq in rows], "states": states},
            "cost_model": self.planner.as_dict(),
            "prefix_cache": s.prefix_cache.as_dict(),
            "kv_cache_bytes": self.runner.kv.nbytes(),
            "memory": {**usage(), "kv_budget_bytes": self.memory.budget,
                       "kv_reserved_bytes": self.memory.reserved,
                       "limit_bytes": self.memory.limit},
            "admission": self.memory.as_dict(),
            "tensor_parallel": self._tp_status(),
        }

    def _tp_status(self) -> dict | None:
        if self.tp is None:
            return None
        return {"ranks": self.tp.size, "plans": self.tp.channel.sequence,
                "plan_collectives": self.tp.channel.collectives,
                "step_timeout_s": self.tp.step_timeout_s, "worker_pids": self.tp.peers.pids}


def _collector(completion: Completion):
    def sink(event: Event) -> None:
        if isinstance(event, Tokens):
            completion.tokens.extend(event.ids)
        elif isinstance(event, Finished):
            completion.finish_reason, completion.stats = event.reason, event.stats
        elif isinstance(event, Failed):
            completion.error = event.error

    return sink


def _dtype_bytes(model) -> int:
    """The compute dtype's size (the KV's): norms stay unquantized, unlike embeddings."""
    return model.model.norm.weight.dtype.size


def _plain_greedy(seq: Sequence) -> bool:
    return seq.params.is_greedy and not seq.params.has_penalty
