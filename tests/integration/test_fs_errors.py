"""Filesystem failures as users meet them: a full disk, a read-only cache, a build killed mid-write. Each is one
line and exit code 2, and nothing partial stays in the cache.

The full and read-only disks are real mounts (a 40 MiB tmpfs, a read-only bind mount) made in a private mount
namespace with `unshare`; where this machine does not allow that, those tests skip and say why."""

from __future__ import annotations

import functools
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PY = shlex.quote(sys.executable)


@functools.cache
def _mount_refused() -> str | None:
    """Why mounts cannot be made here (None: they can)."""
    try:
        r = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d && rmdir $d"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare unavailable ({e})"
    return None if r.returncode == 0 else f"mounting in a user namespace is not allowed here: {r.stderr.strip()}"


def _in_namespace(setup: str, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``setup`` (mounts) then ``command`` as root of a private user+mount namespace; the mounts vanish with it."""
    reason = _mount_refused()
    if reason:
        pytest.skip(reason)
    script = f"set -e\n{setup}\nexec {command}"
    return subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", script], capture_output=True,
                          text=True, timeout=timeout, cwd=Path(__file__).resolve().parents[2])


def _one_line_error(r: subprocess.CompletedProcess, path_part: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("pyspecter: error: cannot write ") and path_part in line, line
    assert line.endswith("(set SPECTER_CACHE to a writable folder)"), line
    return line


def test_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    mount = f"mount -t tmpfs -o size=40m tmpfs {cache}"
    env = f"env SPECTER_CACHE={cache} {PY} -m pyspecter"
    # 1.7 GB of bench-qwen3moe into 40 MiB: refused before a byte is written (it used to fail 12 s in)
    left = f"rc=$?; find {cache} -type f ! -name fill; exit $rc"  # what stays in the cache: printed on stdout
    t0 = time.monotonic()
    r = _in_namespace(mount, f"sh -c '{env} models build bench-qwen3moe; {left}'")
    line = _one_line_error(r, str(cache / "models" / "bench-qwen3moe-"))
    assert "needed" in line and "free" in line
    assert time.monotonic() - t0 < 60
    assert r.stdout == ""  # no partial file, no lock file
    # the disk already full: a small fixture too is one line, not a chained double traceback
    r = _in_namespace(f"{mount}\nmkdir {cache}/models\ndd if=/dev/zero of={cache}/fill bs=1M 2>/dev/null || true",
                      f"sh -c '{env} models build tiny-mixtral; {left}'")
    _one_line_error(r, str(cache / "models"))
    assert r.stdout == ""


def test_read_only_cache_is_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    r = _in_namespace(f"mount --bind {cache} {cache}\nmount -o remount,bind,ro {cache}",
                      f"env SPECTER_CACHE={cache} {PY} -m pyspecter generate tiny-qwen3moe -p hi -n 4")
    line = _one_line_error(r, str(cache))
    assert "Read-only file system" in line


def test_a_killed_build_leaves_no_orphan(tmp_path: Path) -> None:
    """kill -9 in the middle of writing bench-qwen3moe (1.7 GB), then build again: the next build removes the
    killed one's temporary file, and the cache holds the model and nothing else."""
    env = {**os.environ, "SPECTER_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "pyspecter", "models", "build", "bench-qwen3moe"]
    models = tmp_path / "models"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not any(p.stat().st_size > 64 << 20 for p in models.glob(".*.tmp")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the build wrote no temporary file"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    orphans = list(models.glob(".*.tmp"))
    assert orphans  # what the killed build left
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    built = Path(r.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in models.iterdir()) == [built.name]
