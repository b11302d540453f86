"""The serving engine: one thread that owns all MLX work, fed through a small queue API.

submit()/cancel() may be called from any thread; events go back through each request's sink.
Each loop iteration: take new requests and cancellations, admit waiting requests up to
max_batch, run one prefill chunk (one request at a time, so decoding never stalls behind a
long prompt), then one batched speculative decode step over every running row.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import mlx.core as mx

from ..errors import EngineUnavailableError, MacspecError, QueueFullError, RequestError
from ..monitor.memory import MB, KVBudget, kv_bytes_per_token, usage
from ..progress import phase
from ..spec.base import Proposal
from ..spec.planner import BatchPlanner, RowController
from ..spec.stats import SpecStats
from ..spec.verify import accept_greedy_choices, verify_greedy, verify_sampling
from . import faults
from .faults import SpecFaults
from .generator import GenerationStats
from .prefix_cache import PrefixCache
from .request import Accepted, Failed, GenerationRequest, emit_safely
from .runtime import Runtime
from .sampling import Rng
from .sequence import Sequence
from .target_state import NO_ENTRY, TargetState

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
HEARTBEAT_S = 1.0  # tensor parallelism: an idle rank 0 proves itself alive this often
STATS_LOG_INTERVAL_S = 30.0


class Engine:
    def __init__(self, runtime: Runtime, max_batch: int | None = None, max_queue: int | None = None,
                 tp=None):
        profile = runtime.profile
        self.runtime = runtime
        self.view = runtime.view
        self.max_batch = max_batch or profile.server.max_batch
        self.max_queue = max_queue or profile.server.max_queue
        self.max_context = profile.kv.max_context
        self.prefill_chunk = profile.kv.prefill_chunk
        if profile.kv.kv_bits:
            logger.warning("kv.kv_bits = %d is applied by `macspec run` only; the serving engine keeps "
                           "its batched KV in the model's dtype", profile.kv.kv_bits)
        faults.arm_from_env()
        self.tp = tp  # a TPContext: every target op is mirrored to the workers
        self.watchdog = None
        self.target = self._make_target(TargetState(self.view))
        self.vocab_size = int(self.view.inner.embed_tokens.weight.shape[0])
        self.prefix_cache = PrefixCache(profile.kv.prefix_cache_mb * 2**20)
        self.planner = BatchPlanner()
        self.memory = KVBudget.for_engine(self._kv_per_token("none"), profile.kv.kv_budget_mb)
        logger.info("KV budget %d MB (%s), %d bytes per token", self.memory.budget // MB,
                    self.memory.source, self.memory.bytes_per_token)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []  # index i <-> row i of the target's batched KV
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.started_at = time.time()
        self.degraded_reason: str | None = None
        self.fatal_reason: str | None = None
        self.totals = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                       "prompt_tokens": 0, "generated_tokens": 0, "steps": 0}
        self.spec_totals: dict[str, SpecStats] = {}
        self.spec_faults = SpecFaults()
        self.batch_histogram: dict[int, int] = {}
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

    def _make_target(self, state: TargetState):
        if self.tp is None:
            return state
        from ..distributed.channel import MirroredTarget
        from ..distributed.watchdog import Watchdog

        self.watchdog = Watchdog(self.tp.step_timeout_s, self.fatal, self.tp.peers)
        return MirroredTarget(state, self.tp.channel, self.watchdog)

    # ---- thread-safe API -------------------------------------------------------------
    def start(self, calibrate: bool = True) -> None:
        if self.watchdog is not None:
            self.watchdog.start()
        if calibrate:
            with phase("calibrating the target's step cost"):
                self._calibrate()
        self._thread = threading.Thread(target=self._loop, name="macspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2.0 if self.fatal_reason else timeout)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.tp is not None:  # a thread stuck in a collective cannot say goodbye: reap
            self.tp.close(clean=self.fatal_reason is None and not self._thread_alive())

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def fatal(self, reason: str) -> None:
        """A peer died or a step passed its deadline (any thread): fail every request now,
        stop; the daemon exits non-zero. The engine thread may be stuck in a collective."""
        with self._lock:
            if self.fatal_reason:
                return
            self.fatal_reason = self.degraded_reason = reason
        self._stopping = True
        self._wake.set()
        error = EngineUnavailableError(f"tensor parallelism failed: {reason}")
        for _ in range(3):  # the engine thread may move sequences between queues meanwhile
            try:
                for seq in [*self.waiting, *self.prefilling, *self.decoding]:
                    seq.emit(Failed(error))
                break
            except RuntimeError:
                continue

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, request: GenerationRequest) -> None:
        if not self.alive:
            raise EngineUnavailableError("the engine is not running")
        with self._lock:
            queued = len(self.waiting) + sum(1 for op, _ in self._inbox if op == "submit")
            if queued >= self.max_queue:
                self.totals["rejected"] += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting); retry later")
            self._inbox.append(("submit", request))
        self._wake.set()

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """End a request early: "cancelled" (the client left) or "stop" (a stop string matched,
        which completes it)."""
        with self._lock:
            self._inbox.append(("cancel", (request_id, reason)))
        self._wake.set()

    # ---- loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._drain_inbox()
                self._admit()
                if not self.prefilling and not self.decoding:
                    self.target.idle(HEARTBEAT_S)
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                if self.prefilling:
                    self._prefill_step(self.prefilling[0])
                if self.decoding:
                    self._decode_step()
                self.degraded_reason = None
            except _PrefillFailed as failure:  # only the request being prefilled is concerned
                if self.tp is not None:
                    logger.error("tensor-parallel prefill failed", exc_info=failure.cause)
                    self.fatal(self._explain_tp_failure(failure.cause))
                    break
                logger.error("prefill of request %d failed", failure.seq.request.id, exc_info=failure.cause)
                self._fail_prefill(failure.seq, failure.cause)
            except Exception as exc:  # an engine bug must fail requests, never hang them
                if self.tp is not None:  # the ranks may no longer be in lock-step
                    logger.error("tensor-parallel engine step failed", exc_info=exc)
                    self.fatal(self._explain_tp_failure(exc))
                    break
                logger.exception("engine step failed")
                self.degraded_reason = f"last step failed: {exc!r}"
                self._fail_running(exc)
            self._maybe_log()
        self._fail_everything(EngineUnavailableError(
            f"tensor parallelism failed: {self.fatal_reason}" if self.fatal_reason
            else "the server is shutting down"))

    def _explain_tp_failure(self, exc: Exception) -> str:
        """A lost link usually means a dead peer: name it (and its exit code) when one exits."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            exited = self.tp.peers.first_exited()
            if exited:
                return f"{exited} ({exc})"
            time.sleep(0.05)
        return str(exc)

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                op, payload = self._inbox.popleft()
            if op == "cancel":
                self._cancel(*payload)
                continue
            try:
                seq = self._make_sequence(payload)
            except Exception as err:  # whatever goes wrong, this request gets its answer
                if not isinstance(err, MacspecError):
                    logger.exception("could not start request %d", payload.id)
                    err = MacspecError(f"could not start the request: {err!r}")
                self.totals["failed"] += 1
                emit_safely(payload, Failed(err))
                continue
            emit_safely(payload, Accepted())
            self.totals["requests"] += 1
            with self._lock:
                self.waiting.append(seq)

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
        row = RowController(k_max, adaptive, method,
                            spec.probe_min_steps, spec.probe_max_steps)
        stats = GenerationStats(method if proposer else "none", k_max)
        eos = set(req.stop_token_ids)
        if not req.ignore_eos:
            eos |= set(self.runtime.tokenizer.eos_token_ids)
        return Sequence(req, method, proposer, row, stats, Rng(req.params.seed), eos, list(req.prompt),
                        kv_reserved=need)

    def _admit(self) -> None:
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_batch:
            if not self._memory_for(self.waiting[0]):
                return
            with self._lock:
                seq = self.waiting.popleft()
            self.memory.reserved += seq.kv_reserved
            reused, entry = self.prefix_cache.lookup(seq.prompt)
            self.target.open_slot(seq.request.id, NO_ENTRY if entry is None else entry, reused)
            seq.prefill_done = seq.reused_prefix = reused
            self.prefilling.append(seq)

    def _memory_for(self, seq: Sequence) -> bool:
        """Room for `seq`'s KV? Under pressure, finished requests' prefixes go first, then MLX's
        buffer cache; otherwise it waits (in order) for running requests to finish."""
        while not self.memory.fits(seq.kv_reserved, self.prefix_cache.nbytes):
            entry = self.prefix_cache.evict_oldest()
            if entry is None:
                self.memory.relieve_pressure()
                if not seq.waited_for_memory:
                    seq.waited_for_memory = True
                    self.memory.waits += 1
                return False
            self.target.drop_prefixes([entry])
        return True

    def _cancel(self, request_id: int, reason: str = "cancelled") -> None:
        for seq in [s for s in self.waiting if s.request.id == request_id]:
            self.waiting.remove(seq)
            seq.kv_reserved = 0  # never admitted: it holds no budget
            self._close(seq, reason)
        for seq in [s for s in self.prefilling if s.request.id == request_id]:
            self.prefilling.remove(seq)
            self.target.close_slot(request_id, NO_ENTRY, 0)
            self._close(seq, reason)
        for index in [i for i, s in enumerate(self.decoding) if s.request.id == request_id]:
            self._remove_row(index, reason)

    # ---- prefill ---------------------------------------------------------------------
    def _prefill_step(self, seq: Sequence) -> None:
        try:
            self._prefill_chunk(seq)
        except Exception as exc:
            raise _PrefillFailed(seq, exc) from exc

    def _prefill_chunk(self, seq: Sequence) -> None:
        faults.check("prefill")
        prompt, start = seq.prompt, seq.prefill_done
        chunk = prompt[start:start + self.prefill_chunk]
        hidden, logits = self.target.prefill(seq.request.id, chunk)
        if seq.proposer is not None and seq.proposer.needs_hidden:
            seq.hidden_chunks.append(hidden)
        seq.prefill_done += len(chunk)
        self.totals["prompt_tokens"] += len(chunk)
        if seq.prefill_done < len(prompt):
            return
        self.prefilling.popleft()
        first = self._accept(seq, logits, Proposal([]), None)[1]
        seq.stats.prompt_tokens = len(prompt)
        seq.stats.ttft_s = time.perf_counter() - seq.started
        seq.decode_started = time.perf_counter()
        seq.commit([first])
        self.totals["generated_tokens"] += min(1, seq.stats.generated_tokens)
        slot = seq.request.id
        if seq.finished:
            entry = self._store_prefix(prompt, self.target.slot_nbytes(slot, len(prompt)))
            self.target.close_slot(slot, entry, len(prompt))
            self._close(seq)
            return
        if seq.proposer is not None:
            hidden_rows = mx.concatenate(seq.hidden_chunks) if seq.hidden_chunks else None
            self._guard(seq, "proposer_start", seq.proposer.start, prompt, hidden_rows,
                        hidden_start=seq.reused_prefix)
        seq.hidden_chunks = []
        self.target.slot_to_row(slot, len(prompt))
        self.decoding.append(seq)

    # ---- decode ----------------------------------------------------------------------
    def _decode_step(self) -> None:
        rows = self.decoding
        ks = self._plan(rows)
        proposals = [self._propose(seq, k) for seq, k in zip(rows, ks)]
        t_proposed = time.perf_counter()
        window = max(len(p.tokens) for p in proposals) + 1
        tokens = [[seq.committed[-1], *p.tokens] + [0] * (window - 1 - len(p.tokens))
                  for seq, p in zip(rows, proposals)]
        faults.check("decode")
        logits, hidden = self.target.decode(len(rows), window, [t for row in tokens for t in row])
        greedy_choice = self._greedy_choices(rows, logits)
        if greedy_choice is not None:
            greedy_choice = greedy_choice.tolist()
        kept = []
        t_forward = time.perf_counter()
        for i, (seq, proposal) in enumerate(zip(rows, proposals)):
            choice = greedy_choice[i] if greedy_choice is not None and _plain_greedy(seq) else None
            n, token = self._accept(seq, logits[i, :len(proposal.tokens) + 1], proposal, choice)
            kept.append(n + 1)
            drafted = len(proposal.tokens)
            new = proposal.tokens[:n] + [token]
            self._observe_row(seq, drafted, n, len(new), hidden[i, :n + 1])
            before = seq.stats.generated_tokens
            seq.commit(new)
            self.totals["generated_tokens"] += seq.stats.generated_tokens - before
        self.target.advance(kept)
        t_end = time.perf_counter()
        self._guard(None, "cost_model", self._observe_cost, len(rows), window,
                    t_forward - t_proposed, t_end - t_forward)
        self.totals["steps"] += 1
        self.batch_histogram[len(rows)] = self.batch_histogram.get(len(rows), 0) + 1
        for index in reversed(range(len(rows))):
            if rows[index].finished:
                self._remove_row(index)

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
        row.observe(drafted, accepted, not row.adaptive or self.planner.pays_alone(row))

    def _observe_cost(self, rows: int, window: int, forward_s: float, rest_s: float) -> None:
        self.planner.observe_step(rows, window, forward_s, rest_s)

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
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"proposed token id out of range [0, {vocab})")
        q = proposal.q
        if q is not None:
            q = q[:len(tokens)]
            if q.shape[0] != len(tokens):
                raise ValueError(f"proposal has {len(tokens)} tokens but {q.shape[0]} q rows")
        return Proposal(tokens, q)

    @staticmethod
    def _greedy_choices(rows: list[Sequence], logits: mx.array):
        """One argmax over the batch for the greedy rows without penalties (one host sync)."""
        if any(_plain_greedy(s) for s in rows):
            return mx.argmax(logits, axis=-1)
        return None

    def _accept(self, seq: Sequence, logits: mx.array, proposal: Proposal,
                greedy_choice: list[int] | None) -> tuple[int, int]:
        if greedy_choice is not None:
            return accept_greedy_choices(greedy_choice[:len(proposal.tokens) + 1], proposal.tokens)
        if seq.params.is_greedy:
            return verify_greedy(logits, proposal.tokens, seq.committed, seq.params)
        return verify_sampling(logits, proposal.tokens, proposal.q, seq.committed,
                               seq.params, seq.rng)

    def _remove_row(self, index: int, reason: str | None = None) -> None:
        seq = self.decoding.pop(index)
        entry, length = NO_ENTRY, 0
        if reason is None:  # finished normally: its KV may serve a later prompt's prefix
            length = self.target.kv.lengths[index]
            entry = self._store_prefix(seq.committed[:length], self.target.row_nbytes(length))
        self.target.remove_row(index, entry, length)
        self._close(seq, reason)

    def _store_prefix(self, tokens: list[int], nbytes: int) -> int:
        """Admit `tokens` to the prefix index -> the entry id to store under (or NO_ENTRY)."""
        if not self.prefix_cache.max_bytes:
            return NO_ENTRY
        entry, dropped = self.prefix_cache.store(tokens, nbytes)
        if dropped:
            self.target.drop_prefixes(dropped)
        return NO_ENTRY if entry is None else entry

    def _close(self, seq: Sequence, reason: str | None = None) -> None:
        seq.finish(reason)
        self.memory.reserved -= seq.kv_reserved
        seq.kv_reserved = 0
        key = "cancelled" if seq.stats.finish_reason == "cancelled" else "completed"  # "stop" completes
        self.totals[key] += 1
        seq.proposer = None

    def _fail_running(self, exc: Exception) -> None:
        error = exc if isinstance(exc, MacspecError) else MacspecError(f"generation failed: {exc}")
        for seq in [*self.prefilling, *self.decoding]:
            seq.emit(Failed(error))
            self.totals["failed"] += 1
        self.prefilling.clear()
        self.decoding.clear()
        self.memory.reserved = 0
        self.target.reset()

    def _fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        error = exc if isinstance(exc, MacspecError) else MacspecError(f"generation failed: {exc}")
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        try:
            self.target.close_slot(seq.request.id, NO_ENTRY, 0)
        except Exception:  # its slot may be half-made; the batch rows are untouched
            logger.debug("closing the failed slot %d", seq.request.id, exc_info=True)
        seq.emit(Failed(error))
        self.totals["failed"] += 1
        self.memory.reserved -= seq.kv_reserved
        seq.kv_reserved = 0

    def _fail_everything(self, error: MacspecError) -> None:
        self._drain_inbox()
        for seq in self.waiting:
            seq.emit(Failed(error))
        self.waiting.clear()
        self._fail_running(error)

    def _spec_totals(self, method: str) -> SpecStats:
        if method not in self.spec_totals:
            self.spec_totals[method] = SpecStats()
        return self.spec_totals[method]

    # ---- calibration and reporting -----------------------------------------------------
    def _calibrate(self) -> None:
        """Time the target forward at a few (rows, window) shapes to seed the cost model."""
        k_max = max(1, self.runtime.profile.speculative.num_draft_tokens)
        for rows in (1, 4):
            for window in (1, k_max + 1):
                # The first run of a shape pays one-off costs.
                for seconds in self.target.time_forward(rows, window, 3)[1:]:
                    self.planner.forward.observe(rows, window, seconds)
        logger.info("calibrated target forward cost (ms): %s", self.planner.as_dict()["forward_ms"])

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < STATS_LOG_INTERVAL_S:
            return
        self._last_log = now
        parts = [f"{m}: acceptance {s.acceptance_rate:.2f}, {s.tokens_per_forward:.2f} tok/fwd"
                 for m, s in self.spec_totals.items()]
        logger.info("%d running, %d waiting, %d tokens generated; %s", len(self.decoding),
                    len(self.waiting), self.totals["generated_tokens"], "; ".join(parts) or "-")
        mem = usage()
        logger.info("memory: KV reserved %d/%d MB, prefix cache %d MB, MLX active %d MB, cache %d MB, "
                    "%d admissions waited", self.memory.reserved // MB, self.memory.budget // MB,
                    self.prefix_cache.nbytes // MB, mem["mlx_active_bytes"] // MB,
                    mem["mlx_cache_bytes"] // MB, self.memory.waits)

    def status(self) -> dict:
        rows = list(self.decoding)
        states: dict[str, int] = {}
        for seq in rows:
            states[seq.row.state] = states.get(seq.row.state, 0) + 1
        return {
            "state": "running" if self.alive else "stopped",
            "degraded_reason": self.degraded_reason,
            "running": len(rows),
            "prefilling": len(self.prefilling),
            "waiting": len(self.waiting),
            "max_batch": self.max_batch,
            "max_queue": self.max_queue,
            "totals": dict(self.totals),
            "batch_size_histogram": {str(b): n for b, n in sorted(self.batch_histogram.items())},
            "speculation": {m: s.as_dict() for m, s in self.spec_totals.items()},
            "speculation_faults": self.spec_faults.as_dict(),
            "rows": {"k_in_use": [seq.row.last_k for seq in rows], "states": states},
            "cost_model": self.planner.as_dict(),
            "prefix_cache": self.prefix_cache.as_dict(),
            "kv_cache_bytes": self.target.kv.nbytes(),
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


class _PrefillFailed(Exception):
    def __init__(self, seq: Sequence, cause: Exception):
        super().__init__(str(cause))
        self.seq, self.cause = seq, cause


def _dtype_bytes(model) -> int:
    """The compute dtype's size (the KV's): norms stay unquantized, unlike embeddings."""
    return model.model.norm.weight.dtype.size


def _plain_greedy(seq: Sequence) -> bool:
    return seq.params.is_greedy and not seq.params.has_penalty
