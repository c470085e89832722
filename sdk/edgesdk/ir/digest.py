"""Content digests for files, directories and JSON-able values (the stage cache keys)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(root: Path, exclude: tuple[str, ...] = ()) -> str:
    """Digest of every file under `root` (relative path and content), in sorted order; `exclude` names
    files (paths relative to `root`) left out."""
    h = hashlib.sha256()
    for p in sorted(q for q in Path(root).rglob("*") if q.is_file() and q.relative_to(root).as_posix() not in exclude):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def value_sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
