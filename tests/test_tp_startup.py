"""Tensor-parallel start-up never hangs: a peer that exits or never connects, at any moment
before the group works, ends rank 0 with an error naming the peer; Ctrl-C ends every rank;
no process is left. And child processes never import a `macspec/` folder from the cwd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from macspec.config import find_profile

from .serverutil import has_ended

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

JOIN_TIMEOUT_S = 8.0


def _profile(tmp_path: Path, **parallel) -> str:
    text = find_profile("tiny-tp2").read_text()
    for key, value in {"join_timeout_s": JOIN_TIMEOUT_S, **parallel}.items():
        text = text.replace("[parallel]\n", f"[parallel]\n{key} = {json.dumps(value)}\n")
    path = tmp_path / "tp-startup.toml"
    path.write_text(text)
    return str(path)


class Rank0:
    """`macspec serve` as rank 0 in its own process group (so a Ctrl-C can reach the group)."""

    def __init__(self, tmp_path: Path, profile: str, cwd: Path | None = None):
        self.home = tmp_path / "home"
        self.log = tmp_path / "rank0.log"
        env = {**os.environ, "MACSPEC_HOME": str(self.home)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "macspec", "serve", "--profile", profile,
                                          "--port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=cwd)
        self.started = time.monotonic()

    def first_worker(self, timeout: float = 20.0) -> psutil.Process:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if "tp-worker" in " ".join(child.cmdline()):
                        return child
                except psutil.Error:
                    continue
            time.sleep(0.005)
        raise AssertionError(f"no worker started: {self.log.read_text()[-2000:]}")

    def wait_worker_joining(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for log in (self.home / "state" / "tp-logs").glob("*/rank1.log"):
                if "joining the group" in log.read_text(errors="replace"):
                    return
            time.sleep(0.005)
        raise AssertionError("the worker never reached init")

    def tree(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _assert_gone(procs: list[psutil.Process], timeout: float = 5.0) -> None:
    alive = [p for p in psutil.wait_procs(procs, timeout=timeout)[1] if not has_ended(p)]
    for proc in alive:
        proc.kill()
    assert not alive, f"left running: {alive}"


def test_worker_that_exits_at_startup_is_named_with_its_code(tmp_path):
    rank0 = Rank0(tmp_path, _profile(tmp_path))
    worker = rank0.first_worker()
    tree = rank0.tree()
    worker.kill()  # dies before it could join (as an ImportError would)
    code = rank0.wait(30)
    out = rank0.output()
    assert code != 0 and time.monotonic() - rank0.started < 30
    assert "rank 1 on 127.0.0.1" in out and "exited with code -9" in out, out[-2000:]
    assert "Traceback" not in out
    _assert_gone(tree)


def test_worker_that_hangs_before_init_times_out_naming_it(tmp_path):
    rank0 = Rank0(tmp_path, _profile(tmp_path))
    worker = rank0.first_worker()
    tree = rank0.tree()
    worker.suspend()  # alive, never connects
    try:
        code = rank0.wait(JOIN_TIMEOUT_S + 15)
        out = rank0.output()
        assert code != 0
        assert "rank 1 on 127.0.0.1" in out and "did not start joining" in out, out[-2000:]
        _assert_gone(tree)
    finally:
        for proc in tree:
            if proc.is_running():
                proc.kill()


def test_worker_killed_inside_init_is_named_and_nothing_is_left(tmp_path):
    rank0 = Rank0(tmp_path, _profile(tmp_path))
    worker = rank0.first_worker()
    tree = rank0.tree()
    rank0.wait_worker_joining()
    time.sleep(0.3)  # rank 0 is inside mx.distributed.init (or about to be)
    worker.kill()
    code = rank0.wait(30)
    out = rank0.output()
    assert code != 0 and time.monotonic() - rank0.started < 40
    assert "rank 1 on 127.0.0.1" in out and "exited with code" in out, out[-2000:]
    _assert_gone(tree)


def test_ctrl_c_while_waiting_for_a_peer_ends_every_rank_within_2s(tmp_path):
    rank0 = Rank0(tmp_path, _profile(tmp_path, join_timeout_s=120))
    worker = rank0.first_worker()
    rank0.wait_worker_joining()
    tree = rank0.tree()
    worker.suspend()  # rank 0 may now sit in init, holding the GIL
    time.sleep(1.0)
    os.killpg(rank0.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    t0 = time.monotonic()
    try:
        rank0.wait(5)
        _assert_gone(tree, timeout=max(0.1, 2.0 - (time.monotonic() - t0)))
        assert time.monotonic() - t0 < 2.5
    finally:
        for proc in tree:
            if proc.is_running():
                proc.kill()


def test_children_ignore_a_macspec_folder_in_the_cwd(tmp_path):
    """A clone's `macspec/` in the working directory must not shadow the package for the TP
    worker (this start-up used to fail or hang)."""
    shadow = tmp_path / "cwd" / "macspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the cwd shadowed the package')\n")
    profile = _profile(tmp_path)
    home = tmp_path / "home"
    env = {**os.environ, "MACSPEC_HOME": str(home)}
    proc = subprocess.run([sys.executable, "-P", "-m", "macspec", "run", "def f(x):", "--profile", profile,
                           "--max-tokens", "4", "--json"], cwd=tmp_path / "cwd", env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["generated_tokens"] >= 1
    logs = list((home / "state" / "tp-logs").glob("*/rank1.log"))
    assert logs and "shadowed" not in logs[0].read_text()


def test_tp_logs_are_kept_in_the_state_dir_and_bounded(tmp_path):
    from macspec.distributed.bootstrap import KEEP_LOG_DIRS, Peers

    os.environ["MACSPEC_HOME"] = str(tmp_path / "home")  # the isolated_home fixture's value
    dirs = []
    for _ in range(KEEP_LOG_DIRS + 3):
        dirs.append(Peers().log_dir)
        time.sleep(0.01)
        os.utime(dirs[-1])
    root = tmp_path / "home" / "state" / "tp-logs"
    kept = sorted(p for p in root.iterdir())
    assert len(kept) == KEEP_LOG_DIRS and dirs[-1] in kept and dirs[0] not in kept


def test_jaccl_off_macos_says_what_to_do(tmp_path):
    if sys.platform == "darwin":
        pytest.skip("JACCL is the real backend on macOS")
    proc = subprocess.run([sys.executable, "-m", "macspec", "run", "hi", "--profile", "kimi-tp2"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MACSPEC_HOME": str(tmp_path / "home")})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert 'macOS 26.2' in proc.stderr and 'parallel.backend = "ring"' in proc.stderr, proc.stderr
