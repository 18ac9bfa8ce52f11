"""`models list`'s sizes and built flags: what a first use of each built-in writes, before it is written."""

from __future__ import annotations

import json

from conftest import run_cli

from pyspecter.models import catalog, tiny


def test_every_builtin_has_a_size_and_big_ones_say_so() -> None:
    by_name = {b.name: b for b in catalog.builtins()}
    assert set(by_name) == set(catalog.builtin_names())
    assert all(b.nbytes > 0 for b in by_name.values())
    # Qwen3-30B-A3B's shapes: tens of GB, whether built or not (the issue: nothing warned of 33 GB)
    assert 30e9 < by_name["big-qwen3moe"].nbytes < 35e9 and 15e9 < by_name["big-qwen3moe-q4"].nbytes < 20e9
    assert by_name["smol-moe-draft"].nbytes <= by_name["smol-moe"].nbytes or by_name["smol-moe-draft"].built


def test_a_built_fixture_is_found_at_its_size() -> None:
    path = tiny.build_tiny("tiny-qwen3moe")  # cached: milliseconds
    b = next(b for b in catalog.builtins() if b.name == "tiny-qwen3moe")
    assert b.built and b.path == path and b.size == "file" and b.nbytes == path.stat().st_size
    # the plan it was listed with before it was built: the file less its header
    planned = tiny.planned_bytes(tiny.TINY_MODELS["tiny-qwen3moe"])
    assert planned <= b.nbytes < planned + (1 << 20)


def test_smol_moe_estimate_matches_the_pinned_source() -> None:
    from pyspecter.models import smol
    from pyspecter.paths import cache_dir

    src = cache_dir() / "smollm2" / smol.GGUF_FILE
    if src.exists():  # fetched by any earlier smol-moe build; the constant stands in where it is not
        assert smol._moe_bytes(src, 16) == catalog.SMOL_MOE_BYTES


def test_models_list_shows_sizes_and_json() -> None:
    r = run_cli("models", "list")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("big-qwen3moe "))
    assert "GB" in line and line.split()[-1] in ("yes", "no"), r.stdout
    r = run_cli("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)}
    assert rows["tiny-qwen3moe"]["bytes"] > 0 and rows["big-qwen3moe"]["bytes"] > 30e9
    assert {"size", "built", "path"} <= set(rows["smol-moe"])
