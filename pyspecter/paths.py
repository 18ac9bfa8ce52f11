"""Where generated things live: one cache, keyed by content, outside the repo."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of everything pyspecter builds or downloads (``$SPECTER_CACHE`` or ``~/.cache/pyspecter``)."""
    return Path(os.environ.get("SPECTER_CACHE", Path.home() / ".cache" / "pyspecter"))


def models_dir() -> Path:
    d = cache_dir() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d


def content_key(*parts: bytes | str) -> str:
    """Short stable hash of the inputs that determine an artifact."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]
