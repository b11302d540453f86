"""Before any weight loads: every rank must run the same macspec and MLX, the same profile
(the tables that shape the shared state) and the same model files, or the group refuses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..config import Profile
from ..errors import MacspecError

FIELDS = ("macspec version", "MLX version", "profile", "model files")
FIELD_BYTES = 48
SHARED_TABLES = ("model", "kv", "parallel")  # rank-0-only tables (server, sampling) may differ
RANK0_ONLY_KEYS = {("model", "chat")}


class HandshakeError(MacspecError):
    """The ranks differ in software, profile or model files."""


class PeerLeftError(HandshakeError):
    """A peer exited before the handshake completed."""


def profile_hash(profile: Profile) -> str:
    resolved = profile.resolved()
    shared = {table: {k: v for k, (v, _) in resolved[table].items() if (table, k) not in RANK0_ONLY_KEYS}
              for table in SHARED_TABLES}
    return f"{profile.name}:" + hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def model_hash(path: Path) -> str:
    """config.json plus the weight index (or each safetensors header: names, shapes, dtypes)."""
    from ..models.store import safetensors_header

    digest = hashlib.sha256((path / "config.json").read_bytes())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        digest.update(index.read_bytes())
    else:
        for file in sorted(path.glob("*.safetensors")):
            header = json.dumps(safetensors_header(file), sort_keys=True)
            digest.update(file.name.encode() + header.encode())
    return digest.hexdigest()[:16]


def identity(profile: Profile) -> dict[str, str]:
    import mlx_lm

    from .. import __version__

    from ..models.loader import find_local_model

    path = find_local_model(profile.model.path)  # never downloads: a 600 GB fetch is not a handshake
    return {"macspec version": __version__,
            "MLX version": f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}",
            "profile": profile_hash(profile),
            "model files": model_hash(path) if path else "not on this host"}


def _encode(ident: dict[str, str]) -> np.ndarray:
    out = np.zeros(len(FIELDS) * FIELD_BYTES, dtype=np.int32)
    for i, name in enumerate(FIELDS):
        raw = ident[name].encode()[:FIELD_BYTES]
        out[i * FIELD_BYTES:i * FIELD_BYTES + len(raw)] = list(raw)
    return out


def _decode(row: list[int]) -> dict[str, str]:
    return {name: bytes(b for b in row[i * FIELD_BYTES:(i + 1) * FIELD_BYTES] if b).decode(errors="replace")
            for i, name in enumerate(FIELDS)}


def handshake(group, ident: dict[str, str]) -> list[dict[str, str]]:
    """All-gather every rank's identity; raise on every rank if any differs from rank 0's."""
    try:
        gathered = mx.distributed.all_gather(mx.array(_encode(ident))[None], group=group, stream=mx.cpu)
        rows = [_decode(row) for row in np.array(gathered).tolist()]
    except RuntimeError as err:  # a peer left before answering (its log says why)
        raise PeerLeftError(f"a tensor-parallel peer left during the handshake: {err}") from None
    problems = [f"rank {rank} has {name} {theirs[name]!r}, rank 0 has {rows[0][name]!r}"
                for rank, theirs in enumerate(rows[1:], start=1)
                for name in FIELDS if theirs[name] != rows[0][name]]
    if problems:
        raise HandshakeError("tensor-parallel peers differ; refusing to start: " + "; ".join(problems)
                             + ". Install the same macspec/MLX versions and the same profile and "
                             "model files on every host.")
    return rows
