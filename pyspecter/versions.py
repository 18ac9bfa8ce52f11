"""What this pyspecter is built from: the package, the patch series (its C API and patch count) and llama.cpp.

In a checkout these come from the checkout (the pin, patches/); a `pip install` has no checkout, so its build
backend (tools/pip_backend.py) records them in ``pyspecter/_native.json``, which is read first when present."""

from __future__ import annotations

from pathlib import Path

from pyspecter.native.install import installed_build
from pyspecter.native.lib import PATCH_SERIES_VERSION

ROOT = Path(__file__).resolve().parents[1]


def llama_cpp_versions() -> tuple[str, str]:
    """(llama-cpp-python's version, the llama.cpp commit bundled in it): from the install's record or the pin the
    build fetched, else the installed bindings (no library is loaded)."""
    pin: dict[str, str] = {}
    path = ROOT / "vendor" / "llama-cpp-python.pin"
    if (rec := installed_build()).get("llama_cpp_python"):
        pin = {"version": rec["llama_cpp_python"], "llama_cpp_commit": rec["llama_cpp_commit"]}
    elif path.is_file():
        for line in path.read_text().splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                k, v = line.split("=", 1)
                pin[k.strip()] = v.strip()
    version = pin.get("version")
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("llama_cpp_python")
        except PackageNotFoundError:
            version = "not installed"
    return version, pin.get("llama_cpp_commit", "unknown")


def patch_count() -> int | None:
    if "patches" in (rec := installed_build()):
        return len(rec["patches"])
    d = ROOT / "patches"
    return len(list(d.glob("*.patch"))) if d.is_dir() else None


def describe() -> str:
    from pyspecter._version import __version__

    py, commit = llama_cpp_versions()
    n = patch_count()
    patches = f", {n} patches" if n is not None else ""
    return (f"pyspecter {__version__}\npatch series: C API v{PATCH_SERIES_VERSION}{patches}\n"
            f"llama.cpp: {commit} (llama-cpp-python {py})")
