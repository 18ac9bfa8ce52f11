"""tools/build_llama.py's CUDA and source options, decided without building anything: what SPECTER_CUDA=1 adds to
CMake, where it finds cuBLAS and libcuda, when a CUDA build may be linked into the venv, and the trimmed sdist that
tools/gpu_check.sh carries to a machine without a registry."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def b(monkeypatch: pytest.MonkeyPatch):
    for var in ("SPECTER_CUDA", "SPECTER_CUDA_ARCH", "SPECTER_CUDA_FA", "SPECTER_SDIST", "CUDACXX", "CUDA_HOME",
                "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location("build_llama", ROOT / "tools" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_specter_cuda_decides(b, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTER_CUDA", "1")
    assert b.want_cuda()
    monkeypatch.setenv("SPECTER_CUDA", "0")
    assert not b.want_cuda()


def test_cuda_options_one_arch_few_instances_no_paths(b, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = b.cmake_options(False), b.cmake_options(True)
    assert not any("CUDA" in o for o in cpu)
    extra = [o for o in cuda if o not in cpu]
    assert extra == b.cuda_options()
    assert "-DGGML_CUDA=ON" in extra
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in extra  # one architecture, the H100/H200's, by default
    assert "-DGGML_CUDA_FA=OFF" in extra  # contexts run with flash attention off: its kernels are not built
    assert "-DGGML_CUDA_FA_ALL_QUANTS=OFF" in extra and "-DGGML_CUDA_FA_QUANTS=f16-f16" in extra
    assert "-DGGML_CUDA_NCCL=OFF" in extra
    assert not any("/" in o for o in extra)  # options are part of the key: paths go in cuda_hints
    monkeypatch.setenv("SPECTER_CUDA_ARCH", "89")
    monkeypatch.setenv("SPECTER_CUDA_FA", "1")
    assert {"-DCMAKE_CUDA_ARCHITECTURES=89", "-DGGML_CUDA_FA=ON"} <= set(b.cuda_options())
    pin = b.read_pin()
    assert b.build_key(pin, [], cpu, []) != b.build_key(pin, [], cuda, [])  # the CUDA build has its own key
    assert b.build_key(pin, [], cuda, []) != b.build_key(pin, [], b.cmake_options(True), [])  # so are its choices


def _fake_toolkit(tmp: Path, release: str = "13.0", cublas: bool = False) -> Path:
    root = tmp / "cuda"
    (root / "bin").mkdir(parents=True)
    (root / "lib64").mkdir()
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    if cublas:
        (root / "lib64" / "libcublas.so").touch()
        (root / "include" / "cublas_v2.h").touch()
    return root


def _fake_wheel(site: Path, major: int = 13) -> tuple[Path, Path]:
    base = site / "nvidia" / f"cu{major}"
    inc, lib = base / "include", base / "lib"
    inc.mkdir(parents=True)
    lib.mkdir()
    for h in ("cublas_v2.h", "cublas_api.h", "cublasLt.h", "cuda_runtime.h"):  # the last: another package's
        (inc / h).touch()
    for so in (f"libcublas.so.{major}", f"libcublasLt.so.{major}"):
        (lib / so).touch()
    return inc, lib


def test_cublas_wheel_layouts(b, tmp_path: Path) -> None:
    assert b.find_cublas_wheel(13, [str(tmp_path)]) is None
    inc, lib = _fake_wheel(tmp_path / "site13")
    assert b.find_cublas_wheel(13, [str(tmp_path), str(tmp_path / "site13")]) == (inc, lib)
    assert b.find_cublas_wheel(12, [str(tmp_path / "site13")]) is None  # the major must match nvcc's
    base = tmp_path / "site12" / "nvidia" / "cublas"  # nvidia-cublas-cu12
    (base / "include").mkdir(parents=True)
    (base / "lib").mkdir()
    (base / "include" / "cublas_v2.h").touch()
    (base / "lib" / "libcublas.so.12").touch()
    assert b.find_cublas_wheel(12, [str(tmp_path / "site12")]) is None  # no cublasLt: not a usable install
    (base / "lib" / "libcublasLt.so.12").touch()
    assert b.find_cublas_wheel(12, [str(tmp_path / "site12")]) == (base / "include", base / "lib")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_cuda_hints_without_cublas_or_driver(b, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvcc alone (this project's CPU machines): cuBLAS from the wheel, an empty libcuda link stub."""
    root = _fake_toolkit(tmp_path)
    (root / "include" / "cuda.h").write_text("CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *h);\n"
                                              "#define cuMemAlloc                          cuMemAlloc_v2\n")
    inc, lib = _fake_wheel(tmp_path / "site")
    monkeypatch.setenv("CUDACXX", str(root / "bin" / "nvcc"))
    monkeypatch.setattr(b.sys, "path", [str(tmp_path / "site")])
    monkeypatch.setattr(b, "find_cuda_driver", lambda r: ("none", None))
    monkeypatch.setattr(b, "install_cuda_extra", lambda: pytest.fail("the wheel is there: nothing to install"))
    args, info = b.cuda_hints(tmp_path / "shim")
    assert f"-DCMAKE_CUDA_COMPILER={root / 'bin' / 'nvcc'}" in args
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={lib / 'libcublasLt.so.13'}" in args
    hdr = tmp_path / "shim" / "include"
    assert f"-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES={hdr}" in args
    # cuBLAS's headers only: the wheel folder's other headers must not shadow the toolkit's
    assert sorted(p.name for p in hdr.iterdir()) == ["cublasLt.h", "cublas_api.h", "cublas_v2.h"]
    assert all((hdr / n).resolve() == (inc / n).resolve() for n in ("cublas_v2.h", "cublasLt.h"))
    stub = tmp_path / "shim" / "lib" / "libcuda.so"
    assert f"-DCUDA_cuda_driver_LIBRARY={stub}" in args and stub.is_file()
    assert b"libcuda.so.1" in stub.read_bytes()  # its soname: what the real driver library is found by at run time
    # it defines cuda.h's entry points, or --as-needed would drop it and the library would never ask for libcuda
    assert b"cuMemCreate" in stub.read_bytes() and b"cuMemAlloc_v2" in stub.read_bytes()
    rpath = next(a for a in args if a.startswith("-DCMAKE_INSTALL_RPATH="))
    assert rpath == f"-DCMAKE_INSTALL_RPATH=$ORIGIN;{root / 'lib64'};{lib}"
    assert args[-1] == rpath  # after the options' own $ORIGIN-only value, so it wins
    assert info == {"nvcc": str(root / "bin" / "nvcc"), "release": "13.0", "arch": "90", "cublas": str(lib),
                    "libcuda": "link stub (no driver here)"}


