"""`inspect --draft`: a draft's bytes against the budget, and its acceptance and routing recall measured through
llama.cpp (so here and not among the unit tests, which run before the library is built)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny


def test_inspect_draft_reports_its_bytes_acceptance_and_routing_recall(tmp_path: Path) -> None:
    from pyspecter.models.draft import make_draft

    target = build_tiny("tiny-qwen3moe")
    d = make_draft(target, tmp_path / "d.gguf", experts_type="Q8_0", progress=False)
    args = ("--budget", "50%", "--tier", "emulated:10", "--draft-tokens", "4", "-k", "2")
    r = run_cli("inspect", "tiny-qwen3moe", "--draft", str(d), *args, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)["draft"]
    assert info["file_bytes"] == d.stat().st_size and info["k"] == 2
    assert info["routed_expert_bytes"] == info["ffn_bytes"] == read_layout(d).expert_total_bytes  # no shared ones
    assert info["file_share_of_budget"] == pytest.approx(info["file_bytes"] / info["budget_bytes"])
    assert 0 <= info["acceptance"] <= 1 and 0 <= info["routing_recall_same_token"] <= 1
    # the target as its own draft: every drafted token is accepted and every expert predicted
    r = run_cli("inspect", "tiny-qwen3moe", "--draft", str(target), *args)
    assert r.returncode == 0, r.stderr
    assert "acceptance at K=2: 100.0%" in r.stdout and "same tokens 100.0%" in r.stdout, r.stdout
