"""The engine: synchronous, one code path for `run`, `serve`, the proofs and the benchmarks.

add_request() queues a request; each step() is schedule -> propose -> verify -> commit: admit
waiting requests, prefill up to one chunk's worth of prompt tokens (whole chunks, of one request
or several), then one batched speculative decode step over every running row (each row with its
own proposer and k, chosen by the policy). Events go to each request's sink as they happen.
generate() runs steps until its requests are done; `serve` wraps the engine in a thread with
queues (service.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import mlx.core as mx

from .. import faults, proposers
from ..blas import govern_threads
from ..errors import EngineUnavailableError, MacspecError
from ..grammar import GrammarError
from ..kv.disk import open_store
from ..kv.prefix import PrefixCache
from ..models.view import join_states
from ..monitor.memory import MB, KVBudget
from ..paths import cache_dir, state_dir
from ..speculative.calibrate import calibrate
from ..speculative.kept import COSTS_FILE, PRIORS_FILE, cost_key, load_costs, save_costs
from ..speculative.speculator import Speculator
from . import window
from .blocking import BlockingAPI
from .request import Failed, GenerationRequest
from .runner import TargetRunner
from .runtime import Runtime
from .scheduler import Scheduler
from .sequence import Sequence, new_sequence
from .stats import EngineStats, engine_status

logger = logging.getLogger(__name__)


class Engine(BlockingAPI):
    def __init__(self, runtime: Runtime, max_batch: int | None = None, tp=None):
        profile = runtime.profile
        self.runtime = runtime
        self.max_batch = max_batch or profile.server.max_batch
        self.max_context = profile.kv.max_context
        faults.arm_from_env()
        self.tp = tp  # a TPContext: every runner op is mirrored to the workers
        self.watchdog = None
        disk = open_store(profile.kv, runtime.target.path, profile.model.dtype,
                          world=self.tp_size)
        self.runner = self._make_runner(TargetRunner(runtime.view, tp.group if tp else None, disk))
        self.speculator = Speculator(lambda method: runtime.make_group(method, runtime.vocab_size),
                                     profile.speculative, runtime.vocab_size)
        memory = KVBudget.for_engine(runtime.kv_bytes_per_token(proposers.PLAIN, self.tp_size),
                                     profile.kv.kv_budget_mb)
        logger.info("KV budget %d MB (%s), %d bytes per token", memory.budget // MB, memory.source,
                    memory.bytes_per_token)
        self.scheduler = Scheduler(self.runner, memory, PrefixCache(profile.kv.prefix_cache_mb * 2**20),
                                   self.max_batch, profile.kv.prefill_chunk)
        self.stats = EngineStats()
        self.fatal_reason: str | None = None
        self.on_fatal = None  # called after fatal() (the service wakes its thread)
        self.live_counts = {"running": 0, "prefilling": 0, "waiting": 0}  # replaced, never mutated
        self._cost_key: str | None = None  # after calibrate(): the step-cost table is kept under it
        self._save_priors: Callable[[], None] | None = None  # after remember_priors()
        self._kept: tuple[int, float] = (-1, 0.0)  # the step clock and the time when last kept

    @property
    def tp_size(self) -> int:
        return self.tp.size if self.tp else 1

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
            seq = new_sequence(request, self.runtime, self.speculator, self.max_context, self.tp_size)
            self.scheduler.add(seq)
        except Exception as exc:  # whatever goes wrong, it is this request's error
            self.stats.count("failed")
            if isinstance(exc, MacspecError):
                raise
            logger.exception("could not start request %d", request.id)
            raise MacspecError(f"could not start the request: {exc!r}") from exc
        self.stats.count("requests")
        return seq

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
        """Admit, prefill up to one chunk's worth of tokens, decode one batched step. A failed
        prefill fails only its request (one process); any other failure propagates (the caller
        fails what is running)."""
        govern_threads()
        self.scheduler.admit()
        self._publish_counts()
        budget = self.scheduler.prefill_chunk
        while (chunk := self.scheduler.next_prefill(budget)) is not None:
            budget -= max(1, len(chunk[1]))
            t0 = time.perf_counter()
            try:
                self._prefill(*chunk)
            except Exception as exc:
                if self.tp is not None:  # the ranks may no longer be in lock-step
                    raise
                logger.error("prefill of request %d failed", chunk[0].request.id, exc_info=exc)
                self._fail_prefill(chunk[0], exc)
            self.stats.time_s["prefill"] += time.perf_counter() - t0
        if self.scheduler.running:
            self._decode_step(list(self.scheduler.running))
        self._publish_counts()
        self.stats.maybe_log(self)

    def _publish_counts(self) -> None:
        """Queue lengths other threads may read while a (long) step runs."""
        s = self.scheduler
        self.live_counts = {"running": len(s.running), "prefilling": len(s.prefilling),
                            "waiting": len(s.waiting)}

    def _prefill(self, seq: Sequence, chunk: list[int]) -> None:
        faults.check("prefill")
        hidden, logits = self.runner.prefill(seq.request.id, chunk)
        if seq.keeps_states:
            seq.hidden_chunks.append(hidden)
        seq.prefill_done += len(chunk)
        self.stats.count("prompt_tokens", len(chunk))
        if seq.prefill_done < len(seq.prompt):
            return
        masks = seq.constraint.masks([])[0] if seq.constraint is not None else None
        no_drafts = mx.array([], dtype=mx.int32)
        verdict, report = window.row_verdict(seq, logits, no_drafts, None, seq.context(masks))
        mx.eval(verdict, report if report is not None else [])
        seq.stats.prompt_tokens = len(seq.prompt)
        seq.stats.ttft_s = time.perf_counter() - seq.started
        seq.decode_started = time.perf_counter()
        self._commit(seq, [verdict.tolist()[1]], window.logprob_entries(report, 1, seq.request.logprobs))
        hidden_rows, hidden_start = None, seq.reused_prefix
        if seq.hidden_chunks:  # the reused prefix's states (from its cache entry) come first
            hidden_rows, hidden_start = join_states(seq.states + seq.hidden_chunks), 0
            seq.states = [hidden_rows]
        if not seq.finished:
            self.speculator.start(seq, hidden_rows, hidden_start)
        seq.hidden_chunks = []
        self.scheduler.prefilled(seq)
        if seq.finished:
            self._close(seq)

    def _decode_step(self, seqs: list[Sequence]) -> None:
        """Plan, draft (every proposer for all of its rows at once), verify, commit. In one
        process the drafts, the target forward and the verdicts are one lazy graph read back in
        a single host sync (TP: one more, the peers get the window's tokens as ints)."""
        marks = [time.perf_counter()]
        ks = self.speculator.plan(seqs, self.max_context)
        marks.append(time.perf_counter())
        drafts = self.speculator.propose(seqs, ks)
        ks = [min(k, window.draft_length(d)) for k, d in zip(ks, drafts)]
        tokens = window.window_tokens(seqs, ks, drafts, max(ks) + 1)
        # A grammar needs the drafts on the host to mask each window position.
        drafted_under_grammar = any(ks[i] for i, s in enumerate(seqs) if s.constraint is not None)
        host = self._sync(tokens).tolist() if self.runner.needs_host_tokens or drafted_under_grammar else None
        masks = window.grammar_masks(seqs, ks, host)
        faults.check("decode")
        logits, hidden = self.runner.forward(tokens, host)
        verdicts, reports = window.verdicts(seqs, ks, drafts, tokens, logits, masks)
        marks.append(time.perf_counter())
        read = self._sync(mx.concatenate([verdicts, tokens[:, 1:]], axis=1), *self.speculator.cache_arrays(),
                          *reports.values()).tolist()
        marks.append(time.perf_counter())
        committed = self._commit_step(seqs, ks, read, hidden, reports)
        marks.append(time.perf_counter())
        self.speculator.observe_step(ks, marks[4] - marks[0], committed)
        for index in reversed(range(len(seqs))):
            if seqs[index].finished:
                self._close(self.scheduler.remove_row(index))
        self.stats.step_done(len(seqs), max(ks) + 1, sum(committed), marks + [time.perf_counter()])

    def _commit_step(self, seqs: list[Sequence], ks: list[int], read: list[list[int]], hidden: mx.array,
                     reports: dict[int, mx.array]) -> list[int]:
        """Each row keeps its accepted drafts and the verdict's token; proposers and the KV
        roll back what was rejected. `read[i]`: row i's (accepted, token, window drafts...).
        -> the tokens each row committed."""
        accepted = {}
        for i, seq in enumerate(seqs):
            n, token, proposed = read[i][0], read[i][1], read[i][2:2 + ks[i]]
            accepted[seq.request.id] = n
            new = proposed[:n] + [token]
            self.speculator.observe(seq, ks[i], n, len(new), hidden[i, :n + 1])
            self._commit(seq, new, window.logprob_entries(reports.get(i), n + 1, seq.request.logprobs))
        self.speculator.settle(accepted)
        self.runner.advance([accepted[seq.request.id] + 1 for seq in seqs])
        return [accepted[seq.request.id] + 1 for seq in seqs]

    def _sync(self, out: mx.array, *more) -> mx.array:
        """Evaluate (one host round trip), counted: the bench reports syncs per step."""
        mx.eval(out, *more)
        self.stats.host_syncs += 1
        return out

    def _commit(self, seq: Sequence, new: list[int], logprobs: list | None) -> None:
        """A grammar the output left (a bug) fails its request, not the batch."""
        before = seq.stats.generated_tokens
        try:
            seq.commit(new, logprobs)
        except GrammarError as err:
            logger.error("request %d: %s", seq.request.id, err)
            self._fail(seq, err)
            seq.stats.finish_reason = "stop"
        self.stats.count("generated_tokens", seq.stats.generated_tokens - before)

    # ---- ends ----------------------------------------------------------------------------
    def _close(self, seq: Sequence, reason: str | None = None) -> None:
        seq.finish(reason)
        # "stop" (a stop string matched) completes the request
        self.stats.count("cancelled" if seq.stats.finish_reason == "cancelled" else "completed")
        self.speculator.leave(seq)

    def _fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        try:
            self.scheduler.drop_prefilling(seq)
        except Exception:  # its slot may be half-made; the batch rows are untouched
            logger.debug("closing the failed slot %d", seq.request.id, exc_info=True)
        self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        seq.emit(Failed(exc if isinstance(exc, MacspecError) else MacspecError(f"generation failed: {exc}")))
        self.stats.count("failed")

    def fail_running(self, exc: Exception) -> None:
        """A decode step failed: every admitted request gets the error; the batch starts over."""
        self.speculator.reset()
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
        """Keep what this run measured; stop the watchdog and (tensor parallelism) end the peers."""
        self.keep_measurements(every_s=0.0)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.tp is not None:
            self.tp.close(clean=clean and self.fatal_reason is None)

    def idle(self, heartbeat_s: float) -> None:
        self.scheduler.persist()  # nothing waits on the disk writes now
        self.keep_measurements()  # a daemon that is killed keeps what it measured
        self.runner.idle(heartbeat_s)

    # ---- calibration, what runs keep, reporting ----------------------------------------
    def calibrate(self) -> None:
        """Seed the step-cost table: from the last run of these models with these settings on
        this machine (kept.py), else by timing the target forward and the proposer."""
        key = cost_key(self.runtime, self.runtime.method, self.max_batch, self.tp_size)
        path = cache_dir() / COSTS_FILE
        if calibrate(self.speculator, self.runner, self.runtime.method, self.max_batch,
                     load_costs(path, key)):
            logger.info("step costs from %s (an earlier run's; re-measured as steps run)", path)
        self._cost_key = key

    def remember_priors(self) -> None:
        """Start each method's acceptance where earlier runs of this model pair left it (the
        state dir), not at the optimistic default, and keep this run's there as it measures."""
        self._save_priors = self.speculator.remembered_priors(state_dir() / PRIORS_FILE,
                                                              self.runtime.target.path)
        if self.speculator.remembered:
            logger.info("acceptance from earlier runs: %s", ", ".join(
                f"{m} {a:.2f}" for m, a in sorted(self.speculator.remembered.items())))

    def keep_measurements(self, every_s: float = 60.0) -> None:
        """Save the step-cost table (after calibrate()) and the acceptance priors (after
        remember_priors()) for the next start, when steps ran since they were last saved."""
        costs = self.speculator.policy.costs
        clock, saved = self._kept
        if costs.clock == clock or time.monotonic() - saved < every_s:
            return
        self._kept = (costs.clock, time.monotonic())
        try:
            if self._cost_key is not None:
                save_costs(cache_dir() / COSTS_FILE, self._cost_key, costs)
            if self._save_priors is not None:
                self._save_priors()
        except Exception:  # bookkeeping: never a request's or a shutdown's failure
            logger.warning("could not save what this run measured", exc_info=True)

    def status(self) -> dict:
        """A snapshot; call it from the thread that steps the engine (the service does)."""
        return engine_status(self)

