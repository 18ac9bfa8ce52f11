"""Model builds: one build of a key at a time (the second waits, then finds the file), temporary files of the key
that no live build holds are removed, free space is checked first, and the fixtures are streamed to the file
with the bytes the in-memory writer gave."""

from __future__ import annotations

import errno
import hashlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import pytest

from pyspecter.cli.app import os_error_line
from pyspecter.models import tiny
from pyspecter.paths import build_lock, check_free


def test_a_second_build_waits_then_cleans_what_the_first_left(tmp_path: Path) -> None:
    path = tmp_path / "m-0123456789abcdef.gguf"
    entered = threading.Event()

    def second() -> None:
        with build_lock(path):
            entered.set()

    with build_lock(path):
        # the first build's temporary files, as a kill -9 would leave them; another key's stays
        for name in (".m-0123456789abcdef-x1y2z3a4.gguf.tmp", ".m-0123456789abcdef-narrow-abcd.gguf.tmp",
                     ".m-fedcba9876543210-x1y2z3a4.gguf.tmp"):
            (tmp_path / name).write_bytes(b"partial")
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        assert not entered.is_set()  # held: the second waits
    t.join(timeout=10)
    assert entered.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m-fedcba9876543210-x1y2z3a4.gguf.tmp"]


def test_the_lock_is_held_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "m-0123456789abcdef.gguf"
    code = ("import sys, time\nfrom pyspecter.paths import build_lock\nwith build_lock(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(1.5)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        (tmp_path / ".m-0123456789abcdef-live0000.gguf.tmp").write_bytes(b"being written")
        t0 = time.monotonic()
        with build_lock(path):
            assert time.monotonic() - t0 > 0.5  # waited for the live holder
            assert not list(tmp_path.glob("*.tmp"))
    finally:
        p.wait(timeout=30)
    assert not list(tmp_path.iterdir())  # no lock file left either


def test_free_space_is_checked_before_writing(tmp_path: Path) -> None:
    with pytest.raises(OSError) as e:
        check_free(tmp_path / "big.gguf", 1 << 60)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "big.gguf")
    assert "needed" in e.value.strerror and "free" in e.value.strerror
    check_free(tmp_path / "small.gguf", 1 << 10)


def test_os_error_line_names_the_path_and_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path))
    line = os_error_line(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "models")))
    assert line == f"cannot write {tmp_path / 'models'}: Read-only file system (set SPECTER_CACHE to a writable folder)"
    assert os_error_line(OSError("Not enough free space to write 33554432 bytes")).startswith(
        f"cannot write {tmp_path}: Not enough free space")
    assert os_error_line(PermissionError(errno.EACCES, "Permission denied", "/etc/x.npz")) == \
        "cannot access /etc/x.npz: Permission denied"


@pytest.mark.parametrize("name", sorted(tiny.TINY_MODELS))
def test_streamed_fixture_equals_the_in_memory_writer(name: str, tmp_path: Path) -> None:
    spec = tiny.TINY_MODELS[name]

    class InMemory(tiny._Tensors):  # every tensor handed to the writer whole, written at the end
        def add(self, name, data, qtype) -> None:
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                self.writer.add_tensor(name, data.astype("f4" if qtype == gguf.GGMLQuantizationType.F32 else "f2"))
            else:
                self.writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    ref = tmp_path / "ref.gguf"
    w = gguf.GGUFWriter(ref, spec.arch)
    tiny._write_metadata(w, spec)
    tiny._write_tensors(InMemory(w, spec.seed), spec)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    built = tiny.build_tiny(name, tmp_path / "cache")
    assert hashlib.sha256(built.read_bytes()).digest() == hashlib.sha256(ref.read_bytes()).digest()
    assert built.stat().st_size - tiny.planned_bytes(spec) < 1 << 20
