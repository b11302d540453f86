"""Rank 0 -> workers: step plans broadcast as an all_sum (rank 0 adds the plan, workers zeros).

A plan fits one fixed-size collective (PLAN_INTS int32) unless it carries a long prefill
chunk; then a second collective, sized by the header, carries the rest.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..errors import MacspecError
from .plan import HEADER, decode_header, decode_ops, encode_op, encode_plan, BY_NAME

logger = logging.getLogger(__name__)

PLAN_INTS = 4096  # one collective costs the same up to ~16 KB over the ring


class PeerLostError(MacspecError):
    """A collective failed: a peer died or the link dropped."""


def _all_sum(values: np.ndarray, group) -> np.ndarray:
    try:
        out = mx.distributed.all_sum(mx.array(values), group=group, stream=mx.cpu)
        mx.eval(out)
    except RuntimeError as err:
        raise PeerLostError(f"tensor-parallel peer lost: {err}") from None
    return np.array(out)


class PlanChannel:
    def __init__(self, group):
        self.group = group
        self.sequence = 0
        self.last_sent = time.monotonic()
        self.collectives = 0  # plan collectives so far (bench: collectives per step)

    # ---- rank 0 ----------------------------------------------------------------------
    def send(self, ops: list[list[int]]) -> None:
        plan = encode_plan(self.sequence, ops)
        first = np.zeros(PLAN_INTS, dtype=np.int32)
        head = plan[:PLAN_INTS]
        first[:len(head)] = head
        self._collect(first)
        if len(plan) > PLAN_INTS:
            self._collect(np.array(plan[PLAN_INTS:], dtype=np.int32))
        self.sequence += 1
        self.last_sent = time.monotonic()

    # ---- workers ---------------------------------------------------------------------
    def receive(self) -> list:
        first = self._collect(np.zeros(PLAN_INTS, dtype=np.int32)).tolist()
        num_ops, body_length = decode_header(first, self.sequence)
        total = HEADER + body_length
        plan = first[:min(total, PLAN_INTS)]
        if total > PLAN_INTS:
            plan += self._collect(np.zeros(total - PLAN_INTS, dtype=np.int32)).tolist()
        self.sequence += 1
        return decode_ops(plan[HEADER:], num_ops)

    def _collect(self, values: np.ndarray) -> np.ndarray:
        self.collectives += 1
        return _all_sum(values, self.group)


class MirroredRunner:
    """Rank 0's handle on its TargetRunner: every op is recorded for the workers, then applied
    here. Cheap ops wait in `pending` and ride with the next forward op's plan."""

    def __init__(self, state, channel: PlanChannel, watchdog=None):
        self.state = state
        self.channel = channel
        self.watchdog = watchdog
        self.pending: list[list[int]] = []

    def __getattr__(self, name: str):
        op = BY_NAME.get(name)
        if op is None:  # reads such as kv, slot_nbytes: local and identical on every rank
            return getattr(self.state, name)

        def call(*args):
            self.pending.append(encode_op(name, args))
            if not op.forward:
                return getattr(self.state, name)(*args)
            with self._deadline(name):
                ops, self.pending = self.pending, []
                self.channel.send(ops)
                return getattr(self.state, name)(*args)

        return call

    needs_host_tokens = True  # the peers get the window as ints in the plan

    def forward(self, tokens, host_tokens: list[list[int]]):
        rows, window = tokens.shape
        return self.decode(rows, window, [t for row in host_tokens for t in row])

    def idle(self, heartbeat_s: float) -> None:
        """While nothing runs: flush what is pending and prove the peers alive."""
        if self.pending or time.monotonic() - self.channel.last_sent >= heartbeat_s:
            self.heartbeat()

    def _deadline(self, label: str):
        return self.watchdog.step(label) if self.watchdog else nullcontext()