def test_cuda_hints_with_a_full_toolkit_and_driver(b, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_toolkit(tmp_path, cublas=True)
    monkeypatch.setenv("CUDA_HOME", str(root))
    driver, find_driver = tmp_path / "libcuda.so.1", b.find_cuda_driver
    monkeypatch.setattr(b, "find_cuda_driver", lambda r: ("driver", driver))
    args, info = b.cuda_hints(tmp_path / "shim", install=False)
    assert not any("cublas" in a for a in args) and info["cublas"] == "toolkit"
    assert f"-DCUDA_cuda_driver_LIBRARY={driver}" in args
    (root / "lib64" / "stubs").mkdir()
    (root / "lib64" / "stubs" / "libcuda.so").touch()
    assert find_driver(root) == ("toolkit", None)  # CMake finds the toolkit's stub itself


def test_cuda_hints_fail_clearly(b, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(b, "find_nvcc", lambda: None)
    with pytest.raises(SystemExit) as e:
        b.cuda_hints(tmp_path / "shim")
    assert e.value.code == 2 and "no nvcc" in capsys.readouterr().err
    root = _fake_toolkit(tmp_path)
    monkeypatch.setattr(b, "find_nvcc", lambda: root / "bin" / "nvcc")
    monkeypatch.setattr(b.sys, "path", [])
    with pytest.raises(SystemExit) as e:
        b.cuda_hints(tmp_path / "shim", install=False)
    assert e.value.code == 2 and "no cuBLAS for CUDA 13" in capsys.readouterr().err


def test_cuda_build_is_linked_only_where_a_driver_loads(b, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(b, "cuda_driver_loadable", lambda: False)
    assert b.may_link(False) and not b.may_link(True)
    monkeypatch.setattr(b, "cuda_driver_loadable", lambda: True)
    assert b.may_link(True)


def test_cuda_extra_is_the_cublas_wheel(b) -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("nvidia-cublas") for r in extras[b.CUDA_EXTRA])


# what the build reads (CMakeLists.txt adds llama.cpp's vendor/ even with common off; src/models/ is not models/)
KEPT = ("CMakeLists.txt", "llama_cpp/llama.py", "vendor/llama.cpp/src/llama.cpp", "vendor/llama.cpp/src/models/x.cpp",
        "vendor/llama.cpp/vendor/miniaudio/CMakeLists.txt", "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu",
        "vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c", "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp",
        "vendor/llama.cpp/cmake/common.cmake")


def _fake_sdist(tmp: Path, top: str) -> Path:
    path = tmp / "fake.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in {**{k: b"kept" for k in KEPT}, "vendor/llama.cpp/models/ggml-vocab-x.gguf": b"GGUF" * 100,
                           ".git/modules/pack": b"pack", "vendor/llama.cpp/docs/ops/CUDA.csv": b"a,b",
                           "vendor/llama.cpp/docs/build.md": b"# build", "vendor/llama.cpp/tools/ui/x.webp": b"x",
                           "vendor/llama.cpp/ggml/src/ggml-vulkan/x.cpp": b"x", "examples/server/server.py": b"x",
                           "vendor/llama.cpp/common/arg.cpp": b"x", "vendor/llama.cpp/tests/t.cpp": b"x"}.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_trimmed_sdist_round_trip(b, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    pin = b.read_pin()
    top = pin["file"].removesuffix(".tar.gz")
    monkeypatch.setattr(b, "fetch_sdist", lambda p: _fake_sdist(tmp_path, top))
    dest = tmp_path / "carry" / "llama-src.tar.xz"
    b.trim_sdist(pin, dest)
    with tarfile.open(dest) as tf:
        names = set(tf.getnames())
        manifest = json.loads(tf.extractfile(f"{top}/{b.TRIM_MANIFEST}").read())
    assert names == {f"{top}/{k}" for k in KEPT} | {f"{top}/{b.TRIM_MANIFEST}"}
    assert manifest["sdist_sha256"] == pin["sha256"]
    assert b.local_sdist(pin) is None  # not asked for: fetch as usual
    monkeypatch.setenv("SPECTER_SDIST", str(dest))
    assert b.local_sdist(pin) == dest
    # anything else is refused with one line, exit 2: not the pinned file, not cut from it
    monkeypatch.setenv("SPECTER_SDIST", str(_fake_sdist(tmp_path, top)))
    with pytest.raises(SystemExit) as e:
        b.local_sdist(pin)
    assert e.value.code == 2 and "neither the pinned" in capsys.readouterr().err
    monkeypatch.setenv("SPECTER_SDIST", str(tmp_path / "missing.tar.gz"))
    with pytest.raises(SystemExit):
        b.local_sdist(pin)


def test_gpu_check_script_parses() -> None:
    import subprocess

    script = ROOT / "tools" / "gpu_check.sh"
    assert script.is_file() and os.access(script, os.R_OK)
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sources_sync_into_the_base_tree_by_content(b, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The incremental base tree gets our sources by content: a changed file is written with a fresh mtime (so
    make recompiles it even when this checkout's copy is older than the last object), an unchanged one is left
    alone, one this checkout lacks is removed."""
    root, dest = tmp_path / "root", tmp_path / "base-src"
    (root / "csrc").mkdir(parents=True)
    a, c = root / "csrc" / "a.cpp", root / "CMakeLists.txt"
    a.write_text("int a;")
    c.write_text("project(x)")
    monkeypatch.setattr(b, "ROOT", root)
    monkeypatch.setattr(b, "source_files", lambda: [c, a])
    assert b.sync_sources(dest) == 2
    (dest / "csrc" / "stale.cpp").write_text("int old;")
    os.utime(dest / "CMakeLists.txt", (1, 1))
    a.write_text("int b;")
    os.utime(a, (1, 1))  # older than anything already built
    assert b.sync_sources(dest) == 2  # a.cpp rewritten, stale.cpp removed
    assert (dest / "csrc" / "a.cpp").read_text() == "int b;"
    assert (dest / "csrc" / "a.cpp").stat().st_mtime > 1
    assert (dest / "CMakeLists.txt").stat().st_mtime == 1  # unchanged: untouched
    assert not (dest / "csrc" / "stale.cpp").exists()
