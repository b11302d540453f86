"""StepPlan: the ops rank 0 sends the workers, as one flat int32 buffer.

Layout: header [MAGIC, VERSION, sequence, num_ops, body_length], then per op
[code, payload_length, *payload]. An op's payload is its int arguments followed by its one
optional trailing list. Ops that run the model ("forward" ops) close a plan: the cheap ops
before them (row advances, removals, prefix stores) ride along in the same collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MacspecError

MAGIC = 0x6D737063  # "mspc"
VERSION = 1
HEADER = 5


class PlanError(MacspecError):
    """A plan that does not decode: the ranks are out of lock-step."""


@dataclass(frozen=True)
class Op:
    code: int
    name: str  # the TargetRunner method every rank calls
    scalars: int  # leading int arguments
    has_list: bool  # one trailing list[int] argument
    forward: bool  # runs the model: every rank's collectives take part


OPS = [
    Op(1, "open_slot", 3, False, False),
    Op(2, "prefill", 1, True, True),
    Op(3, "slot_to_row", 2, False, False),
    Op(4, "close_slot", 3, False, False),
    Op(5, "decode", 2, True, True),
    Op(6, "advance", 0, True, False),
    Op(7, "remove_row", 3, False, False),
    Op(8, "drop_prefixes", 0, True, False),
    Op(9, "reset", 0, False, False),
    Op(10, "time_forward", 3, False, True),
    Op(11, "heartbeat", 0, False, True),
    Op(12, "shutdown", 0, False, True),
    Op(13, "check_hidden", 0, False, True),
    Op(14, "share_slot_prefix", 3, False, False),
    Op(15, "persist_prefix", 1, True, False),
    Op(16, "load_prefix", 1, True, True),  # every rank reads its file, then all agree (a collective)
]
BY_NAME = {op.name: op for op in OPS}
BY_CODE = {op.code: op for op in OPS}


def encode_op(name: str, args: tuple) -> list[int]:
    op = BY_NAME[name]
    scalars = [int(a) for a in args[:op.scalars]]
    tail = [int(t) for t in args[op.scalars]] if op.has_list else []
    if len(args) != op.scalars + op.has_list:
        raise PlanError(f"op {name} takes {op.scalars + op.has_list} arguments, got {len(args)}")
    return [op.code, len(scalars) + len(tail), *scalars, *tail]


def encode_plan(sequence: int, ops: list[list[int]]) -> list[int]:
    body = [value for op in ops for value in op]
    return [MAGIC, VERSION, sequence, len(ops), len(body), *body]


def decode_header(header: list[int], expected_sequence: int) -> tuple[int, int]:
    """-> (num_ops, body_length); refuses anything but the next plan of this version."""
    magic, version, sequence, num_ops, body_length = header[:HEADER]
    if magic != MAGIC or version != VERSION:
        raise PlanError(f"bad step plan header (magic {magic:#x}, version {version}); "
                        "are all ranks running the same macspec?")
    if sequence != expected_sequence:
        raise PlanError(f"step plan {sequence} arrived, expected {expected_sequence}: "
                        "the ranks are out of lock-step")
    return num_ops, body_length


def decode_ops(body: list[int], num_ops: int) -> list[tuple[Op, tuple]]:
    out, at = [], 0
    for _ in range(num_ops):
        code, length = body[at], body[at + 1]
        op = BY_CODE.get(code)
        if op is None:
            raise PlanError(f"unknown op code {code} in a step plan")
        payload = body[at + 2:at + 2 + length]
        args = tuple(payload[:op.scalars]) + ((payload[op.scalars:],) if op.has_list else ())
        out.append((op, args))
        at += 2 + length
    if at != len(body):
        raise PlanError("step plan body length does not match its ops")
    return out
