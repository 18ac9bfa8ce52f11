"""read_layout's cache: the same layout as a fresh parse, and never a stale one once the file changes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pyspecter.errors import SpecterError
from pyspecter.layout import _cache_path, read_layout
from pyspecter.models.tiny import build_tiny


def test_a_cached_layout_equals_a_fresh_parse(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    shutil.copyfile(build_tiny("tiny-qwen3moe"), p)
    first = read_layout(p)
    assert _cache_path(p, p.stat()).is_file()
    again = read_layout(p)
    assert again == first and again.path == p
    assert again.layers[0].tensors["up"].shape == first.layers[0].tensors["up"].shape
    assert isinstance(again.layers[0].tensors["up"].shape, tuple)


def test_a_changed_file_is_parsed_again(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    data = build_tiny("tiny-qwen3moe").read_bytes()
    p.write_bytes(data)
    read_layout(p)
    with open(p, "r+b") as f:  # cut in place: same path and inode, new size and time
        f.truncate(len(data) // 2)
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 1))
    with pytest.raises(SpecterError, match="GGUF"):
        read_layout(p)


def test_a_broken_cache_entry_is_parsed_again_and_replaced(tmp_path: Path) -> None:
    p = tmp_path / "m.gguf"
    shutil.copyfile(build_tiny("tiny-qwen3moe"), p)
    first = read_layout(p)
    entry = _cache_path(p, p.stat())
    entry.write_text('{"arch": "qwen3moe", "layers": [')  # cut short, as a crash mid-write would leave it
    assert read_layout(p) == first
    assert read_layout(p) == first and entry.read_text().endswith("}")
