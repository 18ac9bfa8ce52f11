"""The GPU half of a CUDA build, compiled here and carried to a GPU machine so that its short lease need not compile it.

A CUDA build of llama.cpp spends nearly all its time in ggml-cuda's kernels: 155-176 s of the first GPU machine's
16 cores, a quarter of gpu_check's one-command budget; 15 min on 2 cores. Two of its libraries hold the GPU side, and
neither has code for a particular CPU (ggml applies its -march=native to ggml-cpu alone; the x86 instructions of
these two use no AVX register):
  - libggml-cuda, the backend (patch 0008's kernels);
  - libggml, the backend registry, which differs from the CPU build's only by GGML_USE_CUDA.
Every other library is the CPU build's: ggml-cpu with the GPU machine's own native flags, ggml-base, and libllama
with csrc/. So the GPU machine builds the CPU configuration (seconds on 16 cores) and takes the two from the part.

  tools/cuda_part.py export DEST        here: this checkout's CUDA build's two libraries (SPECTER_CUDA_ARCH, as
                                        tools/build_llama.py built them) and a manifest of what they were built from,
                                        as one xz archive (~25 MiB); exit 2 if that build is not in the cache
  tools/cuda_part.py splice PART        there: when PART was built from what this machine's CUDA build would be built
                                        from (the pinned sdist, patches/, CMakeLists.txt, the CUDA options and
                                        architecture, CUDA's major release), this machine's CPU build plus PART's two
                                        libraries, cached under a key of both and linked into this Python as
                                        build_llama.py links its builds; else exit 3 saying what differs, and the
                                        caller builds CUDA itself (SPECTER_CUDA=1 tools/build_llama.py)
  tools/cuda_part.py --print-root PART  where splice puts its build

The CUDA runtime and cuBLAS that libggml-cuda was linked against are found on this machine by build_llama.py's rules
(the toolkit, else NVIDIA's wheel) and linked into the library folder under their sonames: the library's run path
starts with $ORIGIN, so the loader takes them there before the run path the build machine wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import build_llama as b

MANIFEST = "CUDA_PART.json"
LIBS = ("libggml-cuda", "libggml")  # the GPU half: the backend and the registry that names it
MISMATCH = 3  # exit status of a part that does not fit this machine's build (the caller builds CUDA instead)


def expected() -> dict:
    """What a CUDA part must have been built from to stand in for this checkout's CUDA build of SPECTER_CUDA_ARCH.
    The options are taken with AMX allowed whatever this machine decides: AMX reaches ggml-cpu only, built here."""
    pin = b.read_pin()
    return {
        "sdist_sha256": pin["sha256"],
        "patches": {p.name: b.sha256_file(p) for p in sorted(b.PATCHES.glob("*.patch"))},
        "cmake_lists": b.sha256_file(b.CMAKE_LISTS),
        "options": b.cmake_options(True, amx=True),
        "arch": b.cuda_arch(),
    }


def differences(manifest: dict, want: dict, cuda_major: int | None) -> list[str]:
    """What keeps ``manifest``'s part from standing in for the build ``want`` describes, one phrase each."""
    out = [f"{k} differs" for k in want if manifest.get(k) != want[k]]
    major = str(manifest.get("cuda_release", "")).split(".")[0]
    if cuda_major is None:
        out.append("no nvcc here to say CUDA's release")
    elif major != str(cuda_major):
        out.append(f"built with CUDA {manifest.get('cuda_release')}, this machine has CUDA {cuda_major}")
    return out


def read_manifest(part: Path) -> dict:
    if not part.is_file():
        b.fail(f"{part}: no such file")
    try:
        with tarfile.open(part) as tf:
            f = tf.extractfile(MANIFEST)
            manifest = json.loads(f.read()) if f else None
    except (tarfile.TarError, KeyError, ValueError, OSError, EOFError) as e:
        b.fail(f"{part}: not a CUDA part ({e})")
    if not isinstance(manifest, dict) or "libs" not in manifest:
        b.fail(f"{part}: not a CUDA part (no {MANIFEST})")
    return manifest


