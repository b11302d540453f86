"""The BLAS check `blas.py` runs in a child process: python blas_probe.py LIBRARY.

Loads LIBRARY with RTLD_GLOBAL (as macspec does), runs sgemm through ctypes and a matmul and a
LAPACK inverse through MLX's CPU stream, compares with NumPy, and prints one JSON line. A CPU
that cannot run the library's kernels kills this process (SIGILL), never macspec itself.
Standard library, NumPy and MLX only: importing macspec here would load the BLAS again.
"""

import ctypes
import json
import os
import signal
import sys

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def cblas_sgemm(lib, a, b, trans_b=False):
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    c = np.zeros((m, n), dtype=np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    lib.cblas_sgemm(ROW_MAJOR, NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k,
                    ctypes.c_float(1.0), a.ctypes.data_as(ptr), k, b.ctypes.data_as(ptr),
                    b.shape[1], ctypes.c_float(0.0), c.ctypes.data_as(ptr), n)
    return c


def close(got, want) -> bool:
    return bool(np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())))


def main(path: str) -> None:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    fault = os.environ.get("MACSPEC_BLAS_PROBE_FAULT", "")  # tests: a library that crashes
    if fault.startswith("SIG"):
        os.kill(os.getpid(), getattr(signal, fault))
    rng = np.random.default_rng(0)
    failures = []
    # The shapes decoding uses: a matvec, a small window, an odd-sized block, a transposed B.
    for m, k, n, trans_b in ((1, 512, 384, False), (8, 256, 640, True), (37, 129, 65, False)):
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        want = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
        got = cblas_sgemm(lib, a, b, trans_b)
        if fault == "wrong":
            got = got + 1.0
        if not close(got, want):
            failures.append(f"cblas_sgemm {m}x{k}x{n} is wrong")
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = rng.standard_normal((64, 64), dtype=np.float32) + 8 * np.eye(64, dtype=np.float32)
        b = rng.standard_normal((64, 48), dtype=np.float32)
        if not close(np.array(mx.array(a) @ mx.array(b)), a.astype(np.float64) @ b):
            failures.append("MLX matmul is wrong")
        if not close(np.array(mx.linalg.inv(mx.array(a))), np.linalg.inv(a.astype(np.float64))):
            failures.append("MLX LAPACK inverse is wrong")
    get_config = lib.openblas_get_config
    get_config.restype = ctypes.c_char_p
    get_core = lib.openblas_get_corename
    get_core.restype = ctypes.c_char_p
    print(json.dumps({"ok": not failures, "reason": "; ".join(failures) or "passed",
                      "config": get_config().decode().strip(), "core": get_core().decode().strip()}))


if __name__ == "__main__":
    main(sys.argv[1])
