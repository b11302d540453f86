"""The training corpus every machine has: the running Python's standard-library sources."""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

SKIP_PARTS = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}
HELDOUT_MODULUS = 20  # 1 file in 20 is held out for evaluation and benchmarks


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if not SKIP_PARTS.intersection(p.relative_to(root).parts))
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_heldout(path: Path) -> bool:
    # Stable across machines: depends on the relative path only.
    root = Path(sysconfig.get_paths()["stdlib"])
    return zlib.crc32(str(path.relative_to(root)).encode()) % HELDOUT_MODULUS == 0


def read_texts(heldout: bool) -> list[str]:
    texts = []
    for path in stdlib_files():
        if is_heldout(path) == heldout:
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
    return texts
