"""Ranks 1..n-1: load the target's shard, then replay rank 0's step plans until shutdown.

Workers decide nothing: no sampling, no acceptance, no stop conditions, so whatever k or
batch rank 0 chooses, every rank runs the identical forward.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from ..config import load_profile
from ..kv.disk import open_store
from .runner import TargetRunner
from ..models import cpu_prefill, expert_union, row_padding
from ..models.loader import load_model
from ..models.view import ModelView
from ..distributed.bootstrap import GROUP_ENV, BootstrapError, join_group, joining_marker
from ..distributed.channel import PlanChannel
from ..distributed.handshake import handshake, identity

logger = logging.getLogger(__name__)

IDLE_GRACE_S = 10.0  # beyond the step deadline: rank 0 heartbeats every second while idle


def worker_main(profile_ref: str, rank: int) -> None:
    if GROUP_ENV not in os.environ:
        raise BootstrapError(f"tp-worker is started by rank 0 (`macspec serve`/`run` with a "
                             f"tensor_parallel profile); {GROUP_ENV} is not set")
    spec = json.loads(os.environ[GROUP_ENV])
    profile = load_profile(profile_ref)  # before joining: a bad profile fails rank 0's start fast
    print(joining_marker(rank), flush=True)  # rank 0 waits for this line in our log
    group = join_group(spec, rank)
    handshake(group, identity(profile))
    m = profile.model
    cpu_prefill.enable(m.cpu_prefill)  # every rank prefills as rank 0 does
    expert_union.enable(m.expert_union)  # and groups a step's experts as it does
    row_padding.enable(m.cpu_row_padding)  # and pads its products' rows as it does
    target = load_model(m.path, m.dtype, m.revision, m.trust_remote_code, group=group)
    row_padding.route(target.model)
    logger.info("rank %d: shard of %s loaded", rank, target.path)
    disk = open_store(profile.kv, target.path, m.dtype, rank, group.size())
    serve_plans(TargetRunner(ModelView(target.model), group, disk), PlanChannel(group),
                profile.parallel.step_timeout_s + IDLE_GRACE_S)


def serve_plans(state: TargetRunner, channel: PlanChannel, idle_limit_s: float) -> None:
    last_plan = [None]  # monotonic time of the last plan; None until the first one
    threading.Thread(target=_exit_when_orphaned, args=(last_plan, idle_limit_s),
                     name="macspec-tp-idle", daemon=True).start()
    while True:
        for op, args in channel.receive():
            last_plan[0] = time.monotonic()
            if op.name == "shutdown":
                logger.info("rank 0 ended the session")
                return
            getattr(state, op.name)(*args)


def _exit_when_orphaned(last_plan: list, idle_limit_s: float) -> None:
    """Rank 0 sends a plan or heartbeat at least every second once serving; silence this long
    means it is stuck or gone without closing the link, so leave rather than hang forever."""
    while True:
        time.sleep(1.0)
        if last_plan[0] is not None and time.monotonic() - last_plan[0] > idle_limit_s:
            logger.error("no step plan from rank 0 for %.0f s; exiting", idle_limit_s)
            os._exit(3)
