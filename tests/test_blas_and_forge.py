"""Fast BLAS selection, and a smoke run of the forge (a few steps, tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mlx_lm import load as mlx_load

from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec.config import load_profile
from macspec.forge.build import RECIPES, forge

from .conftest import generate

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

PROBE = "import macspec, json; from macspec.blas import blas_info; print(json.dumps(blas_info().as_dict()))"
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is Linux-only")


def blas_in_subprocess(**env) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout), done.stderr


@linux_only
def test_a_run_time_dispatched_openblas_is_loaded_and_checked():
    info, _ = blas_in_subprocess()
    assert info["name"] == "openblas" and info["verdict"] == "passed"
    assert "DYNAMIC_ARCH" in info["config"] and info["core"]  # kernels chosen for this CPU
    assert info["threads"] >= 1


@linux_only
def test_forced_avx2_kernels_pass_the_check():
    # What an AVX-512 machine runs to show the AVX2 path: the kernel forced, checked apart.
    info, _ = blas_in_subprocess(OPENBLAS_CORETYPE="Haswell")
    assert (info["name"], info["core"], info["verdict"]) == ("openblas", "Haswell", "passed")


def test_blas_opt_out():
    info, _ = blas_in_subprocess(MACSPEC_BLAS="reference")
    assert info["name"] in ("reference", "accelerate")


@linux_only
@pytest.mark.parametrize("fault, why", [("SIGILL", "died with SIGILL"), ("wrong", "is wrong")])
def test_a_library_that_fails_its_check_falls_back_once_with_a_warning(tmp_path, fault, why):
    cache = {"MACSPEC_BLAS_CACHE": str(tmp_path / "blas")}
    info, stderr = blas_in_subprocess(MACSPEC_BLAS_PROBE_FAULT=fault, **cache)
    assert info["name"] == "reference" and why in info["verdict"]
    assert stderr.count("failed its check") == 1 and "MACSPEC_BLAS=reference" in stderr
    # The verdict is cached: the next start neither probes (a healthy probe would pass) nor
    # loads the library, and still warns.
    info, stderr = blas_in_subprocess(**cache)
    assert info["name"] == "reference" and "failed its check" in stderr


@linux_only
def test_the_verdict_is_cached_per_library_and_cpu(tmp_path):
    cache = {"MACSPEC_BLAS_CACHE": str(tmp_path / "blas")}
    assert blas_in_subprocess(**cache)[0]["verdict"] == "passed"
    # A later start reads the verdict: the armed fault would fail a probe, so none ran.
    assert blas_in_subprocess(MACSPEC_BLAS_PROBE_FAULT="SIGILL", **cache)[0]["verdict"] == "passed"
    assert len(list((tmp_path / "blas").glob("*/verdict-*.json"))) == 1


@linux_only
def test_the_private_copy_is_keyed_by_the_library_content(tmp_path, monkeypatch):
    from macspec import blas

    monkeypatch.setenv("MACSPEC_BLAS_CACHE", str(tmp_path / "cache"))
    library = tmp_path / "libscipy_openblas.so"
    library.write_bytes(blas._bundled_library().read_bytes())
    first = blas._renamed_copy(library, blas._digest(library))
    with open(library, "ab") as f:  # another build at the same path (pip install X==other)
        f.write(b"another build")
    second = blas._renamed_copy(library, blas._digest(library))
    assert first != second and first.exists() and second.exists()
    assert "cblas_sgemm" in blas.dynamic_symbols(second) and "sgetrf_" in blas.dynamic_symbols(second)


@linux_only
def test_greedy_text_is_the_same_after_the_fallback(tmp_path):
    run = [sys.executable, "-m", "macspec", "run", "def fibonacci(n):", "--max-tokens", "24", "--json"]
    env = {**os.environ, "MACSPEC_BLAS_CACHE": str(tmp_path / "blas"), "HF_HUB_OFFLINE": "1"}
    fast = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    env["MACSPEC_BLAS_CACHE"] = str(tmp_path / "blas-refused")
    slow = subprocess.run(run, env={**env, "MACSPEC_BLAS_PROBE_FAULT": "SIGILL"},
                          capture_output=True, text=True, check=True)
    fast_out, slow_out = json.loads(fast.stdout), json.loads(slow.stdout)
    assert fast_out["blas"]["name"] == "openblas" and slow_out["blas"]["name"] == "reference"
    assert "failed its check" in slow.stderr
    assert slow_out["token_ids"] == fast_out["token_ids"]


def test_forge_smoke_writes_loadable_family(tmp_path, monkeypatch):
    report = forge(tmp_path, RECIPES["smoke"])
    assert report["target_params"] > report["draft_params"] > 0 and report["mtp_params"] > 0
    for name in ("tiny-target", "tiny-draft"):
        model, tokenizer = mlx_load(str(tmp_path / name))  # standard mlx-lm dirs
        assert tokenizer.eos_token_ids
    monkeypatch.setenv("MACSPEC_EMBEDDED_DIR", str(tmp_path))
    for profile_name in ("tiny", "tiny-mtp"):
        runtime = Runtime.load(load_profile(profile_name))
        tokens, gen = generate(runtime, [5, 6, 7], 6, SamplingParams(), k=2)
        assert gen.stats["spec"]["drafted"] > 0


def skip_without_a_thread_choice() -> None:
    """The thread governor has a choice to make only with OpenBLAS, 2+ physical cores and no
    OPENBLAS_NUM_THREADS from the user (which always wins)."""
    from macspec import blas

    if blas.blas_info().name != "openblas" or blas.default_threads() < 2 or blas._user_threads():
        pytest.skip("needs OpenBLAS on 2+ physical cores and no OPENBLAS_NUM_THREADS")


@linux_only
def test_threads_give_way_to_another_busy_process():
    from macspec import blas

    skip_without_a_thread_choice()
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        blas._GOVERNOR.tick()
        deadline = time.monotonic() + 10
        while blas.blas_info().threads >= blas.default_threads() and time.monotonic() < deadline:
            time.sleep(blas.ThreadGovernor.PERIOD_S)
            blas._GOVERNOR.tick()
        assert blas.blas_info().threads < blas.default_threads()  # a core left to the other process
    finally:
        burner.kill()


@linux_only
@pytest.mark.parametrize("neighbour_stays", [False, True])
def test_threads_after_idleness_follow_the_load_now_not_while_the_server_waited(monkeypatch, neighbour_stays):
    """A neighbour used every core while the server sat idle for 30 s. A request then comes: its
    first step runs on one thread (the idle window's load), its second on the threads the machine
    leaves free now: all of them if the neighbour has stopped (before, one until a second had
    passed), fewer if it has not. The machine's counters are scripted: a neighbour's timing
    cannot be, on a shared machine."""
    from collections import namedtuple

    import psutil

    from macspec import blas

    skip_without_a_thread_choice()
    cores = blas.default_threads()
    Times = namedtuple("Times", "user system idle iowait")
    clock = {"now": 1000.0, "machine": 0.0, "ours": 0.0}

    class Process:
        def cpu_times(self):
            return (clock["ours"], 0.0)

    def advance(seconds: float, ours: float, others: float) -> None:  # cores busy over `seconds`
        clock["now"] += seconds
        clock["ours"] += ours * seconds
        clock["machine"] += (ours + others) * seconds

    monkeypatch.setattr(blas.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(psutil, "cpu_times", lambda: Times(clock["machine"], 0.0, 1e6, 0.0))
    monkeypatch.setattr(psutil, "Process", Process)
    governor, was = blas.ThreadGovernor(), blas.blas_info().threads
    try:
        blas._apply_threads(cores)
        governor.tick()  # the last step before idleness
        advance(30.0, ours=0.01, others=cores)  # idle; the neighbour busy on every core
        governor.tick()  # the request's first step
        assert blas.blas_info().threads == 1
        advance(0.06, ours=cores - neighbour_stays, others=neighbour_stays)
        governor.tick()  # its second
        assert blas.blas_info().threads == (cores - 1 if neighbour_stays else cores)
    finally:
        blas._apply_threads(was)
