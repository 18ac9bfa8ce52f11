"""`pip install` builds the native library (tools/pip_backend.py), so an sdist must carry everything the build reads,
a wheel must record the build it links, `--version` must read that record outside a checkout, and a missing library
must be one line naming the command that fixes it. Nothing here builds llama.cpp."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_builds_through_the_native_backend() -> None:
    bs = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert bs["build-backend"] == "pip_backend" and bs["backend-path"] == ["tools"]
    assert (ROOT / "tools" / "pip_backend.py").is_file()


def test_the_sdist_carries_what_the_native_build_reads(tmp_path: Path) -> None:
    # the backend's own build_sdist (setuptools'), run as pip would: in the project folder, tools/ on the path
    code = "import sys; sys.path.insert(0, 'tools'); import pip_backend; print(pip_backend.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    with tarfile.open(tmp_path / r.stdout.strip().splitlines()[-1]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import build_llama
    finally:
        sys.path.remove(str(ROOT / "tools"))
    # every input of the build key (so an sdist build shares the checkout's cached builds), and the pin
    wanted = {p.relative_to(ROOT).as_posix() for p in [*build_llama.source_files(), *ROOT.glob("patches/*.patch")]}
    wanted |= {"vendor/llama-cpp-python.pin", "tools/build_llama.py", "tools/pip_backend.py", "pyproject.toml"}
    assert wanted <= names, sorted(wanted - names)
    assert not any(n.endswith((".so", ".gguf", ".pyc")) for n in names)


def _wheel(path: Path, files: dict[str, bytes]) -> None:
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for n, d in files.items())
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("p-1.dist-info/RECORD", record + "p-1.dist-info/RECORD,,\n")


def test_a_wheel_records_the_build_with_valid_hashes(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import pip_backend
    finally:
        sys.path.remove(str(ROOT / "tools"))
    whl = tmp_path / "p-1-py3-none-any.whl"
    _wheel(whl, {"p/__init__.py": b"x = 1\n"})
    pip_backend.add_to_wheel(whl, {"pyspecter-llama.pth": "/cache/build/KEY/pkg\n", "p/_native.json": "{}\n"})
    with zipfile.ZipFile(whl) as z:
        record = z.read("p-1.dist-info/RECORD").decode().splitlines()
        rows = {line.split(",")[0]: line.split(",")[1:] for line in record}
        assert set(rows) == set(z.namelist())
        for name, (digest, size) in rows.items():
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
        assert z.read("pyspecter-llama.pth") == b"/cache/build/KEY/pkg\n"


def test_version_outside_a_checkout_reads_the_install_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspecter import versions
    from pyspecter.native import install

    rec = {"root": str(tmp_path), "key": "k", "cuda": False, "patches": ["0001-a.patch", "0002-b.patch"],
           "llama_cpp_python": "9.9.9", "llama_cpp_commit": "abc1234"}
    (tmp_path / "_native.json").write_text(json.dumps(rec))
    monkeypatch.setattr(install, "NATIVE_JSON", tmp_path / "_native.json")
    monkeypatch.setattr(versions, "ROOT", tmp_path / "site-packages")  # no checkout: no pin, no patches/
    text = versions.describe()
    assert ", 2 patches\n" in text and "llama.cpp: abc1234 (llama-cpp-python 9.9.9)" in text
    monkeypatch.setattr(install, "NATIVE_JSON", tmp_path / "absent.json")  # neither: says so, no crash
    assert "llama.cpp: unknown" in versions.describe()


def test_a_missing_library_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    import importlib

    cli_app = importlib.import_module("pyspecter.cli.app")  # the module; the package's `app` is the Typer object

    def no_bindings(args):
        raise ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")

    monkeypatch.setattr(cli_app, "app", no_bindings)
    with pytest.raises(SystemExit) as exc:
        cli_app.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama.cpp library is not installed" in err
    assert "tools/build_llama.py" in err  # this checkout's fix: link (or build) the cached build

    def other(args):
        raise ModuleNotFoundError("No module named 'nope'", name="nope")

    monkeypatch.setattr(cli_app, "app", other)
    with pytest.raises(ModuleNotFoundError):  # any other missing module is a bug: its traceback stays
        cli_app.main()


def test_an_installed_copy_is_told_to_reinstall_from_where_it_came(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspecter.native import install

    monkeypatch.setattr(install, "ROOT", tmp_path)  # site-packages: no tools/build_llama.py
    monkeypatch.setattr(install, "install_source", lambda: "/src/pyspecter")
    cmd = install.fix_command()
    assert "-m pip install --force-reinstall --no-deps --no-cache-dir /src/pyspecter" in cmd
    monkeypatch.setattr(install, "install_source", lambda: None)
    assert install.fix_command().endswith(" pyspecter")
    gone = tmp_path / "_native.json"  # the install's record names a build folder the cache no longer has
    gone.write_text(json.dumps({"root": str(tmp_path / "cleared")}))
    monkeypatch.setattr(install, "NATIVE_JSON", gone)
    no_module = ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
    assert f"gone: this install used the build in {tmp_path / 'cleared'}" in install.missing_native(no_module)
    monkeypatch.setattr(install, "NATIVE_JSON", tmp_path / "absent.json")
    err = FileNotFoundError("Shared library with base name 'llama' not found")
    assert "not loadable" in install.missing_native(err)
    assert install.missing_native(FileNotFoundError("model.gguf")) is None
