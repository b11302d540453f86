"""Prefix-cache entries on disk, so a restart keeps long shared prompts warm.

One safetensors file per entry: every layer's KV arrays (`layer{i}.{j}`, any number of arrays per
leaf so MLA/CacheList caches fit), optional MTP hidden states (`states`) and the tokens
themselves (`tokens`, checked on load). The file name is a hash of (model digest, shard, tokens);
the header metadata repeats digest, shard and tokens so the in-memory index is built at start from
headers alone. LRU by file mtime (touched on every hit), bounded by `max_bytes`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..paths import cache_dir
from .radix import RadixTree

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
MIN_TOKENS = 128  # shorter prefixes prefill faster than a file is written and read back
HEADER_LIMIT = 16 << 20  # tokens in the header: ~6 bytes each; more means a damaged file


def model_digest(model_dir: Path, *extra: str) -> str:
    """Weights identity: each weight file's name, size and mtime (no hashing of GBs), plus
    `extra` (the dtype the KV is computed in)."""
    files = sorted(model_dir.glob("*.safetensors"))
    parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    raw = "|".join([str(model_dir.resolve()), *parts, *extra])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def entry_name(digest: str, shard: str, tokens: list[int]) -> str:
    raw = json.dumps([digest, shard, list(tokens)]).encode()
    return hashlib.sha256(raw).hexdigest()[:32] + SUFFIX


def open_store(kv, model_dir: str | Path, dtype: str, rank: int = 0,
               world: int = 1) -> "DiskPrefixStore | None":
    """This rank's store for the profile's `kv` table, under <dir>/<model digest>/ (dir:
    kv.prefix_cache_disk_dir, else <cache dir>/prefix-kv), or None when off (0 GB)."""
    if not kv.prefix_cache_disk_gb:
        return None
    root = Path(kv.prefix_cache_disk_dir).expanduser() if kv.prefix_cache_disk_dir else cache_dir() / "prefix-kv"
    digest = model_digest(Path(model_dir), dtype)
    return DiskPrefixStore(root / digest, digest, f"{rank}/{world}", int(kv.prefix_cache_disk_gb * 2**30))


@dataclass
class DiskEntry:
    path: Path
    tokens: tuple[int, ...]
    nbytes: int


class DiskPrefixStore:
    """Entries of one model and shard under `root`. `shard` is "rank/world" (in each file's key
    and header): a tensor-parallel rank's KV holds only its heads, so no other layout may load it."""

    def __init__(self, root: Path, digest: str, shard: str, max_bytes: int):
        self.root, self.digest, self.shard, self.max_bytes = root, digest, shard, max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, DiskEntry] = {}
        self.by_tokens: dict[tuple[int, ...], str] = {}
        self.tree = RadixTree()  # entries' tokens: a prompt may share only part of an entry
        self.hits = self.loads = self.evictions = self.corrupt = self.write_errors = 0
        self._scan()

    def _scan(self) -> None:
        """Index what is on disk from headers only; other models' and ranks' files are skipped."""
        for path in self.root.glob("*" + SUFFIX):
            if ".tmp" in path.name:
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            meta = self._header(path)
            if meta is None:
                continue
            if meta.get("digest") == self.digest and meta.get("shard") == self.shard:
                try:
                    tokens = tuple(json.loads(meta["tokens"]))
                except (KeyError, ValueError) as err:
                    self._discard(path, f"no token list in the header ({err})")
                    continue
                self._index(DiskEntry(path, tokens, path.stat().st_size))

    def _index(self, entry: DiskEntry) -> None:
        self.entries[entry.path.name] = entry
        self.by_tokens[entry.tokens] = entry.path.name
        self.tree.insert(entry.tokens)

    def _unindex(self, entry: DiskEntry) -> None:
        self.entries.pop(entry.path.name, None)
        if self.by_tokens.pop(entry.tokens, None) is not None:
            self.tree.remove(entry.tokens)

    def _header(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > HEADER_LIMIT:
                    raise ValueError(f"header of {size} bytes")
                return json.loads(f.read(size)).get("__metadata__", {})
        except (OSError, ValueError, struct.error) as err:
            self._discard(path, f"unreadable header ({err})")
            return None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def save(self, tokens: list[int], layers: list[tuple[mx.array, ...]],
             states: mx.array | None = None) -> None:
        """Write an entry atomically (tmp + rename), then evict the oldest past the bound."""
        name = entry_name(self.digest, self.shard, tokens)
        if name in self.entries or not self.max_bytes or len(tokens) < MIN_TOKENS:
            return
        arrays = {f"layer{i}.{j}": a for i, leaf in enumerate(layers) for j, a in enumerate(leaf)}
        arrays["tokens"] = mx.array(tokens, dtype=mx.int32)
        if states is not None:
            arrays["states"] = states
        meta = {"digest": self.digest, "shard": self.shard, "tokens": json.dumps(list(tokens)),
                "layers": json.dumps([len(leaf) for leaf in layers])}
        final = self.root / name
        tmp = self.root / (name[: -len(SUFFIX)] + f".tmp{os.getpid()}" + SUFFIX)
        try:
            mx.save_safetensors(str(tmp), arrays, metadata=meta)
            os.replace(tmp, final)
        except (OSError, RuntimeError) as err:  # a full, read-only or vanished disk costs the
            self._write_failed(tmp, err)  # cache a copy, never a request its step
            return
        for covered in self.tree.keys_on_path(tuple(tokens)):  # the new entry holds their KV too
            self._remove(self.entries[self.by_tokens[covered]])
        self._index(DiskEntry(final, tuple(tokens), final.stat().st_size))
        self._evict()

    def _write_failed(self, tmp: Path, err: Exception) -> None:
        """Logged once as a warning (a disk that stays full fails every write), then at debug."""
        self.write_errors += 1
        say = log.warning if self.write_errors == 1 else log.debug
        say("prefix cache on disk: could not write under %s (%s); entries stay in memory only", self.root, err)
        with contextlib.suppress(OSError):  # its directory may be what vanished
            tmp.unlink(missing_ok=True)

    def _evict(self) -> None:
        by_age = sorted(self.entries.values(), key=lambda e: e.path.stat().st_mtime_ns)
        while self.nbytes > self.max_bytes and by_age:
            self._remove(by_age.pop(0))
            self.evictions += 1

    def _remove(self, entry: DiskEntry) -> None:
        self._unindex(entry)
        entry.path.unlink(missing_ok=True)

    def longest(self, prompt: list[int]) -> tuple[int, DiskEntry | None]:
        """(shared tokens, entry) of the on-disk entry sharing the longest prefix with `prompt`."""
        shared, key = self.tree.longest_match(prompt)
        if key is None or not shared:
            return 0, None
        return shared, self.entries[self.by_tokens[key]]

    def load(self, entry: DiskEntry,
             n_leaves: int | None = None) -> tuple[list[tuple[mx.array, ...]], mx.array | None] | None:
        """(layers, states) of `entry`, or None after one warning and deleting a bad file."""
        try:
            arrays, meta = mx.load(str(entry.path), return_metadata=True)
            layers = [tuple(arrays[f"layer{i}.{j}"] for j in range(n))
                      for i, n in enumerate(json.loads(meta["layers"]))]
            reason = self._mismatch(arrays, meta, layers, entry.tokens, n_leaves)
        except Exception as err:  # noqa: BLE001 - any damage means a cold prefill, never a failure
            reason = f"unreadable ({type(err).__name__}: {err})"
        if reason:
            self._discard(entry.path, reason)
            self._unindex(entry)
            return None
        os.utime(entry.path)  # LRU: last use is the mtime
        self.hits += 1
        self.loads += 1
        return layers, arrays.get("states")

    def _mismatch(self, arrays, meta, layers, expect_tokens, n_leaves) -> str | None:
        if meta.get("digest") != self.digest or meta.get("shard") != self.shard:
            return "written for another model or shard"
        if arrays["tokens"].tolist() != list(expect_tokens):
            return "tokens differ from the key"
        if n_leaves is not None and len(layers) != n_leaves:
            return f"{len(layers)} KV layers, the model has {n_leaves}"
        for leaf in layers:
            for a in leaf:
                if a.ndim >= 3 and a.shape[2] != len(expect_tokens):
                    return "KV length does not match the tokens"
        return None

    def _discard(self, path: Path, reason: str) -> None:
        log.warning("prefix cache on disk: dropping %s: %s", path, reason)
        self.corrupt += 1
        path.unlink(missing_ok=True)

    def as_dict(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "hits": self.hits,
                "loads": self.loads, "evictions": self.evictions, "corrupt": self.corrupt,
                "write_errors": self.write_errors}
