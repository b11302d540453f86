"""Servers the bench starts itself: `macspec serve` for a profile, `mlx_lm.server` as the peer."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..childproc import macspec_argv
from ..errors import MacspecError
from ..paths import cache_dir
from ..server.daemon import tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    def __init__(self, name: str, argv: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            merged = {**os.environ, **(env or {})}  # a None value unsets the variable
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         env={k: v for k, v in merged.items() if v is not None})

    @classmethod
    def macspec(cls, profile_file: str, work: Path, api_key: str | None = None,
                model: str | None = None) -> "LaunchedServer":
        port = free_port()
        argv = macspec_argv("serve", "--profile", profile_file, "--port", str(port), "--log-level", "info",
                            *(["--model", model] if model else []))
        # Its own state dir, so the user's `macspec status` record is left alone, but the user's
        # cache (built and pulled models are not made again). No key: unset (`macspec serve`
        # refuses an empty MACSPEC_API_KEY).
        env = {"MACSPEC_HOME": str(work / "home"), "MACSPEC_CACHE": str(cache_dir()),
               "MACSPEC_API_KEY": api_key or None}
        return cls("macspec serve", argv, port, work / "macspec-serve.log", env)

    @classmethod
    def mlx_lm(cls, model_dir: Path, work: Path, draft_dir: Path | None = None) -> "LaunchedServer":
        port = free_port()
        args = ["--model", str(model_dir), "--port", str(port)]
        if draft_dir is not None:
            args += ["--draft-model", str(draft_dir)]
        # Through `import macspec`, so mlx_lm.server gets the same BLAS as macspec on Linux.
        code = ("import sys, runpy; del sys.path[0]; import macspec; sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        return cls("mlx_lm.server", [sys.executable, "-c", code, *args], port, work / "mlx-lm-server.log")

    def wait_ready(self, path: str = "/health", timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MacspecError(f"{self.name} exited with code {self.proc.returncode}: "
                                   f"{self.log_excerpt(8)}")
            try:
                urllib.request.urlopen(self.url + path, timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise MacspecError(f"{self.name} did not answer {path} within {timeout:.0f} s")

    def log_excerpt(self, lines: int = 30) -> str:
        return tail(self.log, lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def float32_copy(src: Path, dst: Path) -> Path:
    """A float32 copy of a model dir: half-precision matmuls are slow on CPU, and a peer server
    must run the same arithmetic as macspec (which computes in float32 there)."""
    import mlx.core as mx

    from ..models.store import safetensors_header

    if dst.exists():
        return dst
    weights_files = list(src.glob("*.safetensors"))
    if all(info["dtype"] == "F32" for f in weights_files
           for name, info in safetensors_header(f).items() if name != "__metadata__"):
        return src  # float32 already (pulled:smollm2, built:tiny-wide): nothing to convert
    return _copy_dir(src, dst, lambda weights: {k: v.astype(mx.float32) for k, v in weights.items()})


def random_weights_copy(src: Path, dst: Path, seed: int) -> Path:
    """The same model with random weights of each matrix's own scale: a proposer that shares
    the target's tokenizer but whose guesses are useless."""
    import mlx.core as mx

    if dst.exists():
        return dst
    mx.random.seed(seed)
    return _copy_dir(src, dst, lambda weights: {
        k: (mx.random.normal(v.shape) * v.std()).astype(v.dtype) if v.ndim >= 2 else v for k, v in weights.items()})


def _copy_dir(src: Path, dst: Path, convert) -> Path:
    """`src` into a new `dst`, each safetensors file's weights through `convert`; the rest (heads
    and drafters shipped beside the weights, eagle3/ and dflash/, included) as they are."""
    import mlx.core as mx

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            mx.save_safetensors(str(dst / f.name), convert(mx.load(str(f))))
        elif f.is_file():
            shutil.copy(f, dst / f.name)
        elif f.is_dir():
            shutil.copytree(f, dst / f.name)
    return dst
