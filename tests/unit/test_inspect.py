"""`inspect`, budgets, and the one-line exit-2 errors on bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

from pyspecter.budget import parse_budget, slots_for_budget
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.tiny import TINY_MODELS, build_tiny


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_inspect_json(name: str) -> None:
    # an emulated link and no fitted predictor: the whole budget is slots (placement.budget_slot_count)
    r = run_cli("inspect", name, "--json", "--budget", "50%", "--tier", "emulated:10")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("arch", "n_layer", "n_expert", "n_expert_used", "expert_bytes", "expert_total_bytes",
                "nonexpert_bytes", "slots_per_layer"):
        assert key in info
    lay = read_layout(build_tiny(name))
    assert info["n_expert"] == lay.n_expert == TINY_MODELS[name].n_expert
    assert info["expert_total_bytes"] == lay.layers[0].expert_bytes * lay.n_expert * len(lay.layers)
    assert info["expert_total_bytes"] + info["nonexpert_bytes"] <= lay.file_bytes
    assert info["slots_per_layer"] == info["slots_min"] == info["slots_max"] == lay.n_expert // 2
    assert info["slots"] == f"{lay.n_expert // 2}/{lay.n_expert} slots per layer"


def test_inspect_on_the_ram_tier_says_the_budget_is_left_free() -> None:
    """A budget alone on a model that fits runs on the RAM tier, where misses are computed in place: a session
    fills top-k slots and leaves the rest free, and inspect says so (placement.budget_slot_count)."""
    info = json.loads(run_cli("inspect", "tiny-qwen3moe", "--json", "--budget", "50%").stdout)
    k = info["n_expert_used"]
    assert info["tier"] == "ram" and info["slots_min"] == info["slots_max"] == k
    assert info["slots"].startswith(f"{k}/{info['n_expert']} slots per layer; the rest of the budget: left free")


def test_inspect_reports_quant_types_and_shared_experts() -> None:
    info = json.loads(run_cli("inspect", "tiny-mixtral", "--json").stdout)
    assert {t["type"] for t in info["layers"][0]["tensors"].values()} == {"Q8_0"}
    info = json.loads(run_cli("inspect", "tiny-qwen2moe", "--json").stdout)
    assert info["shared_expert_layers"] == info["n_layer"]


def test_expert_offsets_point_at_expert_bytes() -> None:
    # expert e of a tensor is one contiguous run: what the disk tier preads
    import gguf

    path = build_tiny("tiny-qwen3moe")
    lay = read_layout(path)
    t = lay.layers[1].tensors["down"]
    data = gguf.GGUFReader(path).get_tensor([x.name for x in gguf.GGUFReader(path).tensors].index(t.name)).data
    raw = path.read_bytes()
    e = 5
    assert raw[t.expert_offset(e): t.expert_offset(e) + t.expert_bytes] == data[e].tobytes()


def test_parse_budget() -> None:
    assert parse_budget("64MiB", 0) == 64 * 2**20
    assert parse_budget("1.5GB", 0) == 1_500_000_000
    assert parse_budget("1000", 0) == 1000
    assert parse_budget("40%", 1000) == 400
    for bad in ("lots", "-5MiB", "0", "150%", "12 parsecs", ""):
        with pytest.raises(SpecterError):
            parse_budget(bad, 1000)


def test_slots_for_budget() -> None:
    lay = read_layout(build_tiny("tiny-qwen3moe"))
    row = sum(L.expert_bytes for L in lay.layers)
    assert slots_for_budget(lay, row * 3 + 1) == 3
    assert slots_for_budget(lay, row - 1) == 0
    assert slots_for_budget(lay, row * 1000) == lay.n_expert


def _assert_one_line_error(r, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert needle in lines[0], lines[0]


def test_missing_file(tmp_path: Path) -> None:
    _assert_one_line_error(run_cli("inspect", str(tmp_path / "nope.gguf")), "no such file")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "text.gguf"
    p.write_text("hello, I am not a model\n")
    _assert_one_line_error(run_cli("inspect", str(p)), "not a GGUF")


def test_truncated_gguf(tmp_path: Path) -> None:
    src = build_tiny("tiny-qwen3moe")
    for cut in (64, src.stat().st_size // 2, src.stat().st_size - 10):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(src.read_bytes()[:cut])
        _assert_one_line_error(run_cli("inspect", str(p)), "GGUF")


def test_dense_model_refused(dense_gguf: Path) -> None:
    _assert_one_line_error(run_cli("inspect", str(dense_gguf)), "no experts")
    _assert_one_line_error(run_cli("verify", str(dense_gguf), "--slots", "2"), "no experts")


def test_bad_budget() -> None:
    _assert_one_line_error(run_cli("inspect", "tiny-qwen3moe", "--budget", "lots"), "cannot parse budget")


def test_unknown_model_name() -> None:
    _assert_one_line_error(run_cli("inspect", "tiny-nonexistent"), "not a built-in model")


def test_help_explains() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("inspect", "verify", "models", "demo"):
        assert cmd in r.stdout
    assert "--budget" in run_cli("inspect", "--help").stdout


def test_input_is_not_modified(tmp_path: Path) -> None:
    # bad input must lose nothing: the commands only read the model
    src = build_tiny("tiny-mixtral")
    p = tmp_path / "m.gguf"
    shutil.copy(src, p)
    before = p.read_bytes()
    run_cli("inspect", str(p), "--budget", "nonsense")
    assert p.read_bytes() == before


def test_inspect_draft_refuses_a_draft_that_routes_differently() -> None:
    r = run_cli("inspect", "tiny-qwen3moe", "--draft", "tiny-mixtral", "--draft-tokens", "1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
