"""Where generated things live: one cache, keyed by content, outside the repo."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_path(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A unique temporary path in ``path``'s folder, renamed to ``path`` when the block succeeds and removed when
    it fails: a reader never sees a half-written file, and two runs never write the same temporary file."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
