"""Where generated things live: one cache, keyed by content, outside the repo."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import shutil
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


def check_free(path: Path, need: int, slack: int = 16 << 20) -> None:
    """Refuse, before writing anything, to write ``need`` bytes to ``path`` when its folder has not that much
    free (plus ``slack``: a disk filled to the last byte breaks everything else on the machine). The refusal is
    the OSError a full disk would give, with the figures."""
    free = shutil.disk_usage(Path(path).parent).free
    if need + slack > free:
        raise OSError(errno.ENOSPC, f"no space left on the device: {_mib(need + slack)} needed, {_mib(free)} free",
                      str(path))


def _mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Hold the build lock of ``path`` (its cache key): a second build of the same key waits here, then finds the
    file built. Holding it, no live process writes this key, so temporary files of the key left by a build that
    was killed (``.STEM-*.tmp``) are removed first. The lock file goes when the build ends."""
    import fcntl

    path = Path(path)
    lock = path.parent / f".{path.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder before us may have removed the file we waited on: lock the one that is there now
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        remove_stale(path)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def remove_stale(path: Path) -> list[Path]:
    """Remove the temporary files of ``path``'s key (``.STEM-*.tmp``, as atomic_path names them). Call it only
    holding build_lock(path). Returns what it removed."""
    gone = []
    for p in Path(path).parent.glob(f".{glob.escape(Path(path).stem)}-*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            gone.append(p)
    return gone


class Measurements:
    """Measurements kept between runs in one JSON file of the cache (``NAME.json``), each entry keyed by what it
    depends on and prefixed with the ``version`` of the way it was measured: an entry of another version is never
    read, and is dropped at the next write. A file that is missing or not JSON reads as empty; one that cannot be
    written costs a measurement next time, nothing else."""

    def __init__(self, name: str, version: int) -> None:
        self.name, self.version = name, version

    @property
    def file(self) -> Path:
        """In ``$SPECTER_MEASUREMENTS`` where set, else the cache's root: the test suite sets it to a folder of
        its own, so that its throwaway models and RPC servers on random ports never enter the user's files."""
        return Path(os.environ.get("SPECTER_MEASUREMENTS") or cache_dir()) / f"{self.name}.json"

    def key(self, *parts: object) -> str:
        return "|".join([f"v{self.version}", *map(str, parts)])

    def entries(self) -> dict:
        try:
            return json.loads(self.file.read_text()) if self.file.exists() else {}
        except ValueError:
            return {}

    def save(self, key: str, entry: dict) -> None:
        known = {k: v for k, v in self.entries().items() if k.startswith(f"v{self.version}|")}
        known[key] = entry
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.file, json.dumps(known, indent=1))