def _build_root(cuda: bool) -> Path:
    env = dict(os.environ, SPECTER_CUDA="1" if cuda else "0")
    r = subprocess.run([sys.executable, str(Path(b.__file__)), "--print-root"], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        b.fail(f"tools/build_llama.py --print-root failed: {r.stderr.strip()[-300:]}")
    return Path(r.stdout.strip().splitlines()[-1])


def export(dest: Path) -> None:
    root = _build_root(cuda=True)
    info_path = root / "BUILD_INFO.json"
    if not info_path.is_file():
        b.fail(f"no CUDA build of this checkout for architecture {b.cuda_arch()} in the cache: run SPECTER_CUDA=1 "
               f"tools/build_llama.py first (about 15 min on 2 cores)")
    info = json.loads(info_path.read_text())
    libdir = root / "llama_cpp" / "lib"
    files = {p.name: p for p in libdir.glob("lib*.so*") if p.name.split(".so")[0] in LIBS}
    links = {n: os.readlink(p) for n, p in files.items() if p.is_symlink()}
    real = {n: p for n, p in files.items() if not p.is_symlink()}
    if sorted(n.split(".so")[0] for n in real) != sorted(LIBS):
        b.fail(f"{libdir}: expected one file each of {', '.join(LIBS)}, found {sorted(real)}")
    manifest = {**expected(), "cuda_release": info["cuda_setup"]["release"], "links": links,
                "libs": {n: b.sha256_file(p) for n, p in real.items()},
                "built": {k: info.get(k) for k in ("key", "cpus", "cpu")}}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as tf:
        data = json.dumps(manifest, indent=1).encode()
        ti = tarfile.TarInfo(MANIFEST)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
        for n, p in sorted(real.items()):
            tf.add(p, arcname=n)
    tmp.replace(dest)
    print(f"{dest}: {dest.stat().st_size / 2**20:.1f} MiB, {', '.join(sorted(real))} of CUDA build "
          f"{info['key']} (CUDA {manifest['cuda_release']}, arch {manifest['arch']})")


def cuda_runtime_libs(major: int) -> tuple[dict[str, Path], str]:
    """This machine's CUDA runtime and cuBLAS that libggml-cuda needs, by soname, and where cuBLAS came from (as
    build_llama.py's cuda_hints finds them: the toolkit's, else NVIDIA's wheel on this Python's path)."""
    nvcc = b.find_nvcc()
    root = nvcc.resolve().parent.parent
    dirs = b.toolkit_lib_dirs(root)
    wheel = b.find_cublas_wheel(major)
    cublas = "toolkit" if b.toolkit_has_cublas(root) else (str(wheel[1]) if wheel else "none")
    if wheel:
        dirs.append(wheel[1])
    found = {}
    for name in (f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}"):
        hit = next((d / name for d in dirs if (d / name).exists()), None)
        if hit is None:
            print(f"no {name} in {', '.join(map(str, dirs)) or 'no CUDA library folder'}", file=sys.stderr)
            sys.exit(MISMATCH)
        found[name] = hit.resolve()
    return found, cublas


def splice_key(cpu_key: str, manifest: dict, runtime: dict[str, Path]) -> str:
    h = hashlib.sha256()
    h.update(cpu_key.encode())
    h.update(json.dumps(manifest, sort_keys=True).encode())
    h.update(json.dumps({k: str(v) for k, v in sorted(runtime.items())}).encode())
    return "s" + h.hexdigest()[:19]


def splice(part: Path, print_root: bool = False) -> None:
    manifest = read_manifest(part)
    nvcc = b.find_nvcc()
    release = b.nvcc_release(nvcc) if nvcc else None
    bad = differences(manifest, expected(), release[0] if release else None)
    if bad:
        print(f"{part} does not fit this build: {'; '.join(bad)}", file=sys.stderr)
        sys.exit(MISMATCH)
    runtime, cublas = cuda_runtime_libs(release[0])
    cpu_root = _build_root(cuda=False)
    if not print_root and not (cpu_root / "BUILD_INFO.json").is_file():
        t0 = time.time()
        r = subprocess.run([sys.executable, str(Path(b.__file__))], env=dict(os.environ, SPECTER_CUDA="0"))
        if r.returncode != 0:
            sys.exit(r.returncode)
        print(f"the CPU build took {time.time() - t0:.0f}s", flush=True)
    out = b.cache_dir() / "build" / splice_key(cpu_root.parent.name, manifest, runtime)
    pkg_root = out / "pkg"
    if print_root:
        print(pkg_root)
        return
    lock = b.hold_key_lock(out)  # noqa: F841  # held until this process exits
    if not (pkg_root / "BUILD_INFO.json").is_file():
        t0 = time.time()
        staging = out / "pkg.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(cpu_root, staging, symlinks=True)
        libdir = staging / "llama_cpp" / "lib"
        for p in list(libdir.iterdir()):
            if p.name.split(".so")[0] in LIBS:
                p.unlink()
        with tarfile.open(part) as tf:
            for name in manifest["libs"]:
                tf.extract(name, libdir, filter="data")
        for name, sha in manifest["libs"].items():
            if b.sha256_file(libdir / name) != sha:
                b.fail(f"{part}: {name} does not match its manifest (a damaged archive)")
        for name, target in manifest["links"].items():
            (libdir / name).symlink_to(target)
        for name, path in runtime.items():
            (libdir / name).symlink_to(path)
        b.check_exports(libdir, out / "exports.txt")
        cpu_info = json.loads((cpu_root / "BUILD_INFO.json").read_text())
        info = {**cpu_info, "key": out.name, "cuda": True, "cmake": cpu_info["cmake"] + b.cuda_options(),
                "cuda_setup": {"nvcc": str(nvcc), "release": f"{release[0]}.{release[1]}", "arch": b.cuda_arch(),
                               "cublas": cublas, "libcuda": "the driver's, at run time"},
                "cuda_part": {"file": str(part), **manifest["built"], "cuda_release": manifest["cuda_release"]},
                "cpu_build_key": cpu_root.parent.name, "build_s": cpu_info["build_s"] + time.time() - t0,
                "cpus": os.cpu_count()}
        (staging / "BUILD_INFO.json").write_text(json.dumps(info, indent=1))
        shutil.rmtree(pkg_root, ignore_errors=True)
        staging.rename(pkg_root)
        log = cpu_root.parent / "build.log"  # what was compiled here: the CPU build's (gpu_check keeps its tail)
        if log.is_file() and not (out / "build.log").exists():
            (out / "build.log").symlink_to(log)
        print(f"llama.cpp CUDA build {out.name}: this machine's CPU build {cpu_root.parent.name} with the CUDA part "
              f"of build {manifest['built']['key']} (CUDA {manifest['cuda_release']}, arch {manifest['arch']})")
    else:
        print(f"llama.cpp build {out.name} cached (CUDA, spliced)")
    if b.may_link(True):
        b.link_into_venv(pkg_root)
    else:
        print(b.NOT_LINKED.format(root=pkg_root))


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "export":
        export(Path(args[1]))
    elif len(args) == 2 and args[0] in ("splice", "--print-root"):
        splice(Path(args[1]), print_root=args[0] == "--print-root")
    else:
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
