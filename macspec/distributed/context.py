"""Rank 0's tensor-parallel session: group, peers, plan channel; opened before models load."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..config import Profile
from ..progress import phase
from .bootstrap import BootstrapError, Peers, check_backend_here, group_spec, join_with_peers
from .channel import PlanChannel
from .handshake import PeerLeftError, handshake, identity
from .plan import encode_op

logger = logging.getLogger(__name__)


def preflight(profile: Profile) -> None:
    """What rank 0 can tell before starting any peer, all of it at once: models that are not on
    this machine (each rank would download them) and a backend this OS cannot run."""
    from ..models.loader import find_local_model, source_of

    wanted = profile.models()
    problems = [f"the {role} model {ref!r} is not on this machine (on every host: hf download {ref})"
                for role, ref in wanted.items() if not source_of(ref).made_here and find_local_model(ref) is None]
    try:
        check_backend_here(profile.parallel)
    except BootstrapError as err:
        problems.append(str(err))
    if problems:
        raise BootstrapError(f"profile {profile.source}: " + "; ".join(problems))


@dataclass
class TPContext:
    group: object
    peers: Peers
    channel: PlanChannel
    step_timeout_s: float
    closed: bool = False

    @classmethod
    def open(cls, profile: Profile) -> "TPContext":
        preflight(profile)
        try:
            spec = group_spec(profile.parallel)
        except BootstrapError as err:
            raise BootstrapError(f"profile {profile.source}: {err}") from None
        peers = Peers.launch(profile, spec)
        try:
            with phase(f"forming the tensor-parallel group ({spec['world']} ranks, {spec['backend']})"):
                group = join_with_peers(spec, peers, profile.parallel.join_timeout_s)
                handshake(group, identity(profile))
        except PeerLeftError as err:
            peers.shutdown(timeout=5)
            exited = peers.first_exited_after_stop()
            raise PeerLeftError(f"{err}{'; ' + exited if exited else ''}") from None
        except BaseException:
            peers.kill()  # they cannot be told to leave before the group works
            raise
        logger.info("tensor-parallel group of %d ready (%s)", group.size(), spec["backend"])
        return cls(group, peers, PlanChannel(group), profile.parallel.step_timeout_s)

    @property
    def size(self) -> int:
        return self.group.size()

    def status(self) -> dict:
        return {"ranks": self.size, "plans": self.channel.sequence, "plan_collectives": self.channel.collectives,
                "step_timeout_s": self.step_timeout_s, "worker_pids": self.peers.pids}

    def send_op(self, name: str, *args) -> None:
        """A plan of one op, outside the engine (start-up checks, shutdown)."""
        self.channel.send([encode_op(name, args)])

    def close(self, clean: bool = True) -> None:
        """Tell the workers to leave (when the channel still works), then reap them."""
        if self.closed:
            return
        self.closed = True
        if not clean:  # interrupted, or a peer is gone: nobody waits for a goodbye
            self.peers.kill()
            return
        try:
            self.send_op("shutdown")
        except Exception as err:  # a dead peer: reaping below still ends the others
            logger.warning("could not send shutdown to the peers: %s", err)
        self.peers.shutdown(timeout=10)
