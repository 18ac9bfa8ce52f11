"""pip's build backend for pyspecter (pyproject's ``backend-path``): setuptools builds the Python package, and
tools/build_llama.py, the one implementation of the native build, builds the patched llama.cpp, so `pip install .`
or `pip install` of an sdist gives a working tool, as llama-cpp-python's install does.

The native build is build_llama.py's ``main()`` unchanged: the pinned sdist fetched and its sha256 checked, the
patches applied, CMake, and the same cache (``$SPECTER_CACHE`` or ``~/.cache/pyspecter``) under the same key, so a
warm cache makes the install a cache hit and `make build` and `pip install` share builds. Its last step, linking the
bindings into a venv, becomes recording them in the wheel: a ``pyspecter-llama.pth`` naming the cached build (the
file build_llama.py writes, so the two never disagree) and ``pyspecter/_native.json`` (what was built, for
``--version`` and for the message that says how to reinstall). The libraries stay in the cache rather than being
copied into the wheel because a wheel cannot hold symlinks: copies of libggml.so and libggml.so.0 would be two
files, and a process that opens one by path while the loader maps the other by soname holds two instances of the
library, each with its own state (the reason build_llama.py keeps CMake's links).

``SPECTER_NATIVE=0`` skips the native build (the Makefile's editable install, whose `make build` does it next).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import build_sdist, get_requires_for_build_sdist  # noqa: F401  # the sdist: setuptools'

NATIVE_JSON = "pyspecter/_native.json"
NOT_INSTALLABLE = ("this build cannot be installed here: a CUDA build needs a CUDA driver to load (SPECTER_CUDA=0 "
                   "builds for the CPU), and an ASan build (SPECTER_ASAN=1) is for `make asan-test`")


def _skip_native() -> bool:
    return os.environ.get("SPECTER_NATIVE") == "0"


def _build_llama():
    """tools/build_llama.py as a module (backend-path puts tools/ on sys.path)."""
    import build_llama

    return build_llama


def _native_requires() -> list[str]:
    """What the native build needs in pip's isolated environment beyond setuptools: CMake when the machine has
    none new enough, and pip itself (build_llama.py fetches the pinned sdist with `python -m pip download`, and the
    isolated environment hides the installing venv's pip) when the sdist is not already in the cache."""
    if _skip_native():
        return []
    b = _build_llama()
    reqs = []
    on_path = shutil.which("cmake")
    version = b._cmake_version(on_path) if on_path else None
    if version is None or version < b.MIN_CMAKE:
        reqs.append(f"cmake>={'.'.join(map(str, b.MIN_CMAKE))}")
    cached = (b.cache_dir() / "sdist" / b.read_pin()["file"]).is_file()
    if not cached and not os.environ.get("SPECTER_SDIST") and importlib.util.find_spec("pip") is None:
        reqs.append("pip")
    return reqs


def get_requires_for_build_wheel(config_settings=None) -> list[str]:
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *_native_requires()]


def get_requires_for_build_editable(config_settings=None) -> list[str]:
    return [*_setuptools.get_requires_for_build_editable(config_settings), *_native_requires()]


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None) -> str:
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None) -> str:
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_native() -> Path:
    """Run build_llama.py's build (or find it cached) and return the folder holding its ``llama_cpp`` package."""
    b = _build_llama()
    # what build_llama.py would build but not link, refused before a build of minutes (CUDA: about an hour)
    if b.want_asan() or not b.may_link(b.want_cuda()):
        b.fail(NOT_INSTALLABLE)
    linked: list[Path] = []
    # The build ends by linking the bindings into the running Python's site-packages; here that Python is pip's
    # throwaway build environment, so the folder is taken for the wheel instead.
    argv, sys.argv = sys.argv, [b.__file__]  # main() reads its own flags from sys.argv; it gets none
    try:
        b.main(link=linked.append)
    finally:
        sys.argv = argv
    if not linked:  # build_llama.py declined to link it (and said why): an install must not end up without one
        b.fail(NOT_INSTALLABLE)
    return linked[-1]


def native_record(root: Path) -> dict:
    """What ``pyspecter/_native.json`` says about the build a wheel links to."""
    b = _build_llama()
    info = json.loads((root / "BUILD_INFO.json").read_text())
    pin = b.read_pin()
    return {"root": str(root), "key": info["key"], "cuda": info["cuda"], "patches": info["patches"],
            "llama_cpp_python": pin["version"], "llama_cpp_commit": pin["llama_cpp_commit"]}


def add_to_wheel(wheel: Path, files: dict[str, str]) -> None:
    """Add text files to a built wheel, with their RECORD lines (name, urlsafe-base64 sha256, size)."""
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        record = zin.read(record_name).decode()
        for item in zin.infolist():
            if item.filename != record_name and item.filename not in files:
                zout.writestr(item, zin.read(item))
        lines = [line for line in record.splitlines() if line.split(",", 1)[0] not in files]
        for name, text in files.items():
            data = text.encode()
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    tmp.replace(wheel)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    root = None if _skip_native() else build_native()
    name = _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    if root is not None:
        add_to_wheel(Path(wheel_directory) / name, {
            _build_llama().PTH_NAME: f"{root}\n",
            NATIVE_JSON: json.dumps(native_record(root), indent=1) + "\n",
        })
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None) -> str:
    # An editable install runs the checkout's code, whose versions come from the checkout itself: only the link.
    root = None if _skip_native() else build_native()
    name = _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    if root is not None:
        add_to_wheel(Path(wheel_directory) / name, {_build_llama().PTH_NAME: f"{root}\n"})
    return name
