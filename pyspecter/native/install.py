"""Where this pyspecter's native library comes from, and the one command that puts it back when it is missing.

A checkout links the cached build with tools/build_llama.py (`make build`); a `pip install` records the build it
made (tools/pip_backend.py), so a missing library there means the install's cache folder was removed, and only a
reinstall that builds again brings it back.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[2]
NATIVE_JSON = ROOT / "pyspecter" / "_native.json"  # tools/pip_backend.py writes it into an installed package
# the llama-cpp-python loader's own words when the library file is missing or does not load
_LOADER_ERRORS = ("Shared library with base name", "Failed to load shared library")


def install_source() -> str | None:
    """The folder or file pip installed this pyspecter from (PEP 610's direct_url.json); None for an index."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        text = distribution("pyspecter").read_text("direct_url.json")
    except PackageNotFoundError:
        return None
    url = urlparse(json.loads(text).get("url", "")) if text else None
    if url is None or url.scheme != "file":
        return None
    return unquote(url.path)


def installed_build() -> dict:
    """What `pip install` built and linked (tools/pip_backend.py's record); empty in a checkout."""
    try:
        return json.loads(NATIVE_JSON.read_text())
    except (OSError, ValueError):
        return {}


def fix_command() -> str:
    """What to run to (re)build and link the patched llama.cpp for this Python."""
    tool = ROOT / "tools" / "build_llama.py"
    if tool.is_file():  # running from a checkout: its build script links the cached build (or builds it)
        return f"{shlex.quote(sys.executable)} {shlex.quote(str(tool))}"
    # --no-cache-dir: a wheel pip cached from an sdist records the build folder that is gone; it must build anew
    return (f"{shlex.quote(sys.executable)} -m pip install --force-reinstall --no-deps --no-cache-dir "
            f"{shlex.quote(install_source() or 'pyspecter')}")


def missing_native(e: BaseException) -> str | None:
    """One line saying the native library is missing or does not load and what to run, when ``e`` says that (the
    bindings cannot be imported, or their loader cannot open libllama); None for any other error."""
    if isinstance(e, ModuleNotFoundError):
        if e.name != "llama_cpp" and not (e.name or "").startswith("llama_cpp."):
            return None
        why = "not installed"
    elif isinstance(e, (RuntimeError, FileNotFoundError)) and str(e).startswith(_LOADER_ERRORS):
        why = f"not loadable ({e})"
    else:
        return None
    root = installed_build().get("root")
    if root and not Path(root).is_dir():
        why = f"gone: this install used the build in {root}, which was removed"
    return f"the patched llama.cpp library is {why}; run `{fix_command()}`"
