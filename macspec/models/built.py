"""Model dirs macspec builds from the embedded family on first use: `built:NAME`.

`built:tiny-wide` is the embedded target widened to hidden 1664 (~206M parameters, float32,
the same logits; see widen.py) with its widened MTP head: a bandwidth-bound stand-in for a
real target, drafted by the unchanged embedded:tiny-draft. `built:tiny-wide-N` is the same at
hidden N. `built:tiny-moe` is the embedded target widened to hidden 512 and sparse-upcycled
into a GLM-4.5-style MoE (64 experts, top 8, one shared expert; upcycle.py), again with the
same logits: the stand-in for MoE targets, its routers fitted to route like a trained model's
(`built:tiny-moe-independent`: tokens routed independently, the other end of the cost surface). `built:kimi-k25-mini`, `built:moonlight-mini` and `built:glm5-mini` are miniature
replicas of the seed profiles' models (models/replicas.py: their architectures, config keys,
layouts and quantization, a few MB each, built deterministically in seconds). Dirs live in
paths.cache_dir()/models/NAME and are plain mlx-lm model dirs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

from ..errors import ModelLoadError
from ..paths import cache_dir
from .replicas import REPLICAS, recipe_digest, write_replica
from .store import STAMP, build, embedded_dir, is_current
from .widen import widened_config

logger = logging.getLogger(__name__)

BUILT_PREFIX = "built:"
SOURCE = "tiny-target"  # the embedded model every build starts from
WIDE_HIDDEN = 1664
BUILD_VERSION = 1  # bump when the written files change, so old caches are rebuilt
_NAME = re.compile(r"tiny-wide(?:-(\d+))?")
MOE_NAME = "tiny-moe"
MOE_ROUTING = {MOE_NAME: "trained", f"{MOE_NAME}-independent": "independent"}  # name -> routing


def replica_names() -> list[str]:
    return list(REPLICAS)


def is_replica(name: str) -> bool:
    return name in replica_names()


def wide_hidden(name: str) -> int:
    if name in MOE_ROUTING:
        from .upcycle import MOE_HIDDEN

        return MOE_HIDDEN
    match = _NAME.fullmatch(name)
    if not match:
        raise ModelLoadError(f"no built model {name!r}; built models: tiny-wide (hidden "
                             f"{WIDE_HIDDEN}, ~206M parameters), tiny-wide-N (hidden N), {', '.join(MOE_ROUTING)} (MoE), "
                             f"{', '.join(replica_names())} (replicas of the seed models)")
    hidden = int(match.group(1) or WIDE_HIDDEN)
    try:
        widened_config(json.loads((embedded_dir() / SOURCE / "config.json").read_text()), hidden)
    except ValueError as err:
        raise ModelLoadError(f"built model {name!r}: {err}") from None
    return hidden


def built_dir(name: str) -> Path:
    if not is_replica(name):
        wide_hidden(name)  # validates the name
    return cache_dir() / "models" / name


def _stamp(hidden: int, recipe: str = "tiny-wide") -> dict:
    # The embedded target's bytes: a re-forged target (a macspec upgrade) invalidates the build.
    digest = hashlib.sha256()
    for file in sorted(p for p in (embedded_dir() / SOURCE).iterdir() if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    if recipe in MOE_ROUTING:  # and so does a change to the upcycling recipe
        digest.update((Path(__file__).parent / "upcycle.py").read_bytes())
    return {"recipe": recipe, "hidden": hidden, "source": digest.hexdigest()[:16],
            "version": BUILD_VERSION}


def _replica_stamp(name: str) -> dict:
    # The generator's own source and the tokenizer it copies: editing either rebuilds.
    return {"recipe": name, "source": recipe_digest().hex()[:16], "version": BUILD_VERSION}


def _stamp_for(name: str) -> dict:
    if name in MOE_ROUTING:
        return _stamp(wide_hidden(name), name)
    return _replica_stamp(name) if is_replica(name) else _stamp(wide_hidden(name))


def find_built(name: str) -> Path | None:
    """The built dir if it exists and is current; never builds."""
    path = built_dir(name)
    return path if is_current(path, _stamp_for(name)) else None


def ensure_built(name: str) -> Path:
    """`built:NAME` -> its dir, building it first if missing or stale."""
    what = f"building {name} (first use)"
    if is_replica(name):
        return find_built(name) or build_replica(name, built_dir(name), force=False, what=what)
    if name in MOE_ROUTING:
        return find_built(name) or build_moe(built_dir(name), name, force=False, what=what)
    return find_built(name) or build_wide(built_dir(name), wide_hidden(name), force=False,
                                          what=what)


def build_wide(out: Path, hidden: int, force: bool = True, what: str | None = None) -> Path:
    """Write the widened target to `out` atomically: built in a temp dir beside it, then renamed,
    so a concurrent or interrupted build never leaves a half dir at `out`."""
    out = build(out, _stamp(hidden), lambda tmp: _write_wide(tmp, hidden), force, what)
    logger.info("built %s (hidden %d)", out, hidden)
    return out


def build_moe(out: Path, name: str = MOE_NAME, force: bool = True, what: str | None = None) -> Path:
    """Write built:tiny-moe(-independent) to `out`, atomically as build_wide does."""
    out = build(out, _stamp_for(name), lambda tmp: _write_wide(tmp, wide_hidden(name), moe=name),
                force, what)
    logger.info("built %s (MoE)", out)
    return out


def build_replica(name: str, out: Path, force: bool = True, what: str | None = None) -> Path:
    """Write replica `name` (models/replicas.py) to `out`, atomically as build_wide does."""
    out = build(out, _replica_stamp(name), lambda tmp: _write_replica(tmp, name), force, what)
    logger.info("built replica %s in %s", name, out)
    return out


def _write_replica(out: Path, name: str) -> None:
    write_replica(name, out)
    (out / STAMP).write_text(json.dumps(_replica_stamp(name), indent=2) + "\n")


def _write_wide(out: Path, hidden: int, moe: str | None = None) -> None:
    """`moe`: the MoE name to upcycle into (its routing), else the dense widened target."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .checkpoint import load_dir, load_mtp_head
    from .upcycle import fit_tokens, upcycle_mtp_head, upcycle_target
    from .widen import widen_mtp_head, widen_target

    source = embedded_dir() / SOURCE
    target = load_dir(source, dtype="float32")
    wide, config = widen_target(target.model, target.config, hidden)
    head = widen_mtp_head(load_mtp_head(target), wide, target.config, config)
    if moe:
        wide, config = upcycle_target(wide, config, fit_tokens(target.tokenizer), MOE_ROUTING[moe])
        head = upcycle_mtp_head(head, wide, config)
    meta = {"format": "mlx"}
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(wide.parameters())), meta)
    # Beside the weights, as in the embedded target: mlx-lm's llama loader rejects unknown keys.
    mx.save_safetensors(str(out / "mtp.safetensors"),
                        head.layout_weights(config["num_hidden_layers"]), meta)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2) + "\n")
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(file, out / file.name)
    (out / STAMP).write_text(json.dumps(_stamp(hidden, moe or "tiny-wide"), indent=2) + "\n")
