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
from typing import Callable, Iterator

import mlx.core as mx

from ..errors import EngineUnavailableError, MacspecError, RequestError
from ..kv.prefix import PrefixCache
from ..monitor.memory import MB, KVBudget, kv_bytes_per_token, usage
from ..runner import TargetRunner
from ..grammar import GrammarError
from ..blas import govern_threads
from ..sampling import Rng, RowContext, SamplingParams, sample_plain_rows
from ..spec.base import ChainGroup, ChainRow, Drafts, ProposerGroup
from ..spec.controller import AcceptancePrior, RowController
from ..spec.planner import BatchPlanner
from ..spec.stats import SpecStats
from ..spec.verify import committed_logprobs, verify_greedy, verify_greedy_batch, verify_sampling
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
        self.vocab_size = runtime.vocab_size
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
        self.groups: dict[str, ProposerGroup] = {}  # method -> its proposer for all rows
        # Acceptance per draft position by method, across requests: a new request starts here.
        self.priors: dict[str, AcceptancePrior] = {}
        # Probe backoff by method, across requests: a useless proposer is not re-probed at the
        # minimum interval by every new request.
        self.probe_intervals: dict[str, int] = {}
        self.host_syncs = 0  # host syncs in decode steps (one per step without TP)
        # Where engine time goes (seconds): the bench reads these to explain a step's cost.
        self.time_s = {"prefill": 0.0, "plan": 0.0, "build": 0.0, "sync": 0.0, "commit": 0.0, "close": 0.0}
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
        proposer = self._group(method) if method != "none" else None
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
        row = RowController(k_max, adaptive, method, spec.probe_min_steps, spec.probe_max_steps,
                            prior=self.priors[method].alphas if method in self.priors else None,
                            first_probe_interval=self.probe_intervals.get(method))
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
        govern_threads()
        self.scheduler.admit()
        self._publish_counts()
        chunk = self.scheduler.next_prefill()
        if chunk is not None:
            t0 = time.perf_counter()
            try:
                self._prefill(*chunk)
                self.time_s["prefill"] += time.perf_counter() - t0
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
        masks = seq.constraint.masks([])[0] if seq.constraint is not None else None
        empty = mx.array([], dtype=mx.int32)
        verdict, report = self._row_verdict(seq, logits, empty, None, seq.context(masks))
        mx.eval(verdict, report if report is not None else [])
        first = verdict.tolist()[1]
        seq.stats.prompt_tokens = len(seq.prompt)
        seq.stats.ttft_s = time.perf_counter() - seq.started
        seq.decode_started = time.perf_counter()
        self._commit(seq, [first], _logprob_entries(report, 1, seq.request.logprobs))
        self.totals["generated_tokens"] += min(1, seq.stats.generated_tokens)
        hidden_rows, hidden_start = None, seq.reused_prefix
        if seq.hidden_chunks:  # the reused prefix's states (from its cache entry) come first
            hidden_rows, hidden_start = mx.concatenate(seq.states + seq.hidden_chunks), 0
            seq.states = [hidden_rows]
        if not seq.finished and seq.proposer is not None:
            self._guard(seq, "proposer_start", seq.proposer.join, seq.request.id, seq.committed,
                        hidden_rows, hidden_start=hidden_start)
        seq.hidden_chunks = []
        self.scheduler.prefilled(seq)
        if seq.finished:
            self._close(seq)

    def _decode_step(self) -> None:
        """Plan, draft (every proposer for all of its rows at once), verify, commit. Without
        tensor parallelism the drafts, the target forward and the acceptance are one lazy graph
        read back in a single host sync."""
        rows = self.scheduler.running
        t_start = time.perf_counter()
        self._retain_group_rows(rows)
        ks = self._plan(rows)
        t_planned = time.perf_counter()
        drafts = self._propose(rows, ks)
        ks = [min(k, _draft_length(d)) if d is not None else 0 for k, d in zip(ks, drafts)]
        window = max(ks) + 1
        tokens = self._window_tokens(rows, ks, drafts, window)
        constrained = [i for i, seq in enumerate(rows) if seq.constraint is not None]
        # The workers' plan carries the tokens as ints; a grammar needs the drafts on the host
        # to mask each window position (one more sync, only in steps with such rows drafting).
        flat = None
        if self.tp is not None or any(ks[i] for i in constrained):
            flat = self._sync(tokens).tolist()
        masks = self._grammar_masks(rows, ks, constrained, flat)
        faults.check("decode")
        if self.tp is None:
            logits, hidden = self.runner.forward_lazy(tokens)
        else:
            logits, hidden = self.runner.decode(len(rows), window, [t for row in flat for t in row])
        verdicts, reports = self._verdicts(rows, ks, drafts, tokens, logits, masks)
        t_built = time.perf_counter()
        host = self._sync(mx.concatenate([verdicts, tokens[:, 1:]], axis=1), *self._group_arrays(),
                          *reports.values()).tolist()
        t_synced = time.perf_counter()
        kept, accepted = [], {}
        for i, seq in enumerate(rows):
            n, token, proposed = host[i][0], host[i][1], host[i][2:2 + ks[i]]
            kept.append(n + 1)
            accepted[seq.request.id] = n
            new = proposed[:n] + [token]
            self._observe_row(seq, ks[i], n, len(new), hidden[i, :n + 1])
            before = seq.stats.generated_tokens
            self._commit(seq, new, _logprob_entries(reports.get(i), n + 1, seq.request.logprobs))
            self.totals["generated_tokens"] += seq.stats.generated_tokens - before
        self._settle_groups(accepted)
        self.runner.advance(kept)
        t_end = time.perf_counter()
        drafting = self._guard(None, "cost_model", self.planner.draft_seconds,
                               [s.row for s in rows], ks) or 0.0
        self._guard(None, "cost_model", self.planner.observe_step, len(rows), window,
                    max(t_synced - t_start - drafting, 0.0), t_end - t_synced)
        self.totals["steps"] += 1
        self.batch_histogram[len(rows)] = self.batch_histogram.get(len(rows), 0) + 1
        for index in reversed(range(len(rows))):
            if rows[index].finished:
                self._close(self.scheduler.remove_row(index, keep_prefix=True))
        for key, seconds in (("plan", t_planned - t_start), ("build", t_built - t_planned),
                             ("sync", t_synced - t_built), ("commit", t_end - t_synced),
                             ("close", time.perf_counter() - t_end)):
            self.time_s[key] += seconds

    def _sync(self, out: mx.array, *more) -> mx.array:
        """Evaluate (one host round trip), counted: the bench reports syncs per step."""
        mx.eval(out, *more)
        self.host_syncs += 1
        return out

    def _window_tokens(self, rows: list[Sequence], ks: list[int], drafts: list, window: int) -> mx.array:
        """[B, window]: each row's last token, then its drafts, padded (padding is never kept)."""
        host = [[seq.committed[-1]] + [0] * (window - 1) for seq in rows]
        lazy: dict[int, list[tuple[int, mx.array]]] = {}  # draft width -> (row, tokens)
        for i, d in enumerate(drafts):
            if d is None or not ks[i]:
                continue
            if isinstance(d.tokens, list):
                host[i][1:1 + ks[i]] = d.tokens[:ks[i]]
            else:
                lazy.setdefault(d.tokens.shape[0], []).append((i, d.tokens))
        tokens = mx.array(host, dtype=mx.int32)
        for width, items in lazy.items():
            index = mx.array([i for i, _ in items])
            tokens[index, 1:1 + width] = mx.stack([t for _, t in items]).astype(mx.int32)
        return tokens

    def _grammar_masks(self, rows: list[Sequence], ks: list[int], constrained: list[int],
                       flat: list[list[int]] | None) -> dict[int, mx.array]:
        """Row -> allowed ids at each window position under its grammar; a row's k is cut just
        past its first draft the grammar refuses (that draft is then rejected, losslessly)."""
        masks = {}
        for i in constrained:
            drafted = flat[i][1:1 + ks[i]] if ks[i] else []
            masks[i], valid = rows[i].constraint.masks(drafted)
            ks[i] = min(ks[i], valid + 1)
        return masks

    def _verdicts(self, rows: list[Sequence], ks: list[int], drafts: list, tokens: mx.array,
                  logits: mx.array, masks: dict[int, mx.array]) -> tuple[mx.array, dict[int, mx.array]]:
        """[B, 2] (accepted, next token) for every row, lazily: plain greedy rows by one batched
        argmax, the others (sampling, penalties, grammars, logprobs) one by one; and for rows
        that asked for logprobs, their report (see committed_logprobs)."""
        proposed = tokens[:, 1:]
        special = [i for i, seq in enumerate(rows)
                   if i in masks or seq.request.logprobs is not None or not seq.context().is_plain_greedy]
        if len(special) < len(rows):
            verdicts = verify_greedy_batch(mx.argmax(logits, axis=-1), proposed, mx.array(ks))
        else:
            verdicts = mx.zeros((len(rows), 2), dtype=mx.int32)
        reports: dict[int, mx.array] = {}
        special = self._sample_plain_rows(rows, ks, logits, verdicts, special, masks)
        if special:
            rows_out = []
            for i in special:
                q = drafts[i].q if drafts[i] is not None and ks[i] else None
                verdict, report = self._row_verdict(rows[i], logits[i, :ks[i] + 1], proposed[i, :ks[i]],
                                                    q, rows[i].context(masks.get(i)))
                rows_out.append(verdict)
                if report is not None:
                    reports[i] = report
            verdicts[mx.array(special)] = mx.stack(rows_out)
        return verdicts, reports

    @staticmethod
    def _sample_plain_rows(rows: list[Sequence], ks: list[int], logits: mx.array, verdicts: mx.array,
                           special: list[int], masks: dict) -> list[int]:
        """Rows that sample with nothing but temperature and filters and draft nothing this step
        are drawn together, per shared params (sampling.sample_plain_rows); -> the rest."""
        groups: dict[SamplingParams, list[int]] = {}
        for i in special:
            seq = rows[i]
            if (not ks[i] and not seq.params.is_greedy and not seq.params.has_processing
                    and i not in masks and seq.request.logprobs is None):
                groups.setdefault(seq.params.without_seed(), []).append(i)
        for params, members in groups.items():
            tokens = sample_plain_rows(logits[mx.array(members), 0], params, [rows[i].rng.next() for i in members])
            verdicts[mx.array(members)] = mx.stack([mx.zeros_like(tokens), tokens], axis=1)
        grouped = {i for members in groups.values() for i in members}
        return [i for i in special if i not in grouped]

    @staticmethod
    def _row_verdict(seq: Sequence, logits: mx.array, proposed: mx.array, q,
                     ctx: RowContext) -> tuple[mx.array, mx.array | None]:
        """(verdict [2], the logprob report or None) for one row, lazily."""
        if seq.params.is_greedy:
            verdict, processed = verify_greedy(logits, proposed, ctx)
            logp = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
        else:
            verdict, logp = verify_sampling(logits, proposed, None if q is None else q[:proposed.shape[0]],
                                            ctx, seq.rng)
        top = seq.request.logprobs
        return verdict, (None if top is None else committed_logprobs(logp, proposed, verdict, top))

    def _commit(self, seq: Sequence, new: list[int], logprobs: list | None) -> None:
        """A grammar the output left (a bug) fails its request, not the batch."""
        try:
            seq.commit(new, logprobs)
        except GrammarError as err:
            logger.error("request %d: %s", seq.request.id, err)
            self._fail(seq, err)
            seq.stats.finish_reason = "stop"

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
                self._drop_proposer(seq)
            self.spec_faults.record(source, exc)
            return None

    def _drop_proposer(self, seq: Sequence) -> None:
        """This row decodes plainly from now on; its group forgets it."""
        group, seq.proposer = seq.proposer, None
        seq.row.k_max = 0
        if group is not None:
            try:
                group.leave(seq.request.id)
            except Exception:  # the group's own state is suspect: the next fault drops it
                logger.debug("leaving group %s", group.method, exc_info=True)

    def _plan(self, rows: list[Sequence]) -> list[int]:
        ks = self._guard(None, "plan", self.planner.plan, [s.row for s in rows])
        if ks is None or len(ks) != len(rows):
            return [0] * len(rows)
        return [min(max(0, int(k)), seq.room(self.max_context)) if seq.proposer is not None else 0
                for k, seq in zip(ks, rows)]

    def _observe_row(self, seq: Sequence, drafted: int, accepted: int, emitted: int, hidden) -> None:
        seq.stats.spec.observe_step(drafted, accepted, emitted)
        self._spec_totals(seq.method).observe_step(drafted, accepted, emitted)
        if seq.proposer is not None and seq.proposer.needs_hidden:
            seq.states.append(hidden)
            if len(seq.states) > 16:  # each is a view holding its whole step's [B, W, H] alive
                seq.states = [mx.concatenate(seq.states)]
            self._guard(seq, "proposer_observe", seq.proposer.observe, seq.request.id, hidden)
        self._guard(None, "controller", self._observe_controller, seq.row, drafted, accepted)

    def _observe_controller(self, row: RowController, drafted: int, accepted: int) -> None:
        if row.k_max == 0:  # plain decoding: nothing to decide
            return
        row.observe(drafted, accepted, not row.adaptive or self.planner.pays_alone(row))
        if row.num_probes:
            self.probe_intervals[row.method] = row.probe_interval
        if drafted:
            self.priors.setdefault(row.method, AcceptancePrior()).observe(drafted, accepted)

    # ---- proposers: one group per method, holding every running row of that method ---------
    def _group(self, method: str) -> ProposerGroup:
        if method not in self.groups:
            self.groups[method] = self.runtime.make_group(method, self.vocab_size)
        return self.groups[method]

    def _retain_group_rows(self, rows: list[Sequence]) -> None:
        """Rows that left the batch (finished, cancelled, failed) leave their group."""
        for method, group in list(self.groups.items()):
            live = {s.request.id for s in rows if s.proposer is group}
            for key in group.keys:
                if key not in live:
                    self._guard_group(method, "proposer_observe", group.leave, key)

    def _propose(self, rows: list[Sequence], ks: list[int]) -> list[Drafts | None]:
        """Each group drafts for all of its rows; a fault costs that group's rows their drafts."""
        out: list[Drafts | None] = [None] * len(rows)
        for method, group in list(self.groups.items()):
            members = [(i, s) for i, s in enumerate(rows) if s.proposer is group]
            if not any(ks[i] for i, _ in members):
                continue
            t0 = time.perf_counter()
            chain = [ChainRow(s.request.id, self._draft_context(s, ks[i]), ks[i], s.rng) for i, s in members]
            drafts = self._guard_group(method, "propose", self._checked_drafts, group, chain)
            if drafts is None:
                continue
            if not isinstance(group, ChainGroup):  # host proposers are timed here
                self._guard(None, "cost_model", self.planner.observe_proposer, method,
                            max(ks[i] for i, _ in members), time.perf_counter() - t0)
            for i, s in members:
                out[i] = drafts.get(s.request.id)
        return out

    @staticmethod
    def _draft_context(seq: Sequence, k: int) -> RowContext:
        """A grammar's mask is known on the host for the first draft only (the later positions
        depend on lazy drafts): the proposer drafts that one inside the grammar."""
        if seq.constraint is None or not k:
            return seq.context()
        return seq.context(seq.constraint.masks([])[0])

    def _checked_drafts(self, group: ProposerGroup, chain: list[ChainRow]) -> dict[int, Drafts]:
        drafts = group.propose(chain)
        for d in drafts.values():
            if isinstance(d.tokens, list) and any(t < 0 or t >= self.vocab_size for t in d.tokens):
                raise ValueError(f"proposed token id out of range [0, {self.vocab_size})")
        return drafts

    def _settle_groups(self, accepted: dict[int, int]) -> None:
        for method, group in list(self.groups.items()):
            self._guard_group(method, "proposer_observe", group.settle, accepted)

    def _group_arrays(self) -> list:
        return [a for group in self.groups.values() for a in group.cache_arrays()]

    def _guard_group(self, method: str, source: str, fn, *args):
        """A group's fault: its state is unknown, so every row it held decodes plainly from now
        on (new requests get a fresh group); counted and logged once like any fault."""
        try:
            faults.check(source)
            return fn(*args)
        except Exception as exc:
            group = self.groups.pop(method, None)
            for seq in [*self.scheduler.running, *self.scheduler.prefilling]:
                if group is not None and seq.proposer is group:
                    seq.proposer = None
                    seq.row.k_max = 0
            self.spec_faults.record(f"proposer:{method}", exc)
            return None

    # ---- ends ----------------------------------------------------------------------------
    def _close(self, seq: Sequence, reason: str | None = None) -> None:
        seq.finish(reason)
        self._release_kv(seq)
        key = "cancelled" if seq.stats.finish_reason == "cancelled" else "completed"  # "stop" completes
        self.totals[key] += 1
        if seq.proposer is not None:
            self._guard_group(seq.method, "proposer_observe", seq.proposer.leave, seq.request.id)
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
        self.groups.clear()  # every row is gone; fresh groups for the next requests
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
        # The largest batch too: on a CPU a wide batch leaves the bandwidth-bound regime.
        for rows in sorted({1, min(4, self.max_batch), self.max_batch}):
            for window in (1, k_max + 1):
                # The first run of a shape pays one-off costs.
                for seconds in self.runner.time_forward(rows, window, 3)[1:]:
                    self.planner.forward.observe(rows, window, seconds)
        for method in {self.runtime.method} & {"draft", "mtp"}:
            self._guard_group(method, "cost_model", self._calibrate_chain, method, k_max)
        costs = self.planner.as_dict()
        logger.info("calibrated step costs (ms): target %s, draft chain %s", costs["forward_ms"],
                    costs["draft_chain_step_ms"])

    def _calibrate_chain(self, method: str, k_max: int) -> None:
        """Seconds per chain step of `method`'s proposer at one row and at four (scratch rows)."""
        width = self.view.inner.norm.weight.shape[0]
        seconds = {}
        for count in (1, 4):
            group = self.runtime.make_group(method, self.vocab_size)
            committed = list(range(1, 18))
            hidden = mx.zeros((16, width)) if group.needs_hidden else None
            for key in range(count):
                group.join(key, committed, hidden)
            times = []
            for _ in range(3):
                rows = [ChainRow(key, RowContext(SamplingParams(), committed), k_max, Rng(0))
                        for key in range(count)]
                for key in range(count):
                    group.observe(key, mx.zeros((1, width)))
                t0 = time.perf_counter()
                drafts = group.propose(rows)
                mx.eval([d.tokens for d in drafts.values()], group.cache_arrays())
                times.append((time.perf_counter() - t0) / k_max)
                group.settle({})
                committed = committed + [1]
            seconds[count] = min(times[1:])
        self.planner.calibrate_proposer(method, seconds[1], 4, seconds[4])

    def remembered_priors(self, path) -> Callable[[], None]:
        """Load the acceptance priors saved at `path` for this model pair; -> a function that
        saves them back (call it when done)."""
        from ..spec import priors

        spec = self.runtime.profile.speculative
        keys = {m: priors.pair_key(m, self.runtime.target.path, spec.draft_model)
                for m in ("draft", "mtp", "ngram")}
        self.priors.update({m: AcceptancePrior(a) for m, a in priors.load(path, keys).items()})
        return lambda: priors.save(path, keys, {m: p.alphas for m, p in self.priors.items()})

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
            "host_syncs": self.host_syncs,
            "time_ms": {k: round(v * 1e3, 1) for k, v in self.time_s.items()},
            "host_syncs_per_step": round(self.host_syncs / max(1, self.totals["steps"]), 3),
            "acceptance_priors": {m: [round(a, 3) for a in p.alphas] for m, p in self.priors.items()},
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


def _draft_length(drafts: Drafts) -> int:
    return len(drafts.tokens) if isinstance(drafts.tokens, list) else drafts.tokens.shape[0]


def _logprob_entries(report: mx.array | None, count: int, top: int | None) -> list | None:
    """A row's evaluated logprob report -> Tokens.logprobs for its first `count` positions."""
    if report is None:
        return None
    out = []
    for row in report[:count].tolist():
        ids, values = row[1:1 + top], row[1 + top:]
        out.append((row[0], [(int(t), v) for t, v in zip(ids, values)]))
    return out
