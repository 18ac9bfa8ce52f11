"""The pinned, patched build: cached by its inputs, and loud about a patch that does not apply."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build_module():
    spec = importlib.util.spec_from_file_location("build_llama", ROOT / "tools" / "build_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_second_build_is_a_cache_hit() -> None:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_llama.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "cached" in r.stdout
    assert time.perf_counter() - t0 < 60


def test_loaded_library_is_patched() -> None:
    from pyspecter import native

    assert native.patch_series_version() >= native.PATCH_SERIES_VERSION


def test_key_changes_with_patches_and_options(tmp_path: Path) -> None:
    b = _build_module()
    pin = b.read_pin()
    p1 = tmp_path / "0001-a.patch"
    p1.write_text("one")
    p2 = tmp_path / "0001-a.patch.v2"
    p2.write_text("two")
    k1 = b.build_key(pin, [p1], ["-DX=1"])
    assert k1 == b.build_key(pin, [p1], ["-DX=1"])
    assert k1 != b.build_key(pin, [p2], ["-DX=1"])
    assert k1 != b.build_key(pin, [p1], ["-DX=2"])


def test_bad_patch_stops_with_its_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = _build_module()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.txt").write_text("hello\n")
    bad = tmp_path / "0099-does-not-apply.patch"
    bad.write_text("--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-goodbye\n+world\n")
    with pytest.raises(SystemExit) as exc:
        b.apply_patches(tree, [bad])
    assert exc.value.code == 2
    assert "0099-does-not-apply.patch" in capsys.readouterr().err


def test_patches_are_numbered_and_documented() -> None:
    readme = (ROOT / "patches" / "README.md").read_text()
    patches = sorted((ROOT / "patches").glob("*.patch"))
    assert patches
    for i, p in enumerate(patches, 1):
        assert p.name.startswith(f"{i:04d}-"), p.name
        assert p.name in readme
