"""`pyspecter scale`: each configuration in its own process, from a cold page cache, with what it cost; the disk
tier's logits are stock's. Figures are not asserted (shared machines): only that they are there and sane."""

from __future__ import annotations

import json

from conftest import run_cli


def test_scale_measures_stock_and_the_disk_tier_in_fresh_processes() -> None:
    r = run_cli("scale", "bench-qwen3moe", "--budgets", "25%,auto", "-n", "3", "--prompt-tokens", "8", "--json",
                timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    runs = {x["config"]: x for x in out["runs"]}
    assert list(runs)[0] == "stock" and "25%" in runs and len(runs) == 3
    for x in runs.values():
        assert "error" not in x, x
        assert x["load_s"] > 0 and x["peak_rss"] > 0 and x["tpot_s"] > 0 and len(x["tokens"]) == 3
    # a quarter of the experts, less what a learned predictor fitted for the model takes (the session's default)
    # a random-weight built-in: teacher-forced on the held-out text, stock's logits at every step
    assert out["decode"] == runs["25%"]["decode"] == "teacher-forced"
    assert runs["25%"]["same_logits_as_stock"] is True and runs["25%"]["same_tokens_as_stock"] is None
    assert runs["25%"]["tokens"] == runs["stock"]["tokens"]  # both fed the same text
    assert out["n_expert_used"] <= runs["25%"]["slots_per_layer"] <= out["n_expert"] // 4
    # the disk tier does not pre-fault the experts at load (patch 0005): it reads less than the file
    assert runs["25%"]["load_read_bytes"] < out["file_bytes"]
