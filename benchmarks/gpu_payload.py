"""Pack what benchmarks/gpu.py needs on a GPU machine without network into DIR (default .gpu/):
the mlx, mlx-lm and platformdirs wheels, mlx-cuda-13 with only one architecture's kernels, and
run.sh, which installs them and runs gpu.py.

mlx-cuda-13's wheel is 90 MB (libmlx.so: 67 MB of CUDA kernels for sm_75 ... sm_121 and PTX),
over what a 64 MiB working tree can carry beside the repo. Its kernel payloads for every other
architecture are zeroed (entry headers kept, so the fatbin stays well formed): the CUDA runtime
loads the entry matching the GPU (sm_90 for an H100/H200) and the rest compress to nothing.
Packed as tar.xz: ~20 MB. Seen working on an H200 (driver 580, CUDA 13) on 2026-11-26.

    python benchmarks/gpu_payload.py [--out .gpu] [--arch 90] [--mlx 0.32.4] [--mlx-lm 0.32.2]
    then, on the machine, from the repo root:  bash .gpu/run.sh TIMEOUT_S BUDGET_S [gpu.py flags]
"""

from __future__ import annotations

import argparse
import collections
import io
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
FATBIN_MAGIC = 0xBA55ED50
CUBIN, PTX = 2, 1

RUN_SH = r"""#!/bin/bash
# On the GPU machine: install the carried wheels and the trimmed mlx-cuda-13, then run gpu.py.
set -o pipefail
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/tmp/ptx MACSPEC_CACHE=/tmp/mcache MACSPEC_HOME=/tmp/mhome
here=$(dirname "$0")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$here"/*.whl || exit 3
tar -xJf "$here"/mlx-cuda.tar.xz -C /tmp/site || exit 4
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import mlx.core as mx; print(mx.__version__, mx.device_info()); mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))" || exit 5
timeout "$1" python3 benchmarks/gpu.py --out "$OUT" --budget-s "$2" "${@:3}"
"""


def fatbin_entries(lib: bytes, start: int, size: int):
    """(payload offset, payload size, kind, arch) of every entry in the .nv_fatbin section."""
    at, end = start, start + size
    while at < end:
        magic, _, header, body = struct.unpack_from("<IHHQ", lib, at)
        if magic != FATBIN_MAGIC:
            at += 8  # sections pad their fatbins to 8 bytes
            continue
        entry, stop = at + header, at + header + body
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", lib, entry)
            arch = struct.unpack_from("<I", lib, entry + 28)[0]
            yield entry + entry_header, payload, kind, arch
            entry += entry_header + payload
        at = stop


def keep_one_arch(path: Path, arch: int) -> dict:
    """Zero every kernel payload in `path`'s fatbin but the cubins for `arch`."""
    sections = subprocess.check_output(["readelf", "-S", "-W", str(path)], text=True)
    line = next(s for s in sections.splitlines() if ".nv_fatbin" in s)
    fields = line.split("]", 1)[1].split()
    start, size = int(fields[3], 16), int(fields[4], 16)
    lib = bytearray(path.read_bytes())
    kept, zeroed = collections.Counter(), 0
    for offset, payload, kind, entry_arch in list(fatbin_entries(lib, start, size)):
        if kind == CUBIN and entry_arch == arch:
            kept[entry_arch] += 1
            continue
        lib[offset:offset + payload] = bytes(payload)
        zeroed += payload
    if not kept:
        sys.exit(f"no sm_{arch} cubins in {path}: pick another --arch")
    path.write_bytes(lib)
    return {"kept_cubins": kept[arch], "zeroed_mb": round(zeroed / 1e6, 1)}


def download(names: list[str], into: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(into)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + names, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".gpu")
    ap.add_argument("--arch", type=int, default=90, help="the GPU's compute capability (90: H100, H200)")
    ap.add_argument("--mlx", default="0.32.4")
    ap.add_argument("--mlx-lm", default="0.32.2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        download([f"mlx=={args.mlx}", f"mlx-cuda-13=={args.mlx}", f"mlx-lm=={args.mlx_lm}", "platformdirs"], wheels)
        for wheel in wheels.glob("*.whl"):
            if not wheel.name.startswith("mlx_cuda"):
                shutil.copy(wheel, out / wheel.name)
        cuda = next(wheels.glob("mlx_cuda*.whl"))
        unpacked = wheels / "cuda"
        zipfile.ZipFile(cuda).extractall(unpacked)
        report = keep_one_arch(unpacked / "mlx" / "lib" / "libmlx.so", args.arch)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
            for item in sorted(unpacked.iterdir()):
                tar.add(item, arcname=item.name)
        (out / "mlx-cuda.tar.xz").write_bytes(buffer.getvalue())
    (out / "run.sh").write_text(RUN_SH)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e6:.1f} MB ({report['kept_cubins']} sm_{args.arch} cubins kept, "
          f"{report['zeroed_mb']} MB of other kernels zeroed)")


if __name__ == "__main__":
    main()
