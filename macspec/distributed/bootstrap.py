"""Start a tensor-parallel group from a profile: the group description, the peer processes
(local for this machine's hosts, ssh for the others), and joining mx.distributed.

Rank 0 is the process the user started (`macspec serve` / `run`); it launches ranks 1..n-1
with `python -m macspec tp-worker` and passes the group description in MACSPEC_TP_GROUP.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..childproc import macspec_argv
from ..config import ParallelConfig, Profile
from ..errors import MacspecError

logger = logging.getLogger(__name__)

GROUP_ENV = "MACSPEC_TP_GROUP"
LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}
KEEP_LOG_DIRS = 10  # tensor-parallel sessions whose worker logs stay in the state dir
GUARD_SCRIPT = Path(__file__).with_name("join_guard.py")


def joining_marker(rank: int) -> str:
    """What a worker prints (into the log rank 0 keeps) right before it enters init."""
    return f"macspec-tp: rank {rank} joining the group"


class BootstrapError(MacspecError):
    """The group could not be formed (peer failed to start, backend init failed)."""


def is_local(host: str) -> bool:
    return host in LOCAL_NAMES | {socket.gethostname(), socket.getfqdn()}


def host_of(par: ParallelConfig, rank: int) -> str:
    return par.hosts[rank] if len(par.hosts) > 1 else par.hosts[0]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _address_of(host: str, par: ParallelConfig) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as err:  # gaierror: the name does not resolve from here
        raise BootstrapError(f"parallel.hosts: {host!r} does not resolve from this machine ({err}); "
                             f"hosts = {par.hosts}. Use a name or address every rank can reach, "
                             "or 127.0.0.1 for ranks on this machine") from None


def group_spec(par: ParallelConfig) -> dict:
    """The JSON-able description every rank joins from (hostfile / RDMA devices)."""
    world = par.tensor_parallel
    hosts = [host_of(par, r) for r in range(world)]
    if par.backend == "ring":
        if all(is_local(h) for h in hosts):
            addresses = [f"127.0.0.1:{p}" for p in _free_ports(world)]
        else:
            addresses = [f"{_address_of(h, par)}:{par.port + r}" for r, h in enumerate(hosts)]
        return {"backend": "ring", "world": world, "hostfile": [[a] for a in addresses]}
    if par.backend == "jaccl":
        if not par.ibv_devices or not par.coordinator:
            raise BootstrapError("parallel.backend = 'jaccl' needs parallel.ibv_devices and "
                                 "parallel.coordinator in the profile (see `macspec doctor --peers`)")
        return {"backend": "jaccl", "world": world, "devices": par.ibv_devices,
                "coordinator": par.coordinator}
    raise BootstrapError(f"parallel.backend = {par.backend!r} cannot form a group of {world}")


def check_backend_here(par: ParallelConfig) -> None:
    """Before anything starts: JACCL exists only on macOS (MLX builds it there alone)."""
    if par.backend == "jaccl" and sys.platform != "darwin":
        raise BootstrapError(f"parallel.backend = 'jaccl' (RDMA over Thunderbolt 5) needs macOS 26.2 "
                             f"or later; this is {sys.platform}. To try the profile here, set "
                             "parallel.backend = \"ring\" (TCP) in a copy of it")


def share_cores(spec: dict, rank: int) -> None:
    """Ranks on one machine split its cores (OpenBLAS threads spin; oversubscribed, a TP2
    forward on 2 cores ran 4x slower)."""
    from ..blas import default_threads, set_threads

    if spec["backend"] != "ring":
        return
    hosts = [entry[0].rsplit(":", 1)[0] for entry in spec["hostfile"]]
    mine = hosts.count(hosts[rank])
    if mine > 1:
        set_threads(default_threads(ranks_here=mine))


def join_group(spec: dict, rank: int):
    """mx.distributed.init for this rank from `spec` (writes the files MLX reads)."""
    import mlx.core as mx

    share_cores(spec, rank)
    os.environ["MLX_RANK"] = str(rank)
    with tempfile.TemporaryDirectory(prefix="macspec-tp-") as tmp:  # MLX reads them in init
        folder = Path(tmp)
        if spec["backend"] == "ring":
            (folder / "hosts.json").write_text(json.dumps(spec["hostfile"]))
            os.environ["MLX_HOSTFILE"] = str(folder / "hosts.json")
        else:
            (folder / "devices.json").write_text(json.dumps(spec["devices"]))
            os.environ["MLX_IBV_DEVICES"] = str(folder / "devices.json")
            os.environ["MLX_JACCL_COORDINATOR"] = spec["coordinator"]
        try:
            group = mx.distributed.init(backend=spec["backend"], strict=True)
        except (RuntimeError, ValueError) as err:
            hint = ""
            if spec["backend"] == "jaccl":
                hint = ("; JACCL needs macOS 26.2+ with RDMA enabled (`macspec doctor --peers`), or set "
                        "parallel.backend = \"ring\"")
            raise BootstrapError(f"rank {rank}: mx.distributed.init({spec['backend']!r}) failed: "
                                 f"{err}{hint}") from None
    if group.size() != spec["world"] or group.rank() != rank:
        raise BootstrapError(f"joined a group of {group.size()} as rank {group.rank()}; expected "
                             f"{spec['world']} ranks with this one as rank {rank}")
    return group


class Peers:
    """The worker processes rank 0 started; their exit is noticed within a watchdog poll."""

    def __init__(self):
        from ..paths import fresh_subdir, state_dir

        self.procs: list[tuple[int, str, subprocess.Popen, Path]] = []
        self.stopping = False
        self.reported: set[int] = set()  # ranks whose exit is already in the server log
        session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
        self.log_dir = fresh_subdir(state_dir() / "tp-logs", session, KEEP_LOG_DIRS)

    @classmethod
    def launch(cls, profile: Profile, spec: dict) -> "Peers":
        peers = cls()
        for rank in range(1, spec["world"]):
            peers._start(profile, spec, rank)
        return peers

    def _start(self, profile: Profile, spec: dict, rank: int) -> None:
        par = profile.parallel
        host = host_of(par, rank)
        log = self.log_dir / f"rank{rank}.log"
        group_json = json.dumps(spec)
        if is_local(host):
            argv = macspec_argv("tp-worker", "--profile", profile.source or profile.name,
                                "--rank", str(rank))
            env = {**os.environ, GROUP_ENV: group_json}
        else:
            argv = ssh_command(par, host, profile.name, rank, group_json)
            env = dict(os.environ)
        logger.info("starting rank %d on %s (log %s)", rank, host, log)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((rank, host, proc, log))

    def first_exited(self) -> str | None:
        """The first worker that exited, in words fit for clients (they see it in their error);
        its host, log file and last lines go to the server log only, once."""
        if self.stopping:
            return None
        for rank, host, proc, log in self.procs:
            code = proc.poll()
            if code is not None:
                if rank not in self.reported:  # the watchdog and the engine thread both ask
                    self.reported.add(rank)
                    logger.error("rank %d on %s exited with code %d (log %s)%s", rank, host, code, log,
                                 log_tail(log))
                return f"rank {rank} stopped (exit code {code})"
        return None

    def first_exited_after_stop(self) -> str | None:
        """After shutdown: the first peer that had failed on its own (non-zero exit, log tail)."""
        for rank, host, proc, log in self.procs:
            if proc.returncode not in (None, 0, -15, -9):
                return f"rank {rank} on {host} exited with code {proc.returncode}{log_tail(log)}"
        return None

    def kill(self, grace: float = 1.0) -> None:
        """Start-up failed or was interrupted: the peers cannot be told to leave; end them."""
        self.stopping = True
        for _, _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
        deadline = time.monotonic() + grace
        for _, _, proc, _ in self.procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def wait_until_joining(self, deadline: float, where: str) -> None:
        """Until every peer says it is entering init: one that exits first, or the deadline,
        is an error naming it (Python waits here, so Ctrl-C works)."""
        pending = {rank for rank, _, _, _ in self.procs}
        while pending:
            for rank, host, proc, log in self.procs:
                if rank not in pending:
                    continue
                code = proc.poll()
                if code is not None:
                    raise BootstrapError(f"rank {rank} on {host} exited with code {code} before joining "
                                         f"the group{log_tail(log)}")
                try:
                    if joining_marker(rank) in log.read_text(errors="replace"):
                        pending.discard(rank)
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                rank, host, proc, log = next(p for p in self.procs if p[0] in pending)
                raise BootstrapError(f"rank {rank} on {host} (pid {proc.pid}) did not start joining the "
                                     f"group in time (check {where}){log_tail(log)}")
            time.sleep(0.05)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Wait for workers told to stop; terminate, then kill, the ones that do not."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for _, _, proc, _ in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill(grace=5.0)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for _, _, proc, _ in self.procs]


def ssh_command(par: ParallelConfig, host: str, profile_name: str, rank: int, group_json: str) -> list[str]:
    target = f"{par.ssh_user}@{host}" if par.ssh_user else host
    remote = (f"{GROUP_ENV}={shlex.quote(group_json)} exec {par.python} -m macspec tp-worker "
              f"--profile {shlex.quote(profile_name)} --rank {rank}")
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", target, remote]


def log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (": " + " | ".join(line.strip() for line in text)) if text else ""


def join_with_peers(spec: dict, peers: Peers, timeout: float):
    """Rank 0 joins once every peer is about to; a peer that dies, a deadline, or Ctrl-C at any
    moment ends start-up with an error naming the peer (its exit code and log tail)."""
    deadline = time.monotonic() + timeout
    where = ", ".join(a[0] for a in spec["hostfile"]) if spec["backend"] == "ring" else spec["coordinator"]
    peers.wait_until_joining(deadline, where)
    config = {"parent": os.getpid(), "timeout": max(1.0, deadline - time.monotonic()), "where": where,
              "peers": [[rank, host, proc.pid, str(log)] for rank, host, proc, log in peers.procs]}
    guard = subprocess.Popen([sys.executable, "-I", str(GUARD_SCRIPT), json.dumps(config)],
                             stdin=subprocess.PIPE)
    try:
        return join_group(spec, 0)
    finally:
        try:
            guard.stdin.write(b"done")
            guard.stdin.close()
        except OSError:
            pass
        guard.wait()
