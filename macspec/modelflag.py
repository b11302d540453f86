"""`--model PATH|ID` (run, serve, bench): another target under a profile's other defaults.

The value is checked before any model loads: a model dir (mlx-lm layout), a `.gguf` file, a
model reference (`embedded:`, `built:`, `pulled:`), a bare name the store knows (`smollm2`,
`tiny-wide`, `tiny-target`: given the prefix it needs) or a Hugging Face id (owner/name).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .config import Profile, SpeculativeConfig
from .errors import ModelLoadError
from .proposers import BY_NAME, PLAIN

logger = logging.getLogger(__name__)

FLAG = "--model"
HELP = ("A model instead of the profile's (the profile's other settings stay): a model dir, a "
        ".gguf file, pulled:NAME, built:NAME, a name macspec knows (smollm2, tiny-wide) or a "
        "Hugging Face id. Without --method, a profile's draft/MTP/EAGLE-3 proposer becomes ngram "
        "(suffix for a +suffix hybrid).")
PREFIXES = ("embedded:", "built:", "pulled:")  # models/*_PREFIX (importing built.py loads MLX)


def use_model(profile: Profile, value: str, method_given: bool) -> None:
    """Point `profile` at --model's target; unless --method was given, swap a proposer made
    for the profile's own target (a draft with its tokenizer, a head) for one that fits any."""
    ref = model_reference(value)
    method = profile.speculative.method
    keep = method_given or fits_any_target(method) or _same_model(profile.model.path, ref)
    profile.override("model.path", ref, FLAG)
    if keep:
        return
    # A hybrid keeps its part that fits (X+suffix -> suffix); anything else gets the default
    # method (n-gram lookups), which fits any target.
    parts = [p for p in BY_NAME[method].parts if fits_any_target(p)]
    fitting = parts[0] if parts else SpeculativeConfig().method
    logger.info("%s %s: speculative.method = %s instead of the profile's %s, which is made for "
                "its own target (--method chooses another)", FLAG, value, fitting, method)
    profile.override("speculative.method", fitting, FLAG)


def fits_any_target(method: str) -> bool:
    return method == PLAIN or BY_NAME[method].fits_any_target


def model_reference(value: str) -> str:
    """--model's value -> a model.path reference; ModelLoadError, naming the value, for one that
    can never load (no MLX is imported for a path)."""
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{FLAG} {value}: not a model directory (no config.json; an "
                                 "mlx-lm model dir holds config.json, *.safetensors and the "
                                 "tokenizer files; `macspec import` writes one from a .gguf)")
        return value
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{FLAG} {value}: a file, but not a .gguf; give a model "
                                 "directory or a .gguf file")
        return value
    if value.endswith(".gguf") or _looks_like_path(value):
        raise ModelLoadError(f"{FLAG} {value}: no such file or directory")
    if value.startswith(PREFIXES):
        return _checked_reference(value)
    if "/" not in value:
        return _known_name(value)
    return value  # owner/name: a Hugging Face id, downloaded on first use


def _looks_like_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or value.count("/") > 1


def _checked_reference(ref: str) -> str:
    """embedded:/built:/pulled: with a name the store knows (it is not made here)."""
    from .models.loader import source_of

    source = source_of(ref)
    try:
        source.find(ref)  # raises for an unknown name; never builds or downloads
    except ModelLoadError as err:
        raise ModelLoadError(f"{FLAG} {ref}: {err}") from None
    return ref


def _known_name(name: str) -> str:
    """A bare name -> the store's reference for it (embedded first, then pulled, then built)."""
    from .models.built import BUILT_PREFIX, built_dir, replica_names
    from .models.pulled import PULLED_PREFIX, PULLS
    from .models.store import EMBEDDED_PREFIX, embedded_dir, embedded_names

    embedded = [n for n in embedded_names() if not (embedded_dir() / n / "head.json").is_file()]
    if name in embedded:  # a shipped head (head.json) is not a model
        return EMBEDDED_PREFIX + name
    if name in PULLS:
        return PULLED_PREFIX + name
    try:
        built_dir(name)  # validates tiny-wide, tiny-wide-N, tiny-moe and the replicas
        return BUILT_PREFIX + name
    except ModelLoadError:
        pass
    known = "; ".join([f"embedded: {', '.join(embedded)}", f"pulled: {', '.join(PULLS)}",
                       f"built: tiny-wide, tiny-wide-N, tiny-moe, tiny-moe-independent, {', '.join(replica_names())}"])
    raise ModelLoadError(f"{FLAG} {name}: no such file or directory, not a model macspec knows "
                         f"({known}) and not a Hugging Face id (owner/name)")


def _same_model(current: str, ref: str) -> bool:
    """Do both references name the same model dir on this machine (then its proposer fits)?"""
    if current == ref:
        return True
    from .models.loader import find_local_model

    here, there = find_local_model(current), find_local_model(ref)
    return here is not None and there is not None and here.resolve() == there.resolve()
