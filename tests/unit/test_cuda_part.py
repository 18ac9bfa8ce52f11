"""tools/cuda_part.py: which carried GPU half may stand in for this machine's CUDA build, and the archive's checks.
The splice itself needs a CUDA build of the checkout (15 min on these machines) and is run by tools/gpu_check.sh."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cp(monkeypatch: pytest.MonkeyPatch):
    for var in ("SPECTER_CUDA_ARCH", "SPECTER_CUDA_FA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # cuda_part imports build_llama as its sibling
    spec = importlib.util.spec_from_file_location("cuda_part", ROOT / "tools" / "cuda_part.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("build_llama", None)


def _manifest(cp, **change) -> dict:
    return {**cp.expected(), "cuda_release": "13.0", "libs": {}, "links": {}, "built": {"key": "k"}, **change}


def test_a_part_of_the_same_inputs_fits(cp) -> None:
    assert cp.differences(_manifest(cp), cp.expected(), 13) == []


def test_what_keeps_a_part_out_is_named(cp, monkeypatch: pytest.MonkeyPatch) -> None:
    want, part = cp.expected(), _manifest(cp)  # a part of this checkout's inputs, arch 90
    patches = dict(want["patches"], **{"0009-new.patch": "0" * 64})
    assert cp.differences(_manifest(cp, patches=patches), want, 13) == ["patches differs"]
    assert cp.differences(_manifest(cp), want, 12) == ["built with CUDA 13.0, this machine has CUDA 12"]
    assert cp.differences(_manifest(cp), want, None) == ["no nvcc here to say CUDA's release"]
    # another architecture, or flash attention's kernels kept: other kernels in libggml-cuda
    monkeypatch.setenv("SPECTER_CUDA_ARCH", "89")
    assert cp.differences(part, cp.expected(), 13) == ["options differs", "arch differs"]
    monkeypatch.delenv("SPECTER_CUDA_ARCH")
    monkeypatch.setenv("SPECTER_CUDA_FA", "1")
    assert cp.differences(part, cp.expected(), 13) == ["options differs"]


def test_the_machines_amx_decision_does_not_matter(cp, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX reaches ggml-cpu alone, which the GPU machine builds: the part is compared with AMX allowed either way."""
    before = cp.expected()
    monkeypatch.setattr(cp.b, "amx_decision", lambda: (False, "no tiles"))
    assert cp.expected() == before


def test_a_file_that_is_not_a_part_is_one_line_exit_2(cp, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cp.read_manifest(tmp_path / "missing.tar.xz")
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    junk = tmp_path / "junk.tar.xz"
    junk.write_bytes(b"not an archive")
    with pytest.raises(SystemExit) as e:
        cp.read_manifest(junk)
    assert e.value.code == 2 and "not a CUDA part" in capsys.readouterr().err
    other = tmp_path / "other.tar.xz"
    with tarfile.open(other, "w:xz") as tf:
        data = json.dumps({"sdist_sha256": "x"}).encode()
        info = tarfile.TarInfo(cp.MANIFEST)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(SystemExit) as e:
        cp.read_manifest(other)
    assert e.value.code == 2 and "not a CUDA part" in capsys.readouterr().err


def test_a_part_that_does_not_fit_exits_3_saying_why(cp, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 3 is gpu_check's cue to build CUDA on the machine instead; nothing is built or written."""
    part = tmp_path / "part.tar.xz"
    with tarfile.open(part, "w:xz") as tf:
        data = json.dumps(_manifest(cp, sdist_sha256="f" * 64)).encode()
        info = tarfile.TarInfo(cp.MANIFEST)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(cp.b, "find_nvcc", lambda: Path("/nvcc"))
    monkeypatch.setattr(cp.b, "nvcc_release", lambda nvcc: (13, 0))
    monkeypatch.setenv("SPECTER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as e:
        cp.splice(part)
    assert e.value.code == 3 and "sdist_sha256 differs" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_nothing_of_ours_is_compiled_differently_for_cuda() -> None:
    """The splice takes libllama (csrc/ and llama.cpp's src/) from the CPU build. A full CUDA build compiles them
    with GGML_USE_CUDA (a PUBLIC definition of ggml), so code of ours that tested it would differ between the two,
    unseen by the manifest: none may (llama.cpp's own src/ has none, read in the pinned sdist on 2026-12-07)."""
    ours = [p for p in (ROOT / "csrc").rglob("*") if p.is_file()]
    hits = [f"{p.relative_to(ROOT)}" for p in ours if "GGML_USE_" in p.read_text(errors="replace")]
    for patch in sorted((ROOT / "patches").glob("*.patch")):
        added = [ln for ln in patch.read_text(errors="replace").splitlines() if ln.startswith("+")]
        hits += [f"{patch.name}" for ln in added if "GGML_USE_" in ln]
    assert not hits, f"GGML_USE_* in {sorted(set(hits))}: the CUDA part's splice would build these differently"
