"""Fetch the pinned llama-cpp-python sdist, apply our patches, build llama.cpp, and link it into the venv.

Run by `make` with the venv's Python. Everything it makes lives in the cache (``$SPECTER_CACHE`` or
``~/.cache/pyspecter``) under a key of its inputs, so a second run is instant and nothing lands in the repo.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = ROOT / "vendor" / "llama-cpp-python.pin"
PATCHES = ROOT / "patches"
PTH_NAME = "pyspecter-llama.pth"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECTER_CACHE", Path.home() / ".cache" / "pyspecter"))


def read_pin() -> dict[str, str]:
    pin = {}
    for line in PIN.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            pin[k] = v
    return pin


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fail(msg: str) -> None:
    print(f"build_llama: error: {msg}", file=sys.stderr)
    sys.exit(2)


def fetch_sdist(pin: dict[str, str]) -> Path:
    dest = cache_dir() / "sdist" / pin["file"]
    if dest.exists() and sha256_file(dest) == pin["sha256"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {pin['package']}=={pin['version']} sdist from the package registry ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
               f"{pin['package']}=={pin['version']}"]
        if subprocess.run(cmd).returncode != 0:
            fail("pip download of the pinned sdist failed")
        got = Path(tmp) / pin["file"]
        if not got.exists():
            fail(f"pip did not produce {pin['file']}")
        digest = sha256_file(got)
        if digest != pin["sha256"]:
            fail(f"sha256 mismatch for {pin['file']}: got {digest}, pinned {pin['sha256']}")
        shutil.move(str(got), dest)
    return dest


def want_cuda() -> bool:
    if os.environ.get("SPECTER_CUDA") in ("0", "1"):
        return os.environ["SPECTER_CUDA"] == "1"
    # Auto: only when both a compiler and a device exist (nvcc alone is installed on GPU-less machines here).
    return shutil.which("nvcc") is not None and Path("/dev/nvidia0").exists()


def cmake_options(cuda: bool) -> list[str]:
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_COMMON=OFF",
        "-DLLAMA_CURL=OFF",
        "-DGGML_NATIVE=ON",
        # all libraries end up in one folder beside the bindings; they find each other there
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    ]
    if cuda:
        opts += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('CMAKE_CUDA_ARCHITECTURES', 'native')}"]
    return opts


def cpu_signature() -> str:
    # GGML_NATIVE compiles for this CPU, so the CPU's feature flags are an input of the build.
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + ":" + hashlib.sha256(flags.encode()).hexdigest()[:16]


def build_key(pin: dict[str, str], patches: list[Path], opts: list[str]) -> str:
    h = hashlib.sha256()
    h.update(pin["sha256"].encode())
    for p in patches:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    h.update("\n".join(opts).encode())
    h.update(cpu_signature().encode())
    return h.hexdigest()[:20]


def apply_patches(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        print(f"applying {p.name}", flush=True)
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(tree), "-i", str(p)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"patch {p.name} does not apply:\n{r.stdout}{r.stderr}")


def run_cmake_build(src: Path, bdir: Path, opts: list[str], log: Path) -> None:
    with open(log, "w") as lf:
        r = subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), *opts], stdout=lf, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            fail(f"cmake configure failed, see {log}")
        jobs = str(os.cpu_count() or 2)
        proc = subprocess.Popen(["cmake", "--build", str(bdir), "-j", jobs, "--target", "llama"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            m = re.match(r"\[\s*(\d+)%\]", line)
            if m and sys.stdout.isatty():
                print(f"\r  building llama.cpp {m.group(1):>3}%", end="", flush=True)
            elif m and int(m.group(1)) % 25 == 0:
                print(f"  building llama.cpp {m.group(1)}%", flush=True)
        if sys.stdout.isatty():
            print()
        if proc.wait() != 0:
            fail(f"llama.cpp build failed, see {log}")


def link_into_venv(pkg_root: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    (site / PTH_NAME).write_text(str(pkg_root) + "\n")


def main() -> None:
    pin = read_pin()
    patches = sorted(PATCHES.glob("*.patch"))
    cuda = want_cuda()
    opts = cmake_options(cuda)
    key = build_key(pin, patches, opts)
    out = cache_dir() / "build" / key
    pkg_root = out / "pkg"
    info_path = pkg_root / "BUILD_INFO.json"
    if info_path.exists():
        link_into_venv(pkg_root)
        info = json.loads(info_path.read_text())
        print(f"llama.cpp build {key} cached ({'CUDA' if info['cuda'] else 'CPU'}, built in {info['build_s']:.0f}s)")
        return

    sdist = fetch_sdist(pin)
    t0 = time.time()
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    tree = work / pin["file"].removesuffix(".tar.gz")
    apply_patches(tree, patches)
    print(f"building llama.cpp ({'CUDA' if cuda else 'CPU'}) into {out} ...", flush=True)
    bdir = work / "cmake-build"
    run_cmake_build(tree / "vendor" / "llama.cpp", bdir, opts, out / "build.log")

    staging = out / "pkg.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tree / "llama_cpp", staging / "llama_cpp", ignore=shutil.ignore_patterns("server", "__pycache__"))
    libdir = staging / "llama_cpp" / "lib"
    libdir.mkdir(exist_ok=True)
    for so in bdir.rglob("*.so*"):
        if so.is_file():
            shutil.copy2(so, libdir / so.name)
    build_s = time.time() - t0
    (staging / "BUILD_INFO.json").write_text(json.dumps({
        "key": key, "sdist_sha256": pin["sha256"], "patches": [p.name for p in patches], "cmake": opts,
        "cuda": cuda, "build_s": build_s, "cpus": os.cpu_count(),
    }, indent=1))
    shutil.rmtree(pkg_root, ignore_errors=True)
    staging.rename(pkg_root)
    shutil.rmtree(bdir / "ggml" / "src", ignore_errors=True)  # object files; the libraries are copied out
    link_into_venv(pkg_root)
    print(f"llama.cpp built in {build_s:.0f}s (key {key})")


if __name__ == "__main__":
    main()
